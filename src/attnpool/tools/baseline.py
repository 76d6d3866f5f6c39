"""The classic baseline: attention metadata kept the way engines kept it before fused updates.

It exists only to be measured against (``attnpool bench``, ``benchmarks/``) and to prove, in the
tests, that the comparison is like for like: for every real row its ``cache_seqlens``,
``cu_seqlens_k`` and live page-table columns equal what ``pool.decode.update_`` (or chain
``pool.verify.update_``) writes. It follows the description in docs/design.md, Classic baseline:

* **Init**: every buffer is its own zero-filled allocation (``zeros``, so that rows
  nobody writes are at least in range), one set per phase, no overlay.
* **Replay, per step**: the graph runner pads the batch by filling its own padded input buffers
  (lengths ``pad_seq_len``, request 0), then the backend copies ``seq_lens`` into
  ``cache_seqlens`` (verify adds N first), writes ``cu_seqlens_k[1:]`` from a cumsum (element 0 is
  assumed to still be the zero of init), reads the longest length from the *host* copy of the
  lengths to choose ``max_pages``, gathers ``req_to_token[req_pool_indices[:, None],
  page_starts[:max_pages]]``, floor-divides by the page size and copies the block into
  ``page_table[:, :max_pages]`` (with page size 1 every column starts a page, so the gather is the
  row gather ``req_to_token[req_pool_indices, :max_pages]``, as engines write it, and there is
  nothing to divide). Every op is its own kernel launch.

Padded rows therefore read request slot 0's pages (whatever that request is), not a reserved pad
page; attnpool's padded rows differ on purpose and are excluded from the parity tests.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..arena import plan_arena
from ..config import PoolConfig, ceil_div
from ..errors import InputError
from ..inputs import check_bs


class Fill(enum.Enum):
    """How the per-buffer baseline allocates: ``ZEROS`` (engine style) or ``EMPTY``."""

    ZEROS = "zeros"
    EMPTY = "empty"


def per_buffer_allocator(cfg: PoolConfig, fill: Fill = Fill.ZEROS
                         ) -> Callable[[], dict[str, Tensor]]:
    """A call that allocates every buffer of ``cfg``'s plan separately, one allocator call each
    (no overlay). Shapes are worked out once, here, so timing the call times allocation only.

    The buffer list comes from :func:`attnpool.plan_arena`, so it grows with every phase the
    library learns: the baseline always allocates exactly what the pool holds, just one by one.
    Keys are ``"<phase>.<name>"`` (``"shared.<name>"`` for constants).
    """
    make = torch.zeros if fill is Fill.ZEROS else torch.empty  # ok: the baseline's memsets
    dev = cfg.torch_device
    shapes = [(f"{p.spec.phase.value if p.spec.phase else 'shared'}.{p.spec.name}", p.shape,
               p.spec.dtype) for p in plan_arena(cfg).placements]
    return lambda: {key: make(shape, dtype=dt, device=dev) for key, shape, dt in shapes}


def alloc_per_buffer(cfg: PoolConfig, fill: Fill = Fill.ZEROS) -> dict[str, Tensor]:
    """Allocate ``cfg``'s buffers one by one now (see :func:`per_buffer_allocator`)."""
    return per_buffer_allocator(cfg, fill)()


@dataclass(frozen=True, slots=True)
class ClassicView:
    """What the classic replay hands its kernel: slices of its zero-initialised buffers."""

    bs: int
    cache_seqlens: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    page_table: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int


class ClassicPaged:
    """One phase's buffers and per-op replay, engine style (FLASH_ATTN layout only).

    Args:
        cfg: sizes (``max_bs``, ``max_context_len``, ``page_size``, ``pad_seq_len``, device).
        num_draft_tokens: 0 for decode; N for chain target verify (lengths get ``+ N`` and
            ``cu_seqlens_q`` steps by N).
    """

    def __init__(self, cfg: PoolConfig, num_draft_tokens: int = 0) -> None:
        dev, i32 = cfg.torch_device, torch.int32
        self.cfg = cfg
        self.add = num_draft_tokens
        q = max(1, num_draft_tokens)
        bs = cfg.max_bs
        # Backend buffers: one zero-filled allocation each.
        self.cache_seqlens = torch.zeros(bs, dtype=i32, device=dev)  # ok: baseline
        self.cu_seqlens_k = torch.zeros(bs + 1, dtype=i32, device=dev)  # ok: baseline
        self.page_table = torch.zeros(bs, cfg.max_pages, dtype=i32, device=dev)  # ok: baseline
        self.cu_seqlens_q = torch.arange(0, (bs + 1) * q, q, dtype=i32, device=dev)
        self.page_starts = torch.arange(0, cfg.max_context_len, cfg.page_size, device=dev)
        # Graph-runner input buffers, padded to the captured batch size.
        self.seq_lens = torch.zeros(bs, dtype=torch.int64, device=dev)  # ok: baseline
        self.seq_lens.fill_(cfg.pad_seq_len)
        self.req_pool_indices = torch.zeros(bs, dtype=torch.int64, device=dev)  # ok: baseline

    @property
    def nbytes(self) -> int:
        """Bytes of this phase's buffers (each its own allocation)."""
        bufs = (self.cache_seqlens, self.cu_seqlens_k, self.page_table, self.cu_seqlens_q,
                self.page_starts, self.seq_lens, self.req_pool_indices)
        return sum(t.numel() * t.element_size() for t in bufs)

    def replay(
        self,
        bs: int,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        seq_lens_cpu: Tensor,
    ) -> ClassicView:
        """Refill the ``bs``-row buffers for ``n = len(seq_lens)`` real requests, one op at a time.

        ``seq_lens_cpu`` (the host copy of ``seq_lens``) is required: the classic replay reads its
        maximum on the host to size the page-table block, which makes the update depend on host
        data and so keeps it out of any captured graph.
        """
        cfg, p = self.cfg, self.cfg.page_size
        n = seq_lens.shape[0]
        check_bs(cfg, bs, n)
        if not isinstance(seq_lens_cpu, Tensor) or seq_lens_cpu.device.type != "cpu":
            raise InputError(f"seq_lens_cpu must be a CPU tensor, got {type(seq_lens_cpu).__name__}"
                             f" on {getattr(seq_lens_cpu, 'device', None)}")
        if seq_lens_cpu.shape != (n,):
            raise InputError(f"seq_lens_cpu must have shape ({n},), got {tuple(seq_lens_cpu.shape)}")
        # Graph runner: pad the inputs to the captured size.
        if n < bs:
            self.seq_lens[:bs].fill_(cfg.pad_seq_len)
            self.req_pool_indices[:bs].zero_()
        self.seq_lens[:n].copy_(seq_lens)
        self.req_pool_indices[:n].copy_(req_pool_indices)
        seq, rows = self.seq_lens[:bs], self.req_pool_indices[:bs]
        # Backend replay.
        if self.add:
            seq = seq + self.add
        self.cache_seqlens[:bs].copy_(seq)
        self.cu_seqlens_k[1 : bs + 1].copy_(torch.cumsum(self.cache_seqlens[:bs], dim=0,
                                                         dtype=torch.int32))
        max_len = int(seq_lens_cpu.max().item()) if n else 0  # ok: host copy, as engines do
        if n < bs:
            max_len = max(max_len, cfg.pad_seq_len)
        max_len += self.add
        max_pages = ceil_div(max_len, p)
        if p > 1:
            pages = req_to_token[rows[:, None], self.page_starts[:max_pages][None, :]] // p
        else:  # every column starts a page: engines gather whole rows of a column slice
            pages = req_to_token[rows, :max_pages]
        self.page_table[:bs, :max_pages].copy_(pages)
        return ClassicView(
            bs=bs,
            cache_seqlens=self.cache_seqlens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            cu_seqlens_k=self.cu_seqlens_k[: bs + 1],
            page_table=self.page_table[:bs],
            max_seqlen_q=max(1, self.add),
            max_seqlen_k=max_len,
            page_size=p,
        )

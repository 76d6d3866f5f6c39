"""What every phase shares: its arena, capture-state bookkeeping and paged-part plumbing."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from ..arena import Arena
from ..config import Impl, Phase, PoolConfig
from ..errors import PoolError
from ..update import reference as ref
from ..update.reference import PagedBuffers
from ..views import PagedView


def resolve_impl(cfg: PoolConfig) -> Impl:
    """The update path a pool uses: ``AUTO`` is the reference path until a fused one applies."""
    if cfg.impl is Impl.TRITON:
        raise PoolError(
            f"impl={cfg.impl} is not available in this build; use Impl.REFERENCE or Impl.AUTO"
        )
    return Impl.REFERENCE


def capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is capturing a graph (never initialises CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class PhaseBase:
    """Base of ``pool.<phase>`` objects.

    Capture safety: ``view(bs)`` hands out slices whose read region must already hold valid values,
    because warmup and capture run real kernels. The arena remembers, per phase, how many rows are
    valid now; when another overlaid phase wrote the shared bytes since (or nothing was written
    yet), ``view`` first writes the phase's padded *capture state* for ``max_bs`` rows. That write
    happens on the host's current stream before capture, never inside a capture (it would be
    recorded and replayed over the real metadata), hence the check in :meth:`_ready`.
    """

    phase: Phase

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.cfg = arena.cfg
        self.impl = resolve_impl(arena.cfg)
        self._arange = arena.buffer(None, "arange")

    def _paged(self, prefix: str = "") -> PagedBuffers:
        a, ph = self.arena, self.phase
        return PagedBuffers(
            cache_seqlens=a.buffer(ph, prefix + "cache_seqlens"),
            cu_seqlens_k=a.buffer(ph, prefix + "cu_seqlens_k"),
            page_table=a.maybe(ph, prefix + "page_table"),
            kv_indptr=a.maybe(ph, prefix + "kv_indptr"),
            kv_indices=a.maybe(ph, prefix + "kv_indices"),
            kv_last_page_len=a.maybe(ph, prefix + "kv_last_page_len"),
        )

    def _empty_pages(self) -> Tensor:
        """A ``[0, 0]`` page block (capture state: no real rows), sliced from a constant."""
        return self._arange[:0].view(0, 0)

    def _ready(self, bs: int) -> None:
        """Make the read region of a ``bs``-row view valid before handing it out for capture."""
        if self.arena.valid_rows(self.phase) >= bs:
            return
        if capturing(self.cfg.torch_device):
            raise PoolError(
                f"{self.phase.value}.view({bs}) needs to write the capture state, but the stream "
                "is capturing; call view() before torch.cuda.graph(...) begins"
            )
        self._write_capture_state()
        self.arena.mark_written(self.phase, self.cfg.max_bs)

    def _write_capture_state(self) -> None:
        raise NotImplementedError

    # ---- shared writers ------------------------------------------------------------------------
    def _write_part(
        self,
        b: PagedBuffers,
        rows: int,
        lens: Tensor,
        pages: Tensor,
        *,
        add: int = 0,
        page_size: int | None = None,
        pad_len: int | None = None,
        pad_id: int | None = None,
    ) -> None:
        """Write one paged part's read region for ``rows`` rows (``len(lens)`` real ones).

        Defaults are the page-level padding of DESIGN §1. Token-slot parts (``page_size=1``) pad
        with the first slot of the pad page, repeated.
        """
        cfg = self.cfg
        p = cfg.page_size if page_size is None else page_size
        pad = cfg.pad_seq_len if pad_len is None else pad_len
        ref.lengths_(b.cache_seqlens, lens, add, rows, pad)
        ref.paged_(b, bs=rows, pages=pages, page_size=p,
                   pad_page=cfg.pad_page if pad_id is None else pad_id,
                   pad_pages=-(-pad // p), arange=self._arange)

    def _max_k(self, host: list[int] | None, add: int, n: int, bs: int, bound: int) -> int:
        """Host bound of ``cache_seqlens``: tight from host lengths, else the static ``bound``."""
        if host is None:
            return bound
        return max(max(host, default=0) + add, self.cfg.pad_seq_len if n < bs else 0)

    def _width(self, host: list[int] | None, add: int, page_size: int, cap: int) -> int:
        """Page columns the real rows need (from host lengths), else the part's capacity."""
        if host is None:
            return cap
        return min(cap, -(-(max(host, default=0) + add) // page_size))


V = TypeVar("V", bound=PagedView)


def part_view(
    b: PagedBuffers,
    rows: int,
    cu_seqlens_q: Tensor,
    *,
    max_q: int,
    max_k: int,
    page_size: int,
    causal: bool,
    cls: type[V] = PagedView,  # type: ignore[assignment]
    **extra: int,
) -> V:
    """A view (``cls``, a :class:`PagedView`) of the first ``rows`` rows of a part's buffers."""
    return cls(
        bs=rows,
        cache_seqlens=b.cache_seqlens[:rows],
        cu_seqlens_q=cu_seqlens_q[: rows + 1],
        cu_seqlens_k=b.cu_seqlens_k[: rows + 1],
        page_table=None if b.page_table is None else b.page_table[:rows],
        kv_indptr=None if b.kv_indptr is None else b.kv_indptr[: rows + 1],
        kv_indices=b.kv_indices,
        kv_last_page_len=None if b.kv_last_page_len is None else b.kv_last_page_len[:rows],
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        page_size=page_size,
        causal=causal,
        **extra,
    )

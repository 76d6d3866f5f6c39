"""The classic baseline of a prefill (extend) step: per-op metadata, as engines wrote it by hand.

Measured against ``pool.extend.update_`` (``benchmarks/device_time.py``, sections ``extend`` and
``mixed``); the tests prove that for every real row and token it writes what the pool writes
(lengths, both cumsums, the live page columns, the packed positions and KV slots), so the
comparison is like for like. It extends :class:`attnpool.tools.baseline.ClassicPaged`'s
description (docs/design.md, Classic baseline) to a step with ``extend_lens[i]`` new tokens per
request:

* the graph runner's padded inputs are filled first (lengths ``pad_seq_len``, request 0, no new
  tokens), then one op per buffer: ``cache_seqlens`` and ``cu_seqlens_k`` as in decode,
  ``cu_seqlens_q[1:]`` from a cumsum of the new-token counts;
* the longest length, the longest new-token count and the token total come from the *host*
  copies (``seq_lens_cpu``, ``extend_lens_cpu``), as engines read them: the page block's width,
  ``max_seqlen_q`` and the size of the per-token tensors;
* per token: the request of each token (``repeat_interleave`` with a host ``output_size``), its
  position (``prefix + j``: an ``arange`` minus the row's start, plus its prefix) and its KV slot
  (``req_to_token`` gathered at that position), each its own op.

Padded rows keep request 0's pages (not a pad page) and no queries; their tokens are not compared.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import PoolConfig
from ..errors import InputError
from .baseline import ClassicPaged, ClassicView


class ClassicExtend:
    """One extend phase's buffers (each its own zero-filled allocation) and per-op replay."""

    def __init__(self, cfg: PoolConfig) -> None:
        if cfg.max_extend_tokens <= 0:
            raise InputError(f"the classic extend step needs max_extend_tokens > 0, got "
                             f"{cfg.max_extend_tokens}")
        dev, i32 = cfg.torch_device, torch.int32
        self.cfg = cfg
        self.paged = ClassicPaged(cfg)
        t = cfg.max_extend_tokens
        self.cu_seqlens_q = torch.zeros(cfg.max_bs + 1, dtype=i32, device=dev)  # ok: baseline
        self.positions = torch.zeros(t, dtype=i32, device=dev)  # ok: baseline
        self.out_slots = torch.zeros(t, dtype=torch.int64, device=dev)  # ok: baseline
        self.extend_lens = torch.zeros(cfg.max_bs, dtype=torch.int64, device=dev)  # ok: baseline
        self.token_arange = torch.arange(t, device=dev)

    def replay(self, bs: int, seq_lens: Tensor, extend_lens: Tensor, req_pool_indices: Tensor,
               req_to_token: Tensor, seq_lens_cpu: Tensor, extend_lens_cpu: Tensor
               ) -> tuple[ClassicView, Tensor, Tensor]:
        """Refill for ``n = len(seq_lens)`` requests padded to ``bs``: ``(view, positions [L],
        out_slots [L])`` with ``L = sum(extend_lens_cpu)`` (the real tokens only)."""
        n = seq_lens.shape[0]
        if extend_lens_cpu.shape != (n,) or extend_lens_cpu.device.type != "cpu":
            raise InputError(f"extend_lens_cpu must be a CPU tensor of shape ({n},), got "
                             f"{tuple(extend_lens_cpu.shape)} on {extend_lens_cpu.device}")
        total = int(extend_lens_cpu.sum())  # ok: host copy, as engines do
        if total > self.cfg.max_extend_tokens:
            raise InputError(f"sum(extend_lens_cpu) must be <= max_extend_tokens="
                             f"{self.cfg.max_extend_tokens}, got {total}")
        view = self.paged.replay(bs, seq_lens, req_pool_indices, req_to_token, seq_lens_cpu)
        # Padded rows: no new tokens (the runner's padded input buffer).
        if n < bs:
            self.extend_lens[:bs].zero_()
        self.extend_lens[:n].copy_(extend_lens)
        ext = self.extend_lens[:bs]
        self.cu_seqlens_q[1 : bs + 1].copy_(torch.cumsum(ext, dim=0, dtype=torch.int32))
        # Per token: its request, its row's first token, its position and its slot.
        rows = torch.repeat_interleave(torch.arange(n, device=ext.device), ext[:n],
                                       output_size=total)
        start = self.cu_seqlens_q[:n].long()[rows]
        prefix = (seq_lens - extend_lens)[rows]
        pos = self.token_arange[:total] - start + prefix
        self.positions[:total].copy_(pos)
        slots = req_to_token[req_pool_indices[rows], pos]
        self.out_slots[:total].copy_(slots)
        max_q = int(extend_lens_cpu.max()) if n else 0  # ok: host copy
        out = ClassicView(bs=bs, cache_seqlens=view.cache_seqlens,
                          cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
                          cu_seqlens_k=view.cu_seqlens_k, page_table=view.page_table,
                          max_seqlen_q=max_q, max_seqlen_k=view.max_seqlen_k,
                          page_size=view.page_size)
        return out, self.positions[:total], self.out_slots[:total]

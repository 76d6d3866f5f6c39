"""What every phase shares: its arena, capture-state bookkeeping and paged-part plumbing."""

from __future__ import annotations

import torch
from torch import Tensor

from ..arena import Arena
from ..config import Impl, Phase, PoolConfig
from ..errors import PoolError
from ..update.reference import PagedBuffers


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

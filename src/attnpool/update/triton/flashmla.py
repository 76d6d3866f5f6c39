"""Fused FlashMLA scheduler part: the schedule of a part's lengths in one launch of one program.

Same bytes as :func:`attnpool.update.reference.flashmla.flashmla_part_` (the reference path's torch
port) in ``tile_scheduler_metadata`` and ``num_splits[: bs + 1]``; capturable like every fused
part (``num_real``: the real count read on the device, so a graph replays any count). One
program, because the schedule is one sequential walk over the parts; it is tiny integer work
next to the torch port's few hundred launches per update.
"""

from __future__ import annotations

from ...config import SchedLayout, is_int
from ...errors import CapacityError, InputError
from ..buffers import PagedBuffers
from ..launch import Launch, pointer_or, replayable
from ..parts import FlashMLAPart
from ..reference.flashmla import METADATA_SIZE
from . import checks
from .loaders import flashmla_kernels
from .tuning import maxnreg, pow2

__all__ = ["flashmla_launch"]


def _warps(block: int) -> int:
    """4 warps up to 2048 rows, 8 up to 4096 (``config.FLASHMLA_MAX_BS``): the vectors of
    every row stay in registers (sm_90: 111 and 171 registers, no spill; 8192 rows on 16
    warps spilled, hence the bound)."""
    return 4 if block <= 2048 else 8


def flashmla_launch(b: PagedBuffers, part: FlashMLAPart) -> Launch:
    """Check and assemble FlashMLA's schedule of the first ``n`` rows of ``b.cache_seqlens``
    (``num_real``'s count with ``num_real``: then ``n`` is ``bs``) into
    ``tile_scheduler_metadata [num_parts, 8]`` (in ``layout``) and ``num_splits[: bs + 1]``:
    padded rows get no work (see :mod:`..reference.flashmla`). Reads the lengths the part's own
    launch wrote before it, in stream order."""
    bs, n, num_parts, num_real, layout = part.bs, part.n, part.num_parts, part.num_real, part.layout
    md, num_splits = part.tile_scheduler_metadata, part.num_splits
    dev = b.cache_seqlens.device
    checks.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    checks.need(is_int(n) and 0 <= n <= bs, InputError, f"n must be an int in [0, bs={bs}], got {n}")
    checks.need(is_int(num_parts) and num_parts >= 1, InputError,
                f"num_parts must be an int >= 1, got {num_parts}")
    if num_real is not None:
        checks.need(n == bs, InputError, f"with num_real, n must be bs={bs}, got {n}")
    checks.need(isinstance(layout, SchedLayout), InputError,
                f"layout must be a SchedLayout, got {layout!r}")
    checks.real_count(num_real, n, bs, dev)
    checks.buf("cache_seqlens", b.cache_seqlens, bs, dev)
    checks.buf("num_splits", num_splits, bs + 1, dev)
    checks.buf("tile_scheduler_metadata", md, num_parts, dev, ndim=2)
    if tuple(md.shape) != (num_parts, METADATA_SIZE) or not md.is_contiguous():
        raise InputError(f"tile_scheduler_metadata must be a contiguous [{num_parts}, "
                         f"{METADATA_SIZE}] int32 tensor, got shape {tuple(md.shape)}")
    block = pow2(bs)
    args = {"cache_ptr": b.cache_seqlens, "nreal_ptr": pointer_or(num_real, b.cache_seqlens),
            "md_ptr": md, "ns_ptr": num_splits, "n": n, "bs": bs, "num_parts": num_parts,
            "DEVICE_N": num_real is not None, "BLOCK": block,
            "SCHED_META": layout is SchedLayout.DECODING_SCHED_META}
    inputs = replayable(n=("n", n), nreal_ptr=("num_real", num_real))
    return Launch(flashmla_kernels().flashmla_sched_kernel, (1,), args,
                  {"num_warps": _warps(block), "maxnreg": maxnreg(_warps(block))}, inputs)

"""flash-attn adapters: a view's paged-kernel arguments, FA3's scheduler metadata in the pool, the
kernel call (FA2, FA3 and FA4 share the argument names; each module's docstring says what its
generation takes).

* :mod:`.paged`: FA2's and FA3's arguments, :func:`run` and :func:`attention` (every generation),
* :mod:`.cute`: flash-attn 4's (``flash_attn.cute``) arguments and head sizes,
* :mod:`.load`: which entry point runs (:func:`load_fa3`, :func:`load_fa2`, :func:`load_fa4`),
* :mod:`.sched`: FA3's scheduler metadata planned into the pool (:func:`scheduler_metadata_`).

Importing this package imports no kernel: flash-attn is imported on the first call.
"""

from __future__ import annotations

from .cute import FA4_HEAD_MULTIPLE, FA4_MAX_HEAD, FA4_MIN_HEAD, check_fa4_head_dims, fa4_kwargs
from .load import (
    FA3_MODULES,
    CallStyle,
    FlashAttnVersion,
    FlashKernel,
    Kernel,
    clear_kernel_cache,
    load_fa2,
    load_fa3,
    load_fa4,
)
from .paged import (
    FA2_PAGE_MULTIPLE,
    FA3_HEAD_DIMS,
    RunOptions,
    attention,
    check_fa3_head_dims,
    fa2_kwargs,
    fa3_kwargs,
    fa3_varlen_kwargs,
    run,
)
from .sched import kernel_seqlen_k, scheduler_metadata_

__all__ = [
    "FA2_PAGE_MULTIPLE", "FA3_HEAD_DIMS", "FA3_MODULES", "FA4_HEAD_MULTIPLE", "FA4_MAX_HEAD",
    "FA4_MIN_HEAD", "CallStyle", "FlashAttnVersion", "FlashKernel", "Kernel", "RunOptions",
    "attention", "check_fa3_head_dims", "check_fa4_head_dims", "clear_kernel_cache", "fa2_kwargs",
    "fa3_kwargs", "fa3_varlen_kwargs", "fa4_kwargs", "kernel_seqlen_k", "load_fa2", "load_fa3",
    "load_fa4", "run", "scheduler_metadata_",
]

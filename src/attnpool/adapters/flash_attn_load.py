"""Which flash-attn entry point runs: FA3 from whichever module engines ship it in, or FA2.

Split from :mod:`attnpool.adapters.flash_attn` (which re-exports every name here): loading is
separate from building a call's arguments. Modules are imported lazily, on the first call of
:func:`load_fa3` / :func:`load_fa2`, and remembered, so importing the adapters imports no kernel.
"""

from __future__ import annotations

import enum
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

Kernel = Callable[..., Any]


class FlashAttnVersion(enum.Enum):
    """Which kernel generation: FA2 (``flash_attn``) or FA3 (see :data:`FA3_MODULES`)."""

    FA2 = "flash_attn"
    FA3 = "fa3"


class CallStyle(enum.Enum):
    """How a module's FA3 entry point takes a paged batch."""

    #: ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=,
    #: cu_seqlens_q=, max_seqlen_q=, ...)`` (flash-attention's Hopper build, sgl-kernel)
    KVCACHE = "flash_attn_with_kvcache"
    #: ``flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=,
    #: block_table=, fa_version=3, ...)`` (vLLM's bundled flash-attention)
    VARLEN = "flash_attn_varlen_func"


#: FA3 entry points, tried in this order by :func:`load_fa3`: flash-attention's Hopper build
#: (a source install), SGLang's sgl-kernel, vLLM's bundled copy. Not listed: the pip package
#: ``fa3-fwd`` (``fa3_fwd_interface``), built without paged KV outside its TMA path (page sizes
#: that are multiples of the KV block, many queries per row) and without float16.
FA3_MODULES: tuple[tuple[str, CallStyle], ...] = (
    ("flash_attn_interface", CallStyle.KVCACHE),
    ("sgl_kernel.flash_attn", CallStyle.KVCACHE),
    ("vllm.vllm_flash_attn", CallStyle.VARLEN),
)


@dataclass(frozen=True, slots=True)
class FlashKernel:
    """A loaded flash-attn entry point.

    Attributes:
        name: the module it came from (``"flash_attn_interface"``, ``"sgl_kernel.flash_attn"``,
            ``"vllm.vllm_flash_attn"`` or ``"flash_attn"``).
        version: FA2 or FA3.
        style: how :attr:`fn` takes a paged batch.
        fn: the attention entry point (``flash_attn_with_kvcache`` / ``flash_attn_varlen_func``).
        get_scheduler_metadata: FA3's metadata planner, None where the module has none.
    """

    name: str
    version: FlashAttnVersion
    style: CallStyle
    fn: Kernel
    get_scheduler_metadata: Kernel | None


@functools.cache
def _load(candidates: tuple[tuple[str, CallStyle], ...], version: FlashAttnVersion) -> FlashKernel:
    errors = []
    for name, style in candidates:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:  # also: a module whose CUDA extension does not load
            errors.append(f"{name}: {e}")
            continue
        fn = getattr(mod, style.value, None)
        if fn is None:
            errors.append(f"{name}: has no {style.value}")
            continue
        return FlashKernel(name, version, style, fn, getattr(mod, "get_scheduler_metadata", None))
    raise ImportError(f"no {version.name} module is importable; tried " + "; ".join(errors))


def load_fa3(module: str | None = None) -> FlashKernel:
    """The first importable FA3 entry point of :data:`FA3_MODULES` (or exactly ``module``).

    Imports lazily and remembers the result (:func:`clear_kernel_cache` forgets it).

    Raises:
        ImportError: none is importable; the message lists every module tried and why.
        InputError: ``module`` is not one of :data:`FA3_MODULES`.
    """
    cands = FA3_MODULES
    if module is not None:
        cands = tuple(c for c in FA3_MODULES if c[0] == module)
        if not cands:
            raise InputError(f"module must be one of {[c[0] for c in FA3_MODULES]}, got {module!r}")
    return _load(cands, FlashAttnVersion.FA3)


def load_fa2() -> FlashKernel:
    """FA2's ``flash_attn.flash_attn_with_kvcache`` (ImportError when flash-attn is missing)."""
    return _load(((FlashAttnVersion.FA2.value, CallStyle.KVCACHE),), FlashAttnVersion.FA2)


def clear_kernel_cache() -> None:
    """Forget loaded kernels (after installing one, or when tests swap modules)."""
    _load.cache_clear()


def pick_kernel(version: FlashAttnVersion, fn: Kernel | None, kernel: FlashKernel | None
                ) -> FlashKernel:
    """``kernel`` (checked to be of ``version``), else a bare ``flash_attn_with_kvcache``-style
    ``fn``, else the loaded module of ``version``."""
    if kernel is not None:
        if kernel.version is not version:
            raise InputError(f"kernel {kernel.name} is {kernel.version.name}, version is "
                             f"{version.name}")
        return kernel
    if fn is not None:
        return FlashKernel("fn", version, CallStyle.KVCACHE, fn, None)
    return load_fa3() if version is FlashAttnVersion.FA3 else load_fa2()

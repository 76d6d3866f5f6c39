"""Which flash-attn entry point runs: FA3 from whichever module engines ship it in, FA4
(``flash_attn.cute``, the ``flash-attn-4`` package) or FA2.

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

from ...errors import InputError

Kernel = Callable[..., Any]


class FlashAttnVersion(enum.Enum):
    """Which kernel generation: FA2 (``flash_attn``), FA3 (see :data:`FA3_MODULES`) or FA4
    (``flash_attn.cute``: FlashAttention written in CuTe DSL, JIT-compiled on first use, Hopper
    and Blackwell)."""

    FA2 = "flash_attn"
    FA3 = "fa3"
    FA4 = "flash_attn.cute"


class CallStyle(enum.Enum):
    """How a module's FA3 entry point takes a paged batch."""

    #: ``flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=, page_table=,
    #: cu_seqlens_q=, max_seqlen_q=, ...)`` (flash-attention's Hopper build, sgl-kernel)
    KVCACHE = "flash_attn_with_kvcache"
    #: ``flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=,
    #: block_table=, fa_version=3, ...)`` (vLLM's bundled flash-attention)
    VARLEN = "flash_attn_varlen_func"
    #: ``flash_attn.cute.flash_attn_varlen_func(q, k, v, cu_seqlens_q=, seqused_k=, page_table=,
    #: window_size=(left, right), softcap=, learnable_sink=, return_lse=)`` (flash-attn-4)
    CUTE = "cute:flash_attn_varlen_func"

    @property
    def entry(self) -> str:
        """The name of the module's attention function for this style."""
        return self.value.rsplit(":", 1)[-1]


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
        fn = getattr(mod, style.entry, None)
        if fn is None:
            errors.append(f"{name}: has no {style.entry}")
            continue
        plan = getattr(mod, "get_scheduler_metadata", None) if version is FlashAttnVersion.FA3 else None
        return FlashKernel(name, version, style, fn, plan)
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


def load_fa4() -> FlashKernel:
    """FA4's ``flash_attn.cute.flash_attn_varlen_func`` (ImportError when flash-attn-4 or its
    CuTe DSL runtime is missing). Importing it compiles nothing: each kernel variant is
    JIT-compiled on its first call (seconds) and cached for the process."""
    return _load(((FlashAttnVersion.FA4.value, CallStyle.CUTE),), FlashAttnVersion.FA4)


def clear_kernel_cache() -> None:
    """Forget loaded kernels (after installing one, or when tests swap modules)."""
    _load.cache_clear()


def pick_kernel(version: FlashAttnVersion, fn: Kernel | None, kernel: FlashKernel | None
                ) -> FlashKernel:
    """``kernel`` (checked to be of ``version``), else a bare ``fn`` (``flash_attn_with_kvcache``
    style, or FA4's ``flash_attn_varlen_func`` for FA4), else the loaded module of ``version``."""
    if kernel is not None:
        if kernel.version is not version:
            raise InputError(f"kernel {kernel.name} is {kernel.version.name}, version is "
                             f"{version.name}")
        return kernel
    if fn is not None:
        style = CallStyle.CUTE if version is FlashAttnVersion.FA4 else CallStyle.KVCACHE
        return FlashKernel("fn", version, style, fn, None)
    loaders = {FlashAttnVersion.FA3: load_fa3, FlashAttnVersion.FA4: load_fa4,
               FlashAttnVersion.FA2: load_fa2}
    return loaders[version]()

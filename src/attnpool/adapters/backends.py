"""Which attention kernels attnpool can drive, what each can serve, and how one is picked.

Every adapter declares a frozen :class:`Capabilities` record here, in one table
(:data:`CAPABILITIES`): devices, dtypes, head sizes (and K/V pairs), page sizes, cache layouts,
rows of varying query counts, windows, softcap, sinks, fp8 caches, CUDA graphs and the module
that must import. Integrations (transformers' ``PagedGenerator``, the vLLM backend) describe
what a model needs as a :class:`Need` and call :func:`select`: the first backend in the
automatic order whose record covers the need, or the one forced, refused up front with every
reason it cannot run. That keeps "can this kernel run this model" in one place, decided when an
engine starts, never as a wrong token or a crash inside a kernel mid-generation.

The records state what the adapters accept, not everything the libraries can do: a kernel
feature no adapter passes through is not a capability. What only the kernel can see at call time
(the GPU generation FA3 needs, whether an FA3 build has a sink argument, the FlashInfer backend a
wrapper picked) stays with the adapter, which refuses it with :class:`attnpool.LayoutError`
before the call.
"""

from __future__ import annotations

import enum
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import InputError, LayoutError
from .flash_attn.cute import FA4_HEAD_MULTIPLE, FA4_MAX_HEAD, FA4_MIN_HEAD
from .flash_attn.paged import FA2_PAGE_MULTIPLE, FA3_HEAD_DIMS

_HALF = frozenset({torch.float16, torch.bfloat16})
_FLOAT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


class Backend(enum.Enum):
    """An attention kernel family an adapter drives (``AUTO``: let :func:`select` pick)."""

    AUTO = "auto"
    SDPA = "sdpa"
    FA3 = "fa3"
    FA2 = "fa2"
    FA4 = "fa4"
    FLASHINFER = "flashinfer"


class KVLayout(enum.Enum):
    """How one page of a layer's cache is laid out: ``NHD`` ``[page_size, H_kv, D]`` (the
    adapters' layout, :class:`attnpool.KVCachePool`'s default) or ``HND`` ``[H_kv, page_size,
    D]`` (FlashInfer's other order; vLLM's CPU cache, whose K and V sit side by side in the last
    dimension, read through strided views)."""

    NHD = "NHD"
    HND = "HND"


#: ``(lo, hi]`` ranges of K and V head sizes: a pair ``(D, Dv)`` is taken when some row has
#: ``lo_k < D <= hi_k`` and ``lo_v < Dv <= hi_v``
HeadRanges = tuple[tuple[tuple[int, int], tuple[int, int]], ...]
_ANY_HEADS: HeadRanges = (((0, 1 << 16), (0, 1 << 16)),)
#: FA4 takes any ``(D, Dv)`` pair in its range (multiples of 8: ``Capabilities.head_multiple``)
FA4_HEADS: HeadRanges = (((FA4_MIN_HEAD - 1, FA4_MAX_HEAD), (FA4_MIN_HEAD - 1, FA4_MAX_HEAD)),)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one adapter serves. Immutable: a backend's record is fixed for the process.

    Fields:
        backend: the backend this record describes.
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        dtypes: query and (non-fp8) cache dtypes.
        fp8_kv: fp8 cache dtypes it reads with scales (empty: none).
        head_sizes: K/V head-size pairs taken when ``D != Dv`` (:data:`HeadRanges`).
        max_head_size: the largest ``D`` (and ``Dv``) when both are equal.
        page_multiple: page sizes it takes are multiples of this (1: any).
        kv_layouts: cache page layouts it reads.
        varying_queries: rows of different query counts in one part (prefill, draft extend,
            a mixed prefill/decode batch); False: one query count per part (FA2).
        windows, softcap, sinks: the attention variants it passes to the kernel (sinks: one
            logit per head in every row's softmax).
        cuda_graphs: its calls can be captured with the pool's views (static addresses, no
            host sync inside).
        module: the module that must import for it to run (None: torch alone).
        note: what only the kernel can check at call time.
        head_multiple: head sizes it takes are multiples of this (1: any).
    """

    backend: Backend
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    fp8_kv: frozenset[torch.dtype]
    head_sizes: HeadRanges
    max_head_size: int
    page_multiple: int
    kv_layouts: frozenset[KVLayout]
    varying_queries: bool
    windows: bool
    softcap: bool
    sinks: bool
    cuda_graphs: bool
    module: str | None
    note: str = ""
    head_multiple: int = 1

    def takes_heads(self, head_size: int, head_size_v: int) -> bool:
        """Whether a ``(D, Dv)`` pair has a kernel."""
        if head_size % self.head_multiple or head_size_v % self.head_multiple:
            return False
        if head_size == head_size_v:
            return 1 <= head_size <= self.max_head_size
        return any(a < head_size <= b and c < head_size_v <= e
                   for (a, b), (c, e) in self.head_sizes)

    def importable(self) -> bool:
        """Whether its module imports here (found without importing it)."""
        if self.module is None:
            return True
        try:  # a dotted name imports its parent package, which may be missing
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
            return False

    def missing(self, need: Need) -> list[str]:
        """Every reason this backend cannot serve ``need`` (empty: it can)."""
        why: list[str] = []
        if need.device not in self.devices:
            why.append(f"runs on {sorted(self.devices)}, not {need.device}")
        if need.dtype not in self.dtypes:
            why.append(f"takes dtypes {_names(self.dtypes)}, not {_name(need.dtype)}")
        kv = need.kv_dtype
        if kv is not None and kv != need.dtype and kv not in self.fp8_kv:
            why.append(f"reads caches of {_names(self.fp8_kv | self.dtypes)} "
                       f"(fp8: {_names(self.fp8_kv) or 'none'}), not {_name(kv)}")
        if not self.takes_heads(need.head_size, need.head_size_v):
            why.append(f"has no kernel for head sizes D={need.head_size}, Dv={need.head_size_v}")
        if need.page_size % self.page_multiple:
            why.append(f"needs page_size a multiple of {self.page_multiple}, not {need.page_size}")
        if need.kv_layout not in self.kv_layouts:
            why.append(f"reads {sorted(x.value for x in self.kv_layouts)} caches, not "
                       f"{need.kv_layout.value}")
        for wanted, has, what in ((need.varying_queries, self.varying_queries,
                                   "rows of varying query counts (prefill, mixed batches)"),
                                  (need.window, self.windows, "sliding windows"),
                                  (need.softcap, self.softcap, "logit softcapping"),
                                  (need.sinks, self.sinks, "attention sinks"),
                                  (need.cuda_graphs, self.cuda_graphs, "CUDA graphs")):
            if wanted and not has:
                why.append(f"has no {what}")
        if not self.importable():
            why.append(f"needs the module {self.module!r}, which does not import here")
        return why


@dataclass(frozen=True, slots=True)
class Need:
    """What a model and an engine ask of the attention kernel (built by an integration).

    Fields:
        device: the device type, ``"cpu"`` or ``"cuda"``.
        dtype: the queries' (and a non-fp8 cache's) dtype.
        head_size, head_size_v: K and V head sizes (``head_size_v`` defaults to ``head_size``).
        page_size: tokens per cache page.
        kv_dtype: the cache's dtype when it differs from ``dtype`` (an fp8 cache), else None.
        kv_layout: the cache page layout.
        varying_queries: parts whose rows have different query counts will run.
        window, softcap, sinks: the attention variants the model uses.
        cuda_graphs: the calls will be captured in CUDA graphs.
    """

    device: str
    dtype: torch.dtype
    head_size: int
    page_size: int
    head_size_v: int = -1
    kv_dtype: torch.dtype | None = None
    kv_layout: KVLayout = KVLayout.NHD
    varying_queries: bool = False
    window: bool = False
    softcap: bool = False
    sinks: bool = False
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.head_size_v == -1:
            object.__setattr__(self, "head_size_v", self.head_size)


CAPABILITIES: dict[Backend, Capabilities] = {
    Backend.SDPA: Capabilities(
        Backend.SDPA, frozenset({"cpu", "cuda"}), _FLOAT, _FP8, _ANY_HEADS, 1 << 16, 1,
        frozenset({KVLayout.NHD, KVLayout.HND}), True, True, True, True, True, None,
        "PyTorch's scaled_dot_product_attention over gathered pages; the CPU backend. An HND "
        "(or any strided) cache is given as an NHD-shaped view: pages are gathered where they "
        "lie (adapters.sdpa.gather)"),
    Backend.FA3: Capabilities(
        Backend.FA3, frozenset({"cuda"}), _HALF, frozenset({torch.float8_e4m3fn}),
        FA3_HEAD_DIMS, 256, 1, frozenset({KVLayout.NHD}), True, True, True, True, True,
        "flash_attn_interface",
        "needs a Hopper GPU; sinks need a build with s_aux / sinks (vLLM's, sgl-kernel's)"),
    Backend.FA2: Capabilities(
        Backend.FA2, frozenset({"cuda"}), _HALF, frozenset(), (), 256, FA2_PAGE_MULTIPLE,
        frozenset({KVLayout.NHD}), False, True, True, False, True, "flash_attn.flash_attn_interface"),
    Backend.FA4: Capabilities(
        Backend.FA4, frozenset({"cuda"}), _HALF, frozenset(), FA4_HEADS, FA4_MAX_HEAD, 1,
        frozenset({KVLayout.NHD}), True, True, True, True, True, "flash_attn.cute",
        "each kernel variant JIT-compiles on its first call (warm up before graph capture); "
        "needs an SM 8.x-12.x GPU; fp8 only on Blackwell", FA4_HEAD_MULTIPLE),
    Backend.FLASHINFER: Capabilities(
        Backend.FLASHINFER, frozenset({"cuda"}), _HALF, _FP8, _ANY_HEADS, 256, 1,
        frozenset({KVLayout.NHD, KVLayout.HND}), True, True, True, True, True, "flashinfer",
        "K/V head sizes may differ only in the prefill wrapper; sinks need the trtllm-gen or "
        "cute-dsl backend"),
}

#: The order ``Backend.AUTO`` tries: the fastest kernel that covers the need first.
AUTO_ORDER: tuple[Backend, ...] = (Backend.FA3, Backend.FA4, Backend.FA2, Backend.FLASHINFER,
                                   Backend.SDPA)


def capabilities(backend: Backend) -> Capabilities:
    """The record of ``backend`` (``AUTO`` has none)."""
    if not isinstance(backend, Backend) or backend is Backend.AUTO:
        raise InputError(f"capabilities are per backend ({[b.name for b in AUTO_ORDER]}), got "
                         f"{backend!r}")
    return CAPABILITIES[backend]


def select(need: Need, backend: Backend = Backend.AUTO,
           among: Iterable[Backend] = AUTO_ORDER, who: str = "attnpool") -> Backend:
    """The backend that serves ``need``: ``backend`` itself when forced and able, else the first
    of ``among`` (the backends the caller can drive, in the caller's order of preference:
    :data:`AUTO_ORDER` by default) that is.

    Raises:
        LayoutError: a forced backend that cannot serve the need, one ``who`` does not drive,
            or no backend of ``among`` that can, naming every reason.
    """
    if not isinstance(backend, Backend):
        raise InputError(f"backend must be an attnpool Backend, got {backend!r}")
    pool = tuple(dict.fromkeys(b for b in among if b in CAPABILITIES))
    if backend is not Backend.AUTO:
        if backend not in pool:
            raise LayoutError(f"{who} drives {[b.name for b in pool]}, not {backend.name}")
        pool = (backend,)
    reasons: dict[Backend, list[str]] = {}
    for b in pool:
        why = CAPABILITIES[b].missing(need)
        if not why:
            return b
        reasons[b] = why
    if backend is not Backend.AUTO:
        raise LayoutError(f"backend {backend.name} cannot run here: "
                          + ", ".join(reasons[backend]))
    detail = "; ".join(f"{b.name} " + ", ".join(w) for b, w in reasons.items())
    raise LayoutError(f"{who}: no backend can serve this model: {detail}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(sorted(_name(d) for d in dtypes))

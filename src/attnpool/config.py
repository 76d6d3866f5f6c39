"""Pool configuration and the enums shared by every module.

:class:`PoolConfig` is frozen and validated once, at construction: every other module may rely on
its invariants (positive sizes, power-of-two page size, chunk size a multiple of the page size).
"""

from __future__ import annotations

import enum
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeGuard

import torch

from .errors import CapacityError, InputError, LayoutError, PoolError


class Phase(enum.Enum):
    """The forward kinds a pool serves. Each has its own typed view and update."""

    DECODE = "decode"
    VERIFY = "verify"
    DRAFT = "draft"
    DRAFT_EXTEND = "draft_extend"
    ENCODER = "encoder"
    LOCAL = "local"
    EXTEND = "extend"


#: Index dtypes accepted for lengths, request rows and token tables.
INT_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)

@dataclass(frozen=True, slots=True)
class PhaseFacts:
    """What the library knows about a phase, in one place (:data:`PHASE_FACTS`).

    Attributes:
        enabled: whether a config has the phase (its sizes are set).
        needs: the config setting that enables it, for error messages.
        overlaid: its buffers overlay the other overlaid phases' bytes (they never run in the
            same forward); else they are its own.
        writes_decode: its update also writes the decode phase's buffers (the encoder's decoder
            rows), so it owns the overlay too after an update.
        rows: query rows one request contributes to a forward (at most; extend: the batch's
            token budget ``max_extend_tokens``).
        window_queries: with a sliding window, the most query positions one row of the phase's
            window part spans (``q_max``: 1 decode, N verify and draft extend, S chain draft
            steps, T extend), which sizes the window page table; None: the phase has no window
            part (encoder and local attention read their own KV ranges).
    """

    enabled: Callable[[PoolConfig], bool]
    needs: str
    overlaid: bool
    writes_decode: bool
    rows: Callable[[PoolConfig], int]
    window_queries: Callable[[PoolConfig], int] | None = None


def _one(cfg: PoolConfig) -> int:
    return 1


#: Every phase's facts; adding a phase adds a row here (and its module under ``phases/``). A
#: prefill (extend) forward never carries decode, verify or draft rows of the same pool (an engine
#: that mixes them runs the decode rows as one-token extends), so extend is overlaid too.
PHASE_FACTS: dict[Phase, PhaseFacts] = {
    Phase.DECODE: PhaseFacts(lambda c: True, "always on", True, False, _one, _one),
    Phase.VERIFY: PhaseFacts(lambda c: c.num_draft_tokens > 0, "num_draft_tokens > 0", True,
                             False, lambda c: c.num_draft_tokens, lambda c: c.num_draft_tokens),
    Phase.DRAFT: PhaseFacts(lambda c: c.spec_steps > 0, "spec_steps > 0", True, False,
                            lambda c: c.topk, lambda c: c.spec_steps),
    Phase.DRAFT_EXTEND: PhaseFacts(lambda c: c.num_draft_tokens > 0, "num_draft_tokens > 0",
                                   True, False, lambda c: c.num_draft_tokens,
                                   lambda c: c.num_draft_tokens),
    Phase.ENCODER: PhaseFacts(lambda c: c.max_encoder_len > 0, "max_encoder_len > 0", False,
                              True, _one),
    Phase.LOCAL: PhaseFacts(lambda c: c.attention_chunk_size is not None,
                            "attention_chunk_size set", False, False, _one),
    Phase.EXTEND: PhaseFacts(lambda c: c.max_extend_tokens > 0, "max_extend_tokens > 0", True,
                             False, lambda c: c.max_extend_tokens, lambda c: c.max_extend_tokens),
}

#: Phases that never run in the same forward: their buffers overlay the same arena bytes.
OVERLAID_PHASES: frozenset[Phase] = frozenset(p for p, f in PHASE_FACTS.items() if f.overlaid)


class Layout(enum.Flag):
    """Which page-table layouts the pool keeps up to date. Both may be asked for at once.

    ``FLASH_ATTN``: a 2-D ``page_table [bs, max_pages]`` plus ``cache_seqlens`` (flash-attn FA2/FA3,
    the SDPA reference). ``FLASHINFER``: CSR ``kv_indptr [bs+1]``, ``kv_indices``,
    ``kv_last_page_len [bs]`` (FlashInfer's CUDA-graph wrappers).
    """

    FLASH_ATTN = enum.auto()
    FLASHINFER = enum.auto()
    BOTH = FLASH_ATTN | FLASHINFER


class Impl(enum.Enum):
    """Which update path fills the buffers.

    ``AUTO`` picks the fused Triton path on CUDA when triton is importable, else the reference
    torch path. ``REFERENCE`` and ``TRITON`` force one; both write identical bytes in the read region.
    """

    AUTO = "auto"
    REFERENCE = "reference"
    TRITON = "triton"


def is_int(v: object) -> TypeGuard[int]:
    """A real Python ``int`` for an index-like argument (layer, bs, counts, sizes).

    ``bool`` is refused: ``True`` would pass ``isinstance(v, int)`` and, used as a tensor index,
    adds a dimension instead of selecting element 1 (a wrongly shaped view fed to a kernel).
    """
    return type(v) is int


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``b > 0``), exactly: no float on the way."""
    return -(-a // b)


#: byte boundary every region of a pool's single allocation starts on (the arena's buffers, the
#: KV cache's slot mapping, the LoRA fields): what CUDA allocations guarantee, and enough for
#: vectorised kernel loads
ALIGN = 256


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the next :data:`ALIGN` boundary."""
    return ceil_div(nbytes, ALIGN) * ALIGN


def window_span_pages(window: int, queries: int, page_size: int) -> int:
    """Pages a sliding-window row spans: ``ceil((W - 1 + q) / P) + 1``, from the page holding the
    oldest key its first query sees (``W - 1`` keys back, anywhere in that page: the ``+ 1``) to
    the page holding its newest position (``q - 1`` queries on). The window parts' page tables
    and the window page allocator's per-request hold are this wide."""
    return ceil_div(window - 1 + queries, page_size) + 1


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` (CUDA when available, else CPU) or a torch device; a clear error otherwise."""
    if str(device) == "auto":
        # torch.cuda.is_available() does not create a CUDA context; it is only called here, at
        # config construction, never at import.
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise PoolError(f"device must be a torch device or 'auto', got {device!r}") from e


def triton_usable(device: torch.device) -> bool:
    """Whether the fused Triton path can run on ``device``, without importing triton.

    CUDA needs triton installed; any other device only runs Triton kernels in the interpreter
    (``TRITON_INTERPRET=1``, read when the kernels are first compiled), which tests use on CPU.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: Impl, device: torch.device) -> Impl:
    """The update path that runs: never ``AUTO``.

    ``AUTO`` is ``TRITON`` on a CUDA device when triton is installed, else ``REFERENCE`` (on CPU
    the interpreter is a test tool, not a fast path, so ``AUTO`` never picks it). A forced
    ``TRITON`` that cannot run raises :class:`LayoutError` here, at construction, not at the
    first update.
    """
    if not isinstance(impl, Impl):
        raise PoolError(f"impl must be an attnpool.Impl, got {impl!r}")
    if impl is Impl.AUTO:
        return Impl.TRITON if device.type == "cuda" and triton_usable(device) else Impl.REFERENCE
    if impl is Impl.TRITON and not triton_usable(device):
        raise LayoutError(
            "Impl.TRITON needs triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); "
            f"got device {device}, triton "
            f"{'installed' if importlib.util.find_spec('triton') else 'not installed'}"
        )
    return impl


#: KV tokens per block of FlashMLA's dense decode kernel: the page size it needs
FLASHMLA_PAGE_SIZE = 64
#: most rows a pool with FlashMLA metadata serves: the fused scheduler is one program holding
#: every row's prefix sum in registers, which spill past this (engines batch far fewer)
FLASHMLA_MAX_BS = 4096


def num_sm_parts(num_sms: int, num_q_tokens_per_head_k: int, num_heads_k: int = 1, *,
                 fp8: bool = False) -> int:
    """FlashMLA's persistent parts, ``max(sms // h_k // ceil(s_q * h_q / h_k / 64), 1)`` (an fp8
    cache: half the SMs, 128-token tiles); here because it sizes pool buffers."""
    for name, v in (("num_sms", num_sms), ("num_q_tokens_per_head_k", num_q_tokens_per_head_k),
                    ("num_heads_k", num_heads_k)):
        if not is_int(v) or v < 1:
            raise InputError(f"{name} must be an int >= 1, got {v!r}")
    sms = num_sms // 2 if fp8 else num_sms
    tiles = ceil_div(num_q_tokens_per_head_k, 2 * FLASHMLA_PAGE_SIZE if fp8 else FLASHMLA_PAGE_SIZE)
    return max(sms // num_heads_k // tiles, 1)


class SchedLayout(enum.Enum):
    """Field order of one part's row of FlashMLA's ``tile_scheduler_metadata`` (the two APIs
    read different ones; :mod:`attnpool.update.reference.flashmla` writes both)."""

    #: ``[begin_req (-1: no work), begin_block, end_req, end_block, begin_split, 0, 0, 0]``:
    #: the argument-style ``flash_mla_with_kvcache(..., tile_scheduler_metadata, num_splits)``
    ARGUMENTS = "arguments"
    #: ``DecodingSchedMeta``: begin_req, end_req, begin_block, end_block, begin_split,
    #: is_first_req_splitted, is_last_req_splitted, pad (a part with no work: begin_req = b,
    #: the call's batch): what a ``FlashMLASchedMeta`` carries in FlashMLA's current API
    DECODING_SCHED_META = "decoding_sched_meta"


@dataclass(frozen=True, slots=True)
class FlashMLAConfig:
    """FlashMLA's scheduler metadata as pool buffers of decode and verify (docs/design.md,
    FlashMLA metadata). The fields are the kernel call's facts (they size its schedule).

    Args:
        num_sms: streaming multiprocessors of the device the kernel runs on (132 on an H100).
        num_heads_q: query heads the kernel sees (this rank's, after tensor parallelism).
        num_heads_k: KV heads (1 for MLA's latent cache); must divide ``num_heads_q``.
        fp8: an fp8 KV cache (FlashMLA's fp8 kernel: half the SMs, 128-token query tiles).
        layout: the rows' field order, the API that reads them (:class:`SchedLayout`): the
            argument-style API's (default) or ``DecodingSchedMeta`` (FlashMLA's current API).
    """

    num_sms: int
    num_heads_q: int
    num_heads_k: int = 1
    fp8: bool = False
    layout: SchedLayout = SchedLayout.ARGUMENTS

    def __post_init__(self) -> None:
        for name in ("num_sms", "num_heads_q", "num_heads_k"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise PoolError(f"FlashMLAConfig: {name} must be an int >= 1, got {v!r}")
        for ok, what, got in ((self.num_heads_q % self.num_heads_k == 0,
                               f"num_heads_q must be a multiple of num_heads_k={self.num_heads_k}",
                               self.num_heads_q), (type(self.fp8) is bool, "fp8 must be a bool",
                                                   self.fp8),
                              (isinstance(self.layout, SchedLayout),
                               "layout must be a SchedLayout", self.layout)):
            if not ok:
                raise PoolError(f"FlashMLAConfig: {what}, got {got!r}")

    def num_sm_parts(self, s_q: int) -> int:
        """Parts of a call with ``s_q`` query rows per request (1 decode, ``N`` verify)."""
        return num_sm_parts(self.num_sms, s_q * self.num_heads_q // self.num_heads_k,
                            self.num_heads_k, fp8=self.fp8)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Everything that sizes a pool. Frozen: a pool's shapes never change after construction.

    Args:
        max_bs: largest captured batch size (rows of a decode view).
        max_context_len: longest sequence in tokens, C. Every length update ensures len + N <= C.
        page_size: tokens per KV page, P; a power of two in [1, max_context_len].
        device: where the arena lives ("cuda", "cpu", a ``torch.device``, or "auto").
        num_draft_tokens: N, query tokens per request in target verify (0: no verify phase).
        topk: K, draft branches per step; K > 1 makes verify/draft tree-shaped.
        spec_steps: S, draft decode steps per speculative round (0: no draft phase).
        attention_chunk_size: A, chunk of chunked local attention (None: no local phase). Must be a
            multiple of ``page_size`` so a chunk starts on a page boundary.
        max_encoder_len: longest encoder sequence for cross-attention (0: no encoder phase).
        layout: which page-table layouts to keep (:class:`Layout`).
        pad_seq_len: ``cache_seqlens`` of padded rows; >= 1 so kernels see a non-empty, valid row.
        pad_page: page id written into padded rows; engines reserve it (default page 0).
        num_pages: number of KV pages, when known; only used to range-check page ids in checks.
        impl: which update path to use (:class:`Impl`).
        fa3_scheduler_metadata: also keep flash-attn 3's ``scheduler_metadata`` buffer
            (``round_up(max_bs, 4) * 4 + 1`` int32) for the flash-attn adapter.
        max_extend_tokens: T, packed query tokens of one prefill (extend) batch, all requests
            together (0: no extend phase). Sizes the extend view's ``positions`` and is the fixed
            query total of padded extend views (see :class:`attnpool.ExtendView`).
        sliding_window: W, the key count of sliding-window layers (a query at position ``q``
            sees keys ``q - W < k <= q``, itself included, as transformers' mask), or None.
            Every phase that reads the KV cache (decode, verify, draft, draft extend, extend)
            then keeps a second part, ``view.window``, whose rows start at the window's first
            page and whose page table is ``ceil((W - 1 + q_max) / P) + 1`` pages wide however
            long the context (docs/design.md, Sliding windows). Tree-shaped speculation
            (``topk > 1``) refuses a window: its drafts sit at different depths of one row, so
            no single window start serves them.
        flashmla: FlashMLA's scheduler metadata for decode and verify (:class:`FlashMLAConfig`),
            or None; needs ``page_size`` 64, ``Layout.FLASH_ATTN`` and no encoder phase.
    """

    max_bs: int = 160
    max_context_len: int = 131072
    page_size: int = 1
    device: str | torch.device = "auto"
    num_draft_tokens: int = 0
    topk: int = 1
    spec_steps: int = 0
    attention_chunk_size: int | None = None
    max_encoder_len: int = 0
    layout: Layout = Layout.FLASH_ATTN
    pad_seq_len: int = 1
    pad_page: int = 0
    num_pages: int | None = None
    impl: Impl = Impl.AUTO
    fa3_scheduler_metadata: bool = False
    max_extend_tokens: int = 0
    sliding_window: int | None = None
    flashmla: FlashMLAConfig | None = None
    _device: torch.device = field(init=False, repr=False, compare=False)
    _phases: tuple[Phase, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def need(ok: bool, what: str, got: object) -> None:
            if not ok:
                raise PoolError(f"PoolConfig: {what}, got {got!r}")

        for name in ("max_bs", "max_context_len", "page_size", "num_draft_tokens", "topk",
                     "spec_steps", "max_encoder_len", "pad_seq_len", "pad_page", "max_extend_tokens"):
            v = getattr(self, name)
            need(is_int(v), f"{name} must be an int", v)
        need(self.max_bs >= 1, "max_bs must be >= 1", self.max_bs)
        need(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
             "page_size must be a power of two >= 1", self.page_size)
        need(self.max_context_len >= self.page_size,
             f"max_context_len must be >= page_size ({self.page_size})", self.max_context_len)
        need(self.num_draft_tokens >= 0, "num_draft_tokens must be >= 0", self.num_draft_tokens)
        need(self.num_draft_tokens < self.max_context_len,
             f"num_draft_tokens must be < max_context_len ({self.max_context_len})",
             self.num_draft_tokens)
        need(self.topk >= 1, "topk must be >= 1", self.topk)
        need(self.topk == 1 or self.num_draft_tokens > 0 or self.spec_steps > 0,
             "topk > 1 needs num_draft_tokens > 0 or spec_steps > 0", self.topk)
        need(self.spec_steps >= 0, "spec_steps must be >= 0", self.spec_steps)
        need(self.spec_steps < self.max_context_len,
             f"spec_steps must be < max_context_len ({self.max_context_len})", self.spec_steps)
        need(0 <= self.max_encoder_len < self.max_context_len,
             f"max_encoder_len must be in [0, max_context_len={self.max_context_len})",
             self.max_encoder_len)
        need(1 <= self.pad_seq_len <= self.max_context_len,
             f"pad_seq_len must be in [1, max_context_len={self.max_context_len}]",
             self.pad_seq_len)
        need(self.pad_page >= 0, "pad_page must be >= 0", self.pad_page)
        need(self.max_extend_tokens >= 0, "max_extend_tokens must be >= 0", self.max_extend_tokens)
        # Padded extend rows share T - sum(extend_lens) queries: (T * row) must fit in int32.
        need(self.max_extend_tokens * self.max_bs < 2**31,
             f"max_extend_tokens * max_bs must be < 2**31 (int32 query offsets), max_bs="
             f"{self.max_bs}", self.max_extend_tokens)
        if self.num_pages is not None:
            need(is_int(self.num_pages) and self.num_pages > self.pad_page,
                 f"num_pages must be an int > pad_page ({self.pad_page})", self.num_pages)
        if self.attention_chunk_size is not None:
            a = self.attention_chunk_size
            need(is_int(a) and a >= 1, "attention_chunk_size must be an int >= 1", a)
            need(a % self.page_size == 0,
                 f"attention_chunk_size must be a multiple of page_size ({self.page_size})", a)
        if self.sliding_window is not None:
            w = self.sliding_window
            need(is_int(w) and w >= 1, "sliding_window must be an int >= 1 (or None)", w)
            if self.topk > 1:
                raise LayoutError("PoolConfig: sliding_window needs topk == 1 (a tree's drafts sit "
                                  f"at different depths, so no one window start serves a row), got "
                                  f"topk={self.topk} with sliding_window={w}")
            # a padded row reads pad_seq_len keys of its window part too: they must fit its table
            room = min(window_span_pages(w, 1, self.page_size), self.max_pages) * self.page_size
            need(self.pad_seq_len <= room,
                 f"pad_seq_len must fit the window parts' page tables (<= {room} tokens with "
                 f"sliding_window={w}, page_size={self.page_size})", self.pad_seq_len)
        need(isinstance(self.layout, Layout) and bool(self.layout),
             "layout must be a non-empty attnpool.Layout", self.layout)
        need(isinstance(self.impl, Impl), "impl must be an attnpool.Impl", self.impl)
        # Chain draft steps share one 2-D page table; FlashInfer's CSR cannot share one page list
        # between rows of different lengths, so they need the FLASH_ATTN layout.
        need(self.spec_steps == 0 or self.topk > 1 or bool(self.layout & Layout.FLASH_ATTN),
             "spec_steps > 0 with topk == 1 needs Layout.FLASH_ATTN in layout", self.layout)
        if self.flashmla is not None:
            self._check_flashmla(self.flashmla)
        object.__setattr__(self, "_device", resolve_device(self.device))
        object.__setattr__(self, "_phases",
                           tuple(p for p in Phase if PHASE_FACTS[p].enabled(self)))

    def _check_flashmla(self, f: object) -> None:
        """FlashMLA's kernel reads 64-token pages through the page table; its metadata sizes
        the schedule of one batch of one shape (the encoder's decoder rows are not one)."""
        if not isinstance(f, FlashMLAConfig):
            raise PoolError(f"PoolConfig: flashmla must be an attnpool.FlashMLAConfig or None, "
                            f"got {type(f).__name__}")
        if self.page_size != FLASHMLA_PAGE_SIZE:
            raise LayoutError(f"PoolConfig: flashmla needs page_size={FLASHMLA_PAGE_SIZE} "
                              f"(FlashMLA's KV block), got page_size={self.page_size}")
        if not self.layout & Layout.FLASH_ATTN:
            raise LayoutError("PoolConfig: flashmla needs Layout.FLASH_ATTN in layout (FlashMLA "
                              f"reads the page table), got {self.layout}")
        if self.max_encoder_len:
            raise LayoutError("PoolConfig: flashmla serves decoder-only models; needs "
                              f"max_encoder_len=0, got {self.max_encoder_len}")
        if self.max_bs > FLASHMLA_MAX_BS:  # (and so int32 block counts: 4096 * 2**25 < 2**31)
            raise CapacityError(f"PoolConfig: flashmla needs max_bs <= {FLASHMLA_MAX_BS} (one "
                                f"program schedules every row), got max_bs={self.max_bs}")

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def torch_device(self) -> torch.device:
        """The resolved device ("auto" becomes cuda or cpu)."""
        return self._device

    @property
    def max_pages(self) -> int:
        """Width of every page table: ceil(max_context_len / page_size)."""
        return ceil_div(self.max_context_len, self.page_size)

    def window_pages(self, phase: Phase) -> int:
        """Width of ``phase``'s window page table: ``ceil((W - 1 + q_max) / P) + 1`` pages (the
        ``+ 1``: a row starts on the page holding its first visible key, which may sit anywhere
        in that page), never more than ``max_pages``; 0 when the phase has no window part."""
        queries = PHASE_FACTS[phase].window_queries
        if self.sliding_window is None or queries is None:
            return 0
        return min(window_span_pages(self.sliding_window, queries(self), self.page_size),
                   self.max_pages)

    @property
    def pad_pages(self) -> int:
        """Pages a padded row reads: ceil(pad_seq_len / page_size)."""
        return ceil_div(self.pad_seq_len, self.page_size)

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The phases this config enables, in declaration order (computed once)."""
        return self._phases

"""The single buffer table: every tensor a pool may own, declared once.

Each :class:`BufferSpec` says what a buffer is (name, phase, dtype), how big it is as a function of
the config (always the worst case: ``len + N = C``, ``bs*K`` and ``bs*N`` rows), which layout needs
it, and what its padded rows hold (:class:`Pad`). The arena lays the table out; phases look their
buffers up by ``(phase, name)``; ``report()`` prints it. Nothing else declares a buffer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import OVERLAID_PHASES, Layout, Phase, PoolConfig, ceil_div

Shape = tuple[int, ...]


class Pad(enum.Enum):
    """What a padded row (``n <= i < bs``) of a buffer holds, and so what capture sees.

    ``SEQ_LEN``: lengths hold ``cfg.pad_seq_len`` (>= 1, a valid non-empty row).
    ``CUMSUM``: cumulative sums keep growing by the padded lengths, so they stay non-decreasing.
    ``PAGE``: page ids hold ``cfg.pad_page`` in the columns a padded row reads.
    ``INDPTR``: CSR row pointers repeat their last value (a padded row owns no entries).
    ``PAYLOAD``: no per-row rule; the read region is bounded by another buffer (CSR indices).
    ``SLOT``: slot mappings hold -1 (the store kernel skips the entry).
    ``ZERO``: per-token values of padded query tokens hold 0 (extend ``positions``), and
    FlashInfer's ``kv_last_page_len`` holds 0 for a row that owns no pages (its prefill plan takes
    ``max(pages - 1, 0) * P + kv_last_page_len`` as the row's length).
    ``CONST``: written once at construction and never by an update; lives outside the overlay so
    no other phase can overwrite it.
    ``IDLE``: FlashMLA's ``tile_scheduler_metadata``: padded rows get no work, so every part past
    the real rows' work is idle, ``begin_req = -1`` (the kernel skips it).
    """

    SEQ_LEN = "pad_seq_len"
    CUMSUM = "cumsum"
    PAGE = "pad_page"
    INDPTR = "repeat last"
    PAYLOAD = "-"
    SLOT = "-1"
    ZERO = "0"
    CONST = "const"
    IDLE = "-1 (idle part)"


class Region(enum.Enum):
    """Where a buffer sits in the arena (see docs/design.md, Overlay)."""

    SHARED = "shared"  # constants; never overwritten by an update
    OVERLAY = "overlay"  # decode / verify / draft / draft extend / extend share these bytes
    SEPARATE = "separate"  # used in the same forward as an overlaid phase (encoder, local)


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One buffer of the table.

    Attributes:
        name: field name (flash-attn naming: ``cache_seqlens``, ``cu_seqlens_k``, ``page_table``).
        phase: owning phase, or None for a constant shared by every phase.
        dtype: element type.
        shape: the full (max) shape as a function of the config; views slice its leading dim.
        pad: the padded-row rule (:class:`Pad`).
        layout: the layout that needs this buffer, or None when every layout does.
        const_step: for ``Pad.CONST`` buffers, ``buf[i] = i * const_step(cfg)``.
        needed: extra presence condition beyond phase and layout (e.g. only for topk > 1).
        doc: one line on what it holds.
    """

    name: str
    phase: Phase | None
    dtype: torch.dtype
    shape: Callable[[PoolConfig], Shape]
    pad: Pad
    doc: str
    layout: Layout | None = None
    const_step: Callable[[PoolConfig], int] | None = None
    needed: Callable[[PoolConfig], bool] | None = None

    @property
    def key(self) -> tuple[Phase | None, str]:
        return (self.phase, self.name)

    @property
    def region(self) -> Region:
        if self.phase is None:
            return Region.SHARED
        return Region.OVERLAY if self.phase in OVERLAID_PHASES else Region.SEPARATE

    def present(self, cfg: PoolConfig) -> bool:
        if self.phase is not None and self.phase not in cfg.phases:
            return False
        if self.layout is not None and not (self.layout & cfg.layout):
            return False
        return self.needed is None or self.needed(cfg)


I32 = torch.int32


def max_rows(cfg: PoolConfig) -> int:
    """Most query rows any phase view can have: bs, bs*N (tree expand) or bs*K (draft expand)."""
    return cfg.max_bs * max(1, cfg.num_draft_tokens, cfg.topk)


def max_arange(cfg: PoolConfig) -> int:
    """Length of the shared ``0, 1, 2, ...`` constant: one more than any row count or width."""
    return max(max_rows(cfg), cfg.max_pages, draft_expand_width(cfg)) + 1


def paged_specs(
    phase: Phase,
    rows: Callable[[PoolConfig], int],
    width: Callable[[PoolConfig], int],
    prefix: str = "",
    needed: Callable[[PoolConfig], bool] | None = None,
    what: str = "",
) -> tuple[BufferSpec, ...]:
    """The six buffers of one paged-attention batch: lengths, cumsum, and both page layouts.

    ``rows`` is the worst-case row count, ``width`` the worst-case pages per row. Every phase part
    (decode, a verify prefix pass, an encoder cross pass, ...) is one such group, so every part has
    the same field names and the same padded-row rules.
    """

    def s(name: str, shape: Callable[[PoolConfig], Shape], pad: Pad, doc: str,
          layout: Layout | None = None) -> BufferSpec:
        return BufferSpec(prefix + name, phase, I32, shape, pad, f"{what}{doc}", layout,
                          needed=needed)

    return (
        s("cache_seqlens", lambda c: (rows(c),), Pad.SEQ_LEN, "KV length per row"),
        s("cu_seqlens_k", lambda c: (rows(c) + 1,), Pad.CUMSUM, "[0, cumsum(cache_seqlens)]"),
        s("page_table", lambda c: (rows(c), width(c)), Pad.PAGE, "page ids per row",
          Layout.FLASH_ATTN),
        s("kv_indptr", lambda c: (rows(c) + 1,), Pad.INDPTR, "CSR row pointers into kv_indices",
          Layout.FLASHINFER),
        # One spare element at the end: the reference update scatters the unused lanes of its
        # [rows, width] page block there, so it never has to compact with a host sync.
        s("kv_indices", lambda c: (rows(c) * width(c) + 1,), Pad.PAYLOAD,
          "CSR page ids (+1 scratch slot at the end)", Layout.FLASHINFER),
        s("kv_last_page_len", lambda c: (rows(c),), Pad.ZERO,
          "tokens in each row's last page (0: no pages)",
          Layout.FLASHINFER),
    )


def _max_bs(c: PoolConfig) -> int:
    return c.max_bs


def _windowed(c: PoolConfig) -> bool:
    return c.sliding_window is not None


def window_specs(phase: Phase) -> tuple[BufferSpec, ...]:
    """The window part of ``phase`` (docs/design.md, Sliding windows): the six buffers of a paged
    part, ``window_`` names, one row per request, ``cfg.window_pages(phase)`` pages wide: memory
    bounded by the window, not by the context."""
    return paged_specs(phase, _max_bs, lambda c: c.window_pages(phase), prefix="window_",
                       needed=_windowed, what="sliding window (rows from the window's first page): ")


def _max_pages(c: PoolConfig) -> int:
    return c.max_pages


def _tree(c: PoolConfig) -> bool:
    return c.topk > 1


def _chain(c: PoolConfig) -> bool:
    return c.topk == 1


def draft_expand_width(c: PoolConfig) -> int:
    """Tokens a draft expand row lists: the last partial prefix page (< P) plus S draft tokens."""
    return c.page_size - 1 + c.spec_steps


def local_rows_per_request(c: PoolConfig) -> int:
    """Virtual batches one request can need: ``q`` queries straddle at most ``(q-1)//A + 2``
    chunks (never more than ``q``), with ``q`` = 1 in decode and N in verify."""
    a = c.attention_chunk_size or 1
    q = max(1, c.num_draft_tokens)
    return min(q, (q - 1) // a + 2)


def local_extend_rows(c: PoolConfig, bs: int) -> int:
    """Virtual rows of a prefill of ``bs`` requests (``T = max_extend_tokens`` new tokens in
    all): request ``i``'s ``q_i`` tokens touch at most ``(q_i-1)//A + 2`` chunks and never more
    than ``q_i``, so all together at most ``min(T, T//A + 2*bs)``; 0 without an extend phase."""
    t, a = c.max_extend_tokens, c.attention_chunk_size or 1
    return min(t, t // a + 2 * bs) if t else 0


def local_rows(c: PoolConfig) -> int:
    """Rows of the local part: the decode / verify shape's or the prefill shape's, the larger."""
    return max(c.max_bs * local_rows_per_request(c), local_extend_rows(c, c.max_bs))


def _local_width(c: PoolConfig) -> int:
    a = c.attention_chunk_size or c.page_size
    return ceil_div(min(a, c.max_context_len), c.page_size)


def _steps(c: PoolConfig) -> int:
    return c.spec_steps


def _per_step(name: str, rows: Callable[[PoolConfig], int], pad: Pad, doc: str,
              needed: Callable[[PoolConfig], bool], extra: int = 0,
              layout: Layout | None = None) -> BufferSpec:
    """A draft buffer with one row of ``rows + extra`` per step: steps of a round are live at once."""
    return BufferSpec(name, Phase.DRAFT, I32, lambda c: (c.spec_steps, rows(c) + extra), pad, doc,
                      layout, needed=needed)


SHARED_SPECS: tuple[BufferSpec, ...] = (
    BufferSpec("arange", None, I32, lambda c: (max_arange(c),), Pad.CONST,
               "0, 1, 2, ...: cu_seqlens_q of one-query-per-row views, page column numbers",
               const_step=lambda c: 1),
    BufferSpec("arange_n", None, I32, lambda c: (c.max_bs + 1,), Pad.CONST,
               "0, N, 2N, ...: cu_seqlens_q of verify (N queries per request)",
               const_step=lambda c: c.num_draft_tokens, needed=lambda c: c.num_draft_tokens > 0),
    BufferSpec("arange_k", None, I32, lambda c: (c.max_bs + 1,), Pad.CONST,
               "0, K, 2K, ...: cu_seqlens_q of the draft tree prefix pass (K queries)",
               const_step=lambda c: c.topk, needed=lambda c: c.spec_steps > 0 and c.topk > 1),
    # Written each step by the flash-attn adapter (FA3 computes it; the tail is zeroed). Used in
    # the same forward as any phase, so it stays outside the overlay.
    BufferSpec("scheduler_metadata", None, I32, lambda c: (ceil_div(c.max_bs, 4) * 4 * 4 + 1,),
               Pad.PAYLOAD, "flash-attn 3 scheduler metadata",
               needed=lambda c: c.fa3_scheduler_metadata),
    # FA3 plans per window setting: window parts (read in the same forward) keep their own
    BufferSpec("window_scheduler_metadata", None, I32,
               lambda c: (ceil_div(c.max_bs, 4) * 4 * 4 + 1,), Pad.PAYLOAD,
               "flash-attn 3 scheduler metadata of window parts",
               needed=lambda c: c.fa3_scheduler_metadata and c.sliding_window is not None),
)

def _flashmla(c: PoolConfig) -> bool:
    return c.flashmla is not None


def _sched_rows(c: PoolConfig, s_q: int) -> int:
    return c.flashmla.num_sm_parts(s_q) if c.flashmla is not None else 0


def flashmla_specs(phase: Phase, s_q: Callable[[PoolConfig], int]) -> tuple[BufferSpec, ...]:
    """FlashMLA's scheduler metadata of ``phase``'s main part, ``s_q`` query rows per request
    (docs/design.md, FlashMLA metadata): ``num_sm_parts`` depends on ``s_q``, so decode and
    verify keep one pair each. Written by the phase's update, from its ``cache_seqlens``."""
    return (
        BufferSpec("tile_scheduler_metadata", phase, I32,
                   lambda c: (_sched_rows(c, s_q(c)), 8), Pad.IDLE,
                   "FlashMLA: per part [begin_req, begin_block, end_req, end_block, "
                   "begin_split, 0, 0, 0]", Layout.FLASH_ATTN, needed=_flashmla),
        BufferSpec("num_splits", phase, I32, lambda c: (c.max_bs + 1,), Pad.INDPTR,
                   "FlashMLA: [0, cumsum(splits per row)]; padded rows none",
                   Layout.FLASH_ATTN, needed=_flashmla),
    )


DECODE_SPECS = (
    *paged_specs(Phase.DECODE, _max_bs, _max_pages),
    # Host flags copied in by an incremental update (``request_ids``) and read by the fused
    # kernel in the same step; never part of a view, so it may share the overlay.
    BufferSpec("keep", Phase.DECODE, torch.int8, lambda c: (c.max_bs,), Pad.PAYLOAD,
               "incremental page table: 1 where the row's request is unchanged"),
    *window_specs(Phase.DECODE),
    *flashmla_specs(Phase.DECODE, lambda c: 1),
)

VERIFY_SPECS = paged_specs(
    Phase.VERIFY, _max_bs, _max_pages, what="chain: prefix+drafts, causal; tree: prefix; "
) + paged_specs(
    Phase.VERIFY, lambda c: c.max_bs * c.num_draft_tokens, lambda c: c.num_draft_tokens,
    prefix="expand_", needed=_tree, what="tree expand (token slots): ",
) + window_specs(Phase.VERIFY) + flashmla_specs(Phase.VERIFY, lambda c: c.num_draft_tokens)

DRAFT_SPECS = (
    # topk == 1: one page table covering seq_len + S serves every step; per step only lengths.
    BufferSpec("page_table", Phase.DRAFT, I32, lambda c: (c.max_bs, c.max_pages), Pad.PAGE,
               "chain: page ids for seq_len + S (shared by all steps)", Layout.FLASH_ATTN,
               needed=_chain),
    _per_step("cache_seqlens", _max_bs, Pad.SEQ_LEN, "chain: seq_len + d per step", _chain),
    _per_step("cu_seqlens_k", _max_bs, Pad.CUMSUM, "chain: cumsum per step", _chain, extra=1),
    # with a sliding window, the same shape over the window's pages (rows start at step 1's
    # window start, so the one table serves every step)
    BufferSpec("window_page_table", Phase.DRAFT, I32,
               lambda c: (c.max_bs, c.window_pages(Phase.DRAFT)), Pad.PAGE,
               "chain window: page ids from step 1's window start", Layout.FLASH_ATTN,
               needed=_windowed),
    _per_step("window_cache_seqlens", _max_bs, Pad.SEQ_LEN, "chain window: length per step",
              _windowed),
    _per_step("window_cu_seqlens_k", _max_bs, Pad.CUMSUM, "chain window: cumsum per step",
              _windowed, extra=1),
    # topk > 1: one prefix part (full pages of the committed prefix) shared by all steps ...
    *paged_specs(Phase.DRAFT, _max_bs, _max_pages, prefix="prefix_", needed=_tree,
                 what="tree prefix (full pages): "),
    # ... and one expand table [bs*K, P-1+S] whose row prefixes serve every step.
    BufferSpec("expand_page_table", Phase.DRAFT, I32,
               lambda c: (c.max_bs * c.topk, draft_expand_width(c)), Pad.PAGE,
               "tree expand token slots: partial page, then the branch's drafts",
               needed=_tree),
    _per_step("expand_cache_seqlens", lambda c: c.max_bs * c.topk, Pad.SEQ_LEN,
              "tree expand: partial + d per step", _tree),
    _per_step("expand_cu_seqlens_k", lambda c: c.max_bs * c.topk, Pad.CUMSUM,
              "tree expand: cumsum per step", _tree, extra=1),
    _per_step("expand_kv_indptr", lambda c: c.max_bs * c.topk, Pad.INDPTR,
              "tree expand CSR per step", _tree, extra=1, layout=Layout.FLASHINFER),
    BufferSpec("expand_kv_indices", Phase.DRAFT, I32,
               lambda c: (c.spec_steps, c.max_bs * c.topk * draft_expand_width(c) + 1),
               Pad.PAYLOAD, "tree expand CSR slots per step (+1 scratch)", Layout.FLASHINFER,
               needed=_tree),
    _per_step("expand_kv_last_page_len", lambda c: c.max_bs * c.topk, Pad.ZERO,
              "tree expand: 1 for a row with token slots, 0 without", _tree, layout=Layout.FLASHINFER),
)

DRAFT_EXTEND_SPECS = (
    BufferSpec("cu_seqlens_q", Phase.DRAFT_EXTEND, I32, lambda c: (c.max_bs + 1,), Pad.CUMSUM,
               "[0, cumsum(accept_lens)]; padded rows one query"),
    *paged_specs(Phase.DRAFT_EXTEND, _max_bs, _max_pages),
    *window_specs(Phase.DRAFT_EXTEND),
)

EXTEND_SPECS = (
    BufferSpec("cu_seqlens_q", Phase.EXTEND, I32, lambda c: (c.max_bs + 1,), Pad.CUMSUM,
               "[0, cumsum(extend_lens)]; padded rows share the rest up to max_extend_tokens"),
    *paged_specs(Phase.EXTEND, _max_bs, _max_pages, what="prefix + new tokens, causal: "),
    BufferSpec("positions", Phase.EXTEND, I32, lambda c: (c.max_extend_tokens,), Pad.ZERO,
               "absolute position of each packed query token (0 past the real ones)"),
    *window_specs(Phase.EXTEND),
)

# Only the cross part: decoder self-attention reuses the decode buffers (offset rows), and the
# cross part is read in the same forward, so it sits outside the overlay.
ENCODER_SPECS = paged_specs(
    Phase.ENCODER, _max_bs, lambda c: ceil_div(c.max_encoder_len, c.page_size), prefix="cross_",
    what="cross-attention over encoder tokens: ",
)

LOCAL_SPECS = (
    BufferSpec("cu_seqlens_q", Phase.LOCAL, I32,
               lambda c: (local_rows(c) + 1,), Pad.CUMSUM,
               "queries per virtual batch, cumsum"),
    *paged_specs(Phase.LOCAL, local_rows, _local_width,
                 what="virtual batch (one chunk): "),
)

#: Every buffer any pool may own. Phase modules add nothing outside this table.
SPECS: tuple[BufferSpec, ...] = (SHARED_SPECS + DECODE_SPECS + VERIFY_SPECS + DRAFT_SPECS
                                 + DRAFT_EXTEND_SPECS + ENCODER_SPECS + LOCAL_SPECS + EXTEND_SPECS)


def specs_for(cfg: PoolConfig, table: tuple[BufferSpec, ...] = SPECS) -> tuple[BufferSpec, ...]:
    """The buffers a pool built from ``cfg`` owns."""
    return tuple(s for s in table if s.present(cfg))

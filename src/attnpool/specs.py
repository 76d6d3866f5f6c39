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

from .config import OVERLAID_PHASES, Layout, Phase, PoolConfig

Shape = tuple[int, ...]


class Pad(enum.Enum):
    """What a padded row (``n <= i < bs``) of a buffer holds, and so what capture sees.

    ``SEQ_LEN``: lengths hold ``cfg.pad_seq_len`` (>= 1, a valid non-empty row).
    ``CUMSUM``: cumulative sums keep growing by the padded lengths, so they stay non-decreasing.
    ``PAGE``: page ids hold ``cfg.pad_page`` in the columns a padded row reads.
    ``INDPTR``: CSR row pointers repeat their last value (a padded row owns no entries).
    ``ONE``: FlashInfer ``last_page_len`` holds 1.
    ``PAYLOAD``: no per-row rule; the read region is bounded by another buffer (CSR indices).
    ``SLOT``: slot mappings hold -1 (the store kernel skips the entry).
    ``CONST``: written once at construction and never by an update; lives outside the overlay so
    no other phase can overwrite it.
    """

    SEQ_LEN = "pad_seq_len"
    CUMSUM = "cumsum"
    PAGE = "pad_page"
    INDPTR = "repeat last"
    ONE = "1"
    PAYLOAD = "-"
    SLOT = "-1"
    CONST = "const"


class Region(enum.Enum):
    """Where a buffer sits in the arena (see DESIGN §5)."""

    SHARED = "shared"  # constants; never overwritten by an update
    OVERLAY = "overlay"  # decode / verify / draft / draft extend share these bytes
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
        s("kv_last_page_len", lambda c: (rows(c),), Pad.ONE, "tokens in each row's last page",
          Layout.FLASHINFER),
    )


def _max_bs(c: PoolConfig) -> int:
    return c.max_bs


def _max_pages(c: PoolConfig) -> int:
    return c.max_pages


SHARED_SPECS: tuple[BufferSpec, ...] = (
    BufferSpec("arange", None, I32, lambda c: (max(max_rows(c), c.max_pages) + 1,), Pad.CONST,
               "0, 1, 2, ...: cu_seqlens_q of one-query-per-row views, page column numbers",
               const_step=lambda c: 1),
    # Written each step by the flash-attn adapter (FA3 computes it; the tail is zeroed). Used in
    # the same forward as any phase, so it stays outside the overlay.
    BufferSpec("scheduler_metadata", None, I32, lambda c: (-(-c.max_bs // 4) * 4 * 4 + 1,),
               Pad.PAYLOAD, "flash-attn 3 scheduler metadata",
               needed=lambda c: c.fa3_scheduler_metadata),
)

DECODE_SPECS: tuple[BufferSpec, ...] = paged_specs(Phase.DECODE, _max_bs, _max_pages)

#: Every buffer any pool may own. Phase modules add nothing outside this table.
SPECS: tuple[BufferSpec, ...] = SHARED_SPECS + DECODE_SPECS


def specs_for(cfg: PoolConfig, table: tuple[BufferSpec, ...] = SPECS) -> tuple[BufferSpec, ...]:
    """The buffers a pool built from ``cfg`` owns."""
    return tuple(s for s in table if s.present(cfg))

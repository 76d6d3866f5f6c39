"""The update paths as one type: what a phase may call, and which module it gets.

:mod:`.reference` and :mod:`.triton` expose the same part functions with the same signatures
(docs/design.md, Update paths): a phase holds one of the two modules as ``ops`` and never
branches on which. :class:`UpdatePath` states that interface as a protocol *modules* satisfy, so a
type checker follows a phase into either path: the assignments in :func:`update_path` check each
module against it. Each ``*_launch`` returns a :class:`Replay`: the part bound once, replayed per
update with the phase's value record (``Launch`` on the fused path, ``Call`` on the reference).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from torch import Tensor

from ..config import SchedLayout
from .buffers import PagedBuffers


class Replay(Protocol):
    """A part's update with its arguments bound (``Launch`` or ``Call``)."""

    #: ``replay(values)``, the same as calling it with ``values`` after :meth:`take`, in the
    #: form a phase's update calls (for a launch, a function written for it: no method frame)
    replay: Callable[[tuple[Any, ...]], None]

    def take(self, values: tuple[Any, ...], **alias: str) -> Replay:
        """Read the per-update inputs from value records shaped like ``values`` from now on."""
        ...

    def __call__(self, values: tuple[Any, ...] | None = None) -> None:
        """Run it: with ``values`` (after :meth:`take`), else as bound."""
        ...

    def bound(self, values: tuple[Any, ...]) -> Callable[[], object]:
        """The update with ``values`` fixed, as a no-argument callable."""
        ...


class UpdatePath(Protocol):
    """The part functions a phase calls; :mod:`.reference` and :mod:`.triton` are both one."""

    def paged_launch(
        self,
        b: PagedBuffers,
        *,
        bs: int,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        extra: int,
        page_size: int,
        pad_seq_len: int,
        pad_page: int,
        token_offset: Tensor | None = None,
        num_real: Tensor | None = None,
        keep: Tensor | None = None,
        q_lens: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None,
        pad_q: int = 1,
        steps: int = 1,
        full_pages: bool = False,
        max_len: int | None = None,
        max_q: int | None = None,
        q_total: int | None = None,
        positions: Tensor | None = None,
        out_slots: Tensor | None = None,
        block_size: int | None = None,
        width: int | None = None,
        window: PagedBuffers | None = None,
        window_size: int | None = None,
        window_table: Tensor | None = None,
        window_out_slots: Tensor | None = None,
    ) -> Replay: ...

    def tree_expand_launch(
        self,
        e: PagedBuffers,
        *,
        bs: int,
        tree_mask: Tensor,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        pad_len: int,
        pad_id: int,
        num_real: Tensor | None = None,
        block_size: int | None = None,
    ) -> Replay: ...

    def draft_tree_expand_launch(
        self,
        e: PagedBuffers,
        *,
        bs: int,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        out_cache_loc: Tensor,
        page_size: int,
        pad_len: int,
        pad_id: int,
        num_real: Tensor | None = None,
        block_size: int | None = None,
    ) -> Replay: ...

    def local_launch(
        self,
        b: PagedBuffers,
        *,
        cu_seqlens_q: Tensor,
        bs: int,
        seq_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        extra: int,
        num_queries: int,
        rows_per_request: int,
        chunk: int,
        page_size: int,
        pad_len: int,
        pad_page: int,
        num_real: Tensor | None = None,
        block_size: int | None = None,
    ) -> Replay: ...

    def local_extend_launch(
        self,
        b: PagedBuffers,
        *,
        cu_seqlens_q: Tensor,
        rows: int,
        seq_lens: Tensor,
        extend_lens: Tensor,
        req_pool_indices: Tensor,
        req_to_token: Tensor,
        chunk: int,
        page_size: int,
        pad_len: int,
        pad_page: int,
        block_size: int | None = None,
    ) -> Replay: ...

    def flashmla_launch(
        self,
        b: PagedBuffers,
        *,
        bs: int,
        n: int,
        tile_scheduler_metadata: Tensor,
        num_splits: Tensor,
        num_parts: int,
        num_real: Tensor | None = None,
        layout: SchedLayout = SchedLayout.ARGUMENTS,
    ) -> Replay: ...

    def keep_flags(self, prev_ids: Sequence[Hashable] | None, ids: Sequence[Hashable], bs: int
                   ) -> list[int]: ...


def update_path(fused: bool) -> UpdatePath:
    """The fused path's module (:mod:`.triton`, imported here on the first fused pool, so
    importing attnpool never loads it; the kernels themselves load on the first launch) or the
    reference path's."""
    path: UpdatePath
    if fused:
        from . import triton

        path = triton
    else:
        from . import reference

        path = reference
    return path

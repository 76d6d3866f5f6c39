"""The update paths as one type: what a phase may call, and which module it gets.

:mod:`.reference` and :mod:`.triton` expose the same part functions with the same signatures
(docs/design.md, Update paths), each taking a part's buffers and its record (:mod:`.parts`): a
phase holds one of the two modules as ``ops`` and never branches on which. :class:`UpdatePath`
states that interface as a protocol *modules* satisfy, so a type checker follows a phase into
either path: the assignments in :func:`update_path` check each module against it. Each
``*_launch`` returns a :class:`Replay`: the part bound once, replayed per update with the phase's
value record (``Launch`` on the fused path, ``Call`` on the reference).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from .buffers import PagedBuffers
from .parts import (
    DraftExpandPart,
    FlashMLAPart,
    LocalExtendPart,
    LocalPart,
    PagedPart,
    TreeExpandPart,
)


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
    """The part functions a phase calls; :mod:`.reference` and :mod:`.triton` are both one.
    Each takes the part's buffers and its record (:mod:`.parts`, every field documented there)."""

    def paged_launch(self, b: PagedBuffers, part: PagedPart) -> Replay: ...

    def tree_expand_launch(self, e: PagedBuffers, part: TreeExpandPart) -> Replay: ...

    def draft_tree_expand_launch(self, e: PagedBuffers, part: DraftExpandPart) -> Replay: ...

    def local_launch(self, b: PagedBuffers, part: LocalPart) -> Replay: ...

    def local_extend_launch(self, b: PagedBuffers, part: LocalExtendPart) -> Replay: ...

    def flashmla_launch(self, b: PagedBuffers, part: FlashMLAPart) -> Replay: ...

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

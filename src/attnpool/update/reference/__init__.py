"""Reference update path: the part updates of :mod:`.triton`, in plain torch (any device).

This module and :mod:`.triton` expose the same functions with the same signatures, one per kind
of part, each taking the part's buffers and its record (:mod:`.parts`): ``paged_launch``
(decode, verify chain, draft chain steps, a draft tree's prefix pass, draft extend and extend
with their query parts, encoder cross and decoder rows), ``tree_expand_launch`` (verify tree),
``draft_tree_expand_launch`` (every step of a draft tree round), ``local_launch`` (chunked local
attention) and ``flashmla_launch`` (FlashMLA's scheduler metadata, :mod:`.flashmla`). Each
binds its record once and is replayed per update with new inputs (see :class:`Call`); the
``*_update_(b, **fields)`` forms build the record and run it once. A phase picks the module once
(``pool.impl``) and has no other branch: both write
the same bytes in every read region (docs/design.md, The contract).

What differs is only how: the reference path is vectorised torch (a few small ops per part, no
loop over rows, no host sync), gathers the caller's table into temporaries *before* its first
write, and has no capturable mode (``num_real`` is refused: it needs the fused kernels' device
count). Two arguments are hints one path uses and the other does not need:

* ``width`` (:func:`paged_update_`): page columns any real row needs, from host lengths. The
  reference path gathers only that many; the fused kernels loop over each row's own live pages.
* ``keep`` (:func:`paged_update_`): the incremental page table. The reference path writes every
  live page anyway (the same bytes: kept pages hold the same ids).

The parts themselves are in :mod:`.parts`, over the row layouts of
:mod:`.rows` and the writers of :mod:`.writes` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, TypeVar

from ...errors import CapacityError
from ..buffers import PagedBuffers, table_width
from ..launch import RecordPaths, record_paths
from ..parts import DraftExpandPart, LocalPart, PagedPart, TreeExpandPart
from .flashmla import flashmla_part_
from .lean import LeanPaged, lean_fits
from .parts import (
    draft_tree_expand_part_,
    local_extend_part_,
    local_part_,
    paged_part_,
    tree_expand_part_,
)
from .rows import (
    draft_expand,
    extend_tokens,
    gather_pages,
    local_rows,
    table_slots,
    tree_expand,
)
from .writes import cumsum_, lengths_, paged_

__all__ = [
    "Call",
    "PagedBuffers",
    "cumsum_",
    "draft_expand",
    "draft_tree_expand_launch",
    "draft_tree_expand_update_",
    "extend_tokens",
    "flashmla_launch",
    "gather_pages",
    "keep_flags",
    "lengths_",
    "local_extend_launch",
    "local_launch",
    "local_rows",
    "local_update_",
    "paged_",
    "paged_launch",
    "paged_update_",
    "table_slots",
    "table_width",
    "tree_expand",
    "tree_expand_launch",
    "tree_expand_update_",
]

R = TypeVar("R")


class Call:
    """One reference part update with its record bound, replayable with new inputs.

    The same replay protocol as :class:`attnpool.update.launch.Launch` (``take``, ``__call__``,
    ``bound``: :class:`attnpool.update.paths.Replay`), so a phase caches and replays either
    path's parts the same way. ``inputs`` are the per-update inputs (tensors and host hints), by
    the record's field names. The record is the Call's own (the phase built it for this launch
    and keeps no reference): each call sets those fields from the value record in place, runs
    the part and clears them again, as a launch clears its stored inputs, so no step's tensors
    stay referenced and no 28-field record is rebuilt per update.
    """

    __slots__ = ("b", "fn", "inputs", "part", "paths", "replay")

    def __init__(self, fn: Callable[[PagedBuffers, Any], None], b: PagedBuffers, part: Any,
                 inputs: tuple[str, ...]) -> None:
        self.fn, self.b, self.part = fn, b, part
        self.inputs = tuple(k for k in inputs if getattr(part, k) is not None)
        self.paths = RecordPaths((), ())
        #: the per-update call (the same as calling the part with values)
        self.replay: Callable[[tuple[Any, ...]], None] = self.__call__

    def take(self, values: tuple[Any, ...], **alias: str) -> Call:
        """Read the inputs from value records shaped like ``values`` (``alias``: field -> the
        name it has there); the binding call's tensors are released, as a launch's are."""
        self.paths = record_paths(values, [(k, k) for k in self.inputs], alias)
        for k in self.inputs:
            setattr(self.part, k, None)
        return self

    def __call__(self, values: tuple[Any, ...] | None = None) -> None:
        """Run the update, with the inputs of :meth:`take` read from ``values`` (None: as built)."""
        if values is None:
            self.fn(self.b, self.part)
            return
        part, inputs, paths = self.part, values[0], self.paths
        for k, i in paths.from_inputs:
            setattr(part, k, inputs[i])
        for k, i in paths.from_record:
            setattr(part, k, values[i])
        try:
            self.fn(self.b, part)
        finally:
            for k in self.inputs:
                setattr(part, k, None)

    def bound(self, values: tuple[Any, ...]) -> Callable[[], object]:
        """The update with ``values`` fixed: a no-argument callable."""
        return partial(self.__call__, values)


def _launcher(name: str, part: Callable[[PagedBuffers, R], None], inputs: tuple[str, ...]
              ) -> Callable[[PagedBuffers, R], Call]:
    """The reference ``*_launch`` of ``part`` (the fused module's name and arguments: the
    buffers and the record), bound in a :class:`Call`. ``inputs``: the per-update fields."""
    def launch(b: PagedBuffers, record: R) -> Call:
        return Call(part, b, record, inputs)

    launch.__name__ = launch.__qualname__ = name
    launch.__doc__ = (f"Bind one update of the part (:func:`{part.__name__}` says what it "
                      f"writes); the same arguments as :func:`attnpool.update.triton.{name}`.")
    launch.__wrapped__ = part  # type: ignore[attr-defined]  # (inspect.signature shows part's)
    return launch


#: the per-update fields of a paged part
_PAGED_INPUTS = ("seq_lens", "req_pool_indices", "req_to_token", "token_offset", "num_real",
                 "keep", "q_lens", "out_slots", "width", "tokens", "window_table",
                 "window_out_slots")
_paged_general = _launcher("paged_launch", paged_part_, _PAGED_INPUTS)


def paged_launch(b: PagedBuffers, part: PagedPart) -> Call:
    """Bind one paged part update (:func:`paged_part_` says what it writes); the same
    arguments as :func:`attnpool.update.triton.paged_launch`. A part of the shape engines step
    with (:func:`.lean.lean_fits`) binds the lean part, the same bytes in fewer
    ops."""
    if lean_fits(b, part):
        return Call(LeanPaged(), b, part, _PAGED_INPUTS)
    return _paged_general(b, part)


#: the other ``*_launch`` functions, one per kind of part (the fused module's names and
#: arguments)
tree_expand_launch = _launcher("tree_expand_launch", tree_expand_part_, (
    "tree_mask", "seq_lens", "req_pool_indices", "req_to_token", "num_real"))
draft_tree_expand_launch = _launcher("draft_tree_expand_launch", draft_tree_expand_part_, (
    "seq_lens", "req_pool_indices", "req_to_token", "out_cache_loc", "num_real"))
local_launch = _launcher("local_launch", local_part_, (
    "seq_lens", "req_pool_indices", "req_to_token", "num_real"))
#: prefill-shaped local attention: rows per request vary with the new tokens, so no fixed-stride
#: kernel serves it; both update paths run these ops (its own launch name: see LocalPhase)
local_extend_launch = _launcher("local_extend_launch", local_extend_part_, (
    "seq_lens", "extend_lens", "req_pool_indices", "req_to_token"))

#: FlashMLA's scheduler metadata of a part's lengths (the exact torch port: a few ops per part)
flashmla_launch = _launcher("flashmla_launch", flashmla_part_, ("n", "num_real"))


def paged_update_(b: PagedBuffers, **kw: Any) -> None:
    """:func:`paged_launch` of ``PagedPart(**kw)``, run once."""
    paged_launch(b, PagedPart(**kw))()


def tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """:func:`tree_expand_launch` of ``TreeExpandPart(**kw)``, run once."""
    tree_expand_launch(e, TreeExpandPart(**kw))()


def draft_tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """:func:`draft_tree_expand_launch` of ``DraftExpandPart(**kw)``, run once."""
    draft_tree_expand_launch(e, DraftExpandPart(**kw))()


def local_update_(b: PagedBuffers, **kw: Any) -> None:
    """:func:`local_launch` of ``LocalPart(**kw)``, run once."""
    local_launch(b, LocalPart(**kw))()


def keep_flags(prev_ids: Sequence[Hashable] | None, ids: Sequence[Hashable], bs: int
               ) -> list[int]:
    """Host-side ``keep`` values, as :func:`attnpool.update.triton.keep_flags` takes them, all 0:
    the reference path keeps no page (every row writes all its live pages: the same bytes), so a
    caller that asks it skips the flags' host tensor and copy."""
    if len(ids) > bs:
        raise CapacityError(f"ids must have <= bs={bs} values, got {len(ids)}")
    return [0] * bs

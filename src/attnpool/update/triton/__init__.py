"""Fused update path: one Triton launch per phase part, capturable, writes ∝ live pages.

Each function here writes exactly the bytes the reference path (:mod:`.reference`) writes in every
read region of a part (docs/design.md, The contract), in **one kernel launch**, and nothing else
on the hot path: no host read (``Tensor.item``, ``Tensor.cpu``), no allocation, no aten op, no
shape that depends on a tensor's values. Host checks (shapes, dtypes, devices, capacities) read
only tensor metadata and raise attnpool errors before the launch, so a rejected call writes nothing.

Two ways to use them:

* **Eager, one launch per part** (``num_real=None``): ``seq_lens`` etc. hold the ``n`` real rows,
  ``n`` is their Python length, rows ``n..bs`` are padding. The grid is ``bs`` programs.
* **Inside the engine's own CUDA graph** (``num_real`` given): the inputs are padded to ``bs``
  rows (the values of rows past the real count are never read) and ``num_real`` is a one-element
  int32/int64 device tensor holding the real count ``n``. Everything the launch bakes into a graph
  (grid, block sizes, pointers, ``bs``) is then independent of ``n``, so an engine can record the
  update in the same graph as the forward and change the real count per replay by writing
  ``num_real`` (and the inputs) in place, without recapture. ``num_real`` is clamped to
  ``[0, bs]`` on the device. Call the function once before capture: the first call of a shape
  (and of each flag combination) compiles the kernel, which must not happen inside a capture.

Parts and their launches: decode, verify chain, draft extend (with its query part), encoder cross
and decoder rows (``token_offset``) are :func:`paged_update_`; all chain draft steps of a round are
one :func:`paged_update_` with ``steps``; a draft tree round is :func:`paged_update_` with
``full_pages`` (prefix) plus :func:`draft_tree_expand_update_` (every step's expand rows); a verify
tree is :func:`paged_update_` plus :func:`tree_expand_update_`; chunked local attention is
:func:`local_update_`. FlashMLA's scheduler metadata (``PoolConfig(flashmla=...)``, decode and
verify) is :func:`flashmla_launch` after the part whose lengths it schedules.

Every address a kernel touches is bounded without a host read (row indices clamped into
``req_to_token``, columns into its width and the page table's, CSR positions into ``kv_indices``):
out-of-contract values (which only a sync could detect) give wrong metadata, never a stray write.

Incremental page tables (``keep``): the page id of page ``p`` of a request never changes once the
page exists, so a row whose request is the same as at the previous update already holds its old
pages. ``keep [bs]`` (a device tensor, non-zero = same request as last time; see
:func:`keep_flags`) makes such rows write only page-table columns from the previous length's page
count onward, where the previous length is what ``cache_seqlens`` holds before this update. That is
valid only if nothing else wrote this part's buffers since the previous update (an overlaid phase,
a capture state) and ``extra``/``token_offset`` are unchanged for the row: the caller (the phase)
tracks that and passes ``keep=None`` otherwise. FlashInfer's CSR is always written in full: its
positions shift whenever an earlier row's page count changes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from ...errors import CapacityError
from ..buffers import PagedBuffers
from ..parts import LocalPart, PagedPart, TreeExpandPart
from ..reference import local_extend_launch as local_extend_launch
from .draft import draft_tree_expand_launch, draft_tree_expand_update_
from .flashmla import flashmla_launch
from .local import local_launch
from .paged import paged_launch
from .tree import tree_expand_launch

__all__ = [
    "draft_tree_expand_launch", "draft_tree_expand_update_", "flashmla_launch", "keep_flags",
    "local_extend_launch", "local_launch", "local_update_", "paged_launch", "paged_update_",
    "tree_expand_launch", "tree_expand_update_",
]
# ``local_extend_launch`` is the reference part's (torch ops): the prefill shape of local
# attention has a varying row count per request, which no fixed-stride program covers; its
# rows come from a ``searchsorted`` with no host read, on either path (see LocalPhase).


def paged_update_(b: PagedBuffers, **kw: Any) -> None:
    """Write one paged part's read region for ``bs`` rows in one launch: :func:`paged_launch`
    of ``PagedPart(**kw)``, run once."""
    paged_launch(b, PagedPart(**kw))()


def tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """Write the verify tree *expand* part in one launch: :func:`tree_expand_launch` of
    ``TreeExpandPart(**kw)``, run once."""
    tree_expand_launch(e, TreeExpandPart(**kw))()


def local_update_(b: PagedBuffers, **kw: Any) -> None:
    """Write the chunked-local-attention part in one launch: :func:`local_launch` of
    ``LocalPart(**kw)``, run once."""
    local_launch(b, LocalPart(**kw))()


def keep_flags(prev_ids: Sequence[Hashable] | None, ids: Sequence[Hashable], bs: int
               ) -> list[int]:
    """Host-side ``keep`` values for :func:`paged_update_`: 1 where row ``i`` serves the same
    request as at the previous update, 0 for new requests, padded rows and when there was no
    previous update. ``ids`` are host ids unique per live request: not ``req_pool_indices``, whose
    slots are reused by new requests. The caller copies the flags into its ``[bs]`` device tensor
    (a ``non_blocking`` copy; from pinned memory it also leaves the host free at once)."""
    if len(ids) > bs:
        raise CapacityError(f"ids must have <= bs={bs} values, got {len(ids)}")
    prev = list(prev_ids) if prev_ids is not None else []
    return [int(i < len(prev) and prev[i] == x) for i, x in enumerate(ids)] + [0] * (bs - len(ids))

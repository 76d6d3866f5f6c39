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

import torch
from torch import Tensor

from ..config import ceil_div, is_int
from ..errors import CapacityError, InputError
from ..inputs import check_tensor
from . import triton_checks as checks
from . import tuning
from .buffers import PagedBuffers
from .kernel_loaders import kernels
from .launch import Launch, part_pointers, pointer_or, replayable
from .reference import local_extend_launch as local_extend_launch
from .triton_draft import draft_tree_expand_launch, draft_tree_expand_update_
from .triton_flashmla import flashmla_launch
from .triton_paged import paged_launch
from .tuning import MAX_BLOCK_P, MAXNREG, pow2, scan_block, warps

__all__ = [
    "draft_tree_expand_launch",
    "draft_tree_expand_update_", "flashmla_launch", "keep_flags", "local_extend_launch", "local_launch",
    "local_update_", "paged_launch", "paged_update_", "tree_expand_launch", "tree_expand_update_",
]
# ``local_extend_launch`` is the reference part's (torch ops): the prefill shape of local
# attention has a varying row count per request, which no fixed-stride program covers; its
# rows come from a ``searchsorted`` with no host read, on either path (see LocalPhase).


def paged_update_(b: PagedBuffers, **kw: Any) -> None:
    """Write one paged part's read region for ``bs`` rows in one launch: :func:`paged_launch`
    with the same arguments, run once."""
    paged_launch(b, **kw)()


def tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """Write the verify tree *expand* part in one launch: :func:`tree_expand_launch`, run once."""
    tree_expand_launch(e, **kw)()


def tree_expand_launch(
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
) -> Launch:
    """Check and assemble the verify tree *expand* part (``bs*N`` token-slot rows, page size 1).

    Row ``i*N + j`` lists the slots ``req_to_token[r_i, seq_lens[i] + k]`` of the drafts ``k``
    that ``tree_mask[i, j, k]`` allows, allowed first in increasing ``k``; its length is the
    allowed count. Rows of padded requests get ``pad_len`` copies of ``pad_id`` (the pad page's
    first slot). Same bytes in every read region as ``reference.tree_expand`` written with
    ``page_size=1``. ``num_real`` works as in :func:`paged_update_` (inputs padded to ``bs``),
    ``block_size`` as in :func:`paged_launch` (the expand rows are token slots either way).
    """
    dev = e.cache_seqlens.device
    tree_mask = check_tensor("tree_mask", tree_mask, None, 3, (torch.bool,), device=dev,
                             contiguous=False)
    if not tree_mask.shape[1] == tree_mask.shape[2] >= 1:
        raise InputError(f"tree_mask must be [n, N, N] with N >= 1, got shape "
                         f"{tuple(tree_mask.shape)}")
    n, nd = tree_mask.shape[0], tree_mask.shape[1]
    checks.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    if num_real is not None:
        checks.need(n == bs, InputError, f"with num_real, tree_mask must have bs={bs} rows, got {n}")
    checks.real_count(num_real, n, bs, dev)
    checks.need(0 <= pad_len <= nd, InputError, f"pad_len must be in [0, N={nd}], got {pad_len}")
    seq_lens = checks.vec("seq_lens", seq_lens, n, dev)
    req_pool_indices = checks.vec("req_pool_indices", req_pool_indices, n, dev)
    table = checks.table(req_to_token, dev)
    tok_cols, tp, block_table = checks.block(table, block_size)
    has_pt, has_fi = checks.layouts(e, bs * nd, dev, nd)
    dummy = e.cache_seqlens
    block_n = pow2(nd, 2)
    tile = tuning.tree_tile(block_n)
    args = {
        "mask_ptr": tree_mask, "seq_ptr": seq_lens, "rpi_ptr": req_pool_indices,
        "tok_ptr": table, "nreal_ptr": pointer_or(num_real, dummy), **part_pointers(e, dummy),
        "n": n, "bs": bs, "ND": nd, "pad_len": pad_len, "pad_id": pad_id,
        "ms0": tree_mask.stride(0), "ms1": tree_mask.stride(1), "ms2": tree_mask.stride(2),
        "tok_rows": table.shape[0], "tok_cols": tok_cols, "tok_stride": table.stride(0),
        "pt_stride": e.page_table.stride(0) if e.page_table is not None else 0,
        "indices_cap": e.kv_indices.shape[0] if e.kv_indices is not None else 0, "TP": tp,
        "DEVICE_N": num_real is not None, "HAS_PT": has_pt, "HAS_FI": has_fi,
        "BLOCK_N": block_n, "BLOCK_TABLE": block_table, "BLOCK_R": tile["BLOCK_R"],
        "BLOCK_J": tile["BLOCK_J"],
    }
    inputs = replayable(n=("n", n), mask_ptr=("tree_mask", tree_mask),
                        seq_ptr=("seq_lens", seq_lens),
                        rpi_ptr=("req_pool_indices", req_pool_indices),
                        tok_ptr=("req_to_token", table), nreal_ptr=("num_real", num_real))
    return Launch(kernels().tree_expand_kernel, (bs,), args,
                  {"num_warps": tile["num_warps"], "maxnreg": tile["maxnreg"]}, inputs)


def local_update_(b: PagedBuffers, **kw: Any) -> None:
    """Write the chunked-local-attention part in one launch: :func:`local_launch`, run once."""
    local_launch(b, **kw)()


def local_launch(
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
) -> Launch:
    """Check and assemble the chunked-local-attention part (``bs * rows_per_request`` virtual rows).

    Same bytes in every read region as the reference local phase: ``reference.local_rows`` over
    ``seq_lens + extra`` with ``num_queries`` queries per request, pages gathered from each row's
    chunk start (rows past a request's last chunk: ``pad_len`` keys on ``pad_page``), and
    ``cu_seqlens_q`` where a padded request's first row takes ``num_queries`` queries so request
    ``i``'s queries start at row ``i * rows_per_request``. ``num_real`` as in
    :func:`paged_update_` (a count of requests; inputs padded to ``bs``); ``block_size`` as in
    :func:`paged_launch`.
    """
    dev = b.cache_seqlens.device
    checks.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    for name, x, lo in (("rows_per_request", rows_per_request, 1), ("chunk", chunk, 1),
                        ("page_size", page_size, 1), ("num_queries", num_queries, 0),
                        ("pad_len", pad_len, 0)):
        checks.need(is_int(x) and x >= lo, InputError, f"{name} must be an int >= {lo}, got {x}")
    if not isinstance(seq_lens, Tensor):
        raise InputError(f"seq_lens must be a torch.Tensor, got {type(seq_lens).__name__}")
    seq_lens = checks.vec("seq_lens", seq_lens, bs if num_real is not None else seq_lens.shape[0], dev)
    n = seq_lens.shape[0]
    checks.real_count(num_real, n, bs, dev)
    req_pool_indices = checks.vec("req_pool_indices", req_pool_indices, n, dev)
    table = checks.table(req_to_token, dev)
    tok_cols, tp, block_table = checks.block(table, block_size)
    rows = bs * rows_per_request
    pad_pages = ceil_div(pad_len, page_size)
    has_pt, has_fi = checks.layouts(b, rows, dev, pad_pages)
    checks.buf("cu_seqlens_q", cu_seqlens_q, rows + 1, dev)
    if b.page_table is not None:
        width, pt_stride = b.page_table.shape[1], b.page_table.stride(0)
    else:
        width, pt_stride = ceil_div(min(chunk, tok_cols), page_size), 0
    dummy = b.cache_seqlens
    args = {
        "seq_ptr": seq_lens, "rpi_ptr": req_pool_indices, "tok_ptr": table,
        "nreal_ptr": pointer_or(num_real, dummy), **part_pointers(b, dummy), "cuq_ptr": cu_seqlens_q,
        "n": n, "bs": bs, "per": rows_per_request, "extra": extra, "q": num_queries,
        "chunk": chunk, "pad_len": pad_len, "pad_page": pad_page, "P": page_size,
        "tok_rows": table.shape[0], "tok_cols": tok_cols, "tok_stride": table.stride(0),
        "pt_stride": pt_stride, "cap_pages": width,
        "indices_cap": b.kv_indices.shape[0] if b.kv_indices is not None else 0, "TP": tp,
        "DEVICE_N": num_real is not None, "HAS_PT": has_pt, "HAS_FI": has_fi,
        "BLOCK": scan_block(rows), "BLOCK_P": min(MAX_BLOCK_P, pow2(width)),
        "BLOCK_TABLE": block_table,
    }
    inputs = replayable(n=("n", n), seq_ptr=("seq_lens", seq_lens),
                        rpi_ptr=("req_pool_indices", req_pool_indices),
                        tok_ptr=("req_to_token", table), nreal_ptr=("num_real", num_real))
    return Launch(kernels().local_kernel, (rows,), args,
                  {"num_warps": warps(rows), "maxnreg": MAXNREG}, inputs)


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

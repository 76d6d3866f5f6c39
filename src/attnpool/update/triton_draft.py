"""Fused draft-tree expand update: every step of a speculative round in one launch.

The prefix pass of a draft tree is :func:`attnpool.update.triton.paged_update_` with
``full_pages=True``; chain rounds are ``paged_update_`` with ``steps=S``. This module adds the tree
expand part, whose ``bs*K`` token-slot rows (page size 1) serve all ``S`` steps: one shared table
``[bs*K, P-1+S]`` and, per step, lengths, cumsums and a small CSR. The same rules as the other
fused updates hold (one launch, no aten op, no host sync, capturable with ``num_real``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..config import is_int
from ..errors import CapacityError, InputError
from ..inputs import check_tensor
from . import triton_checks as ck
from .reference import PagedBuffers

__all__ = ["draft_tree_expand_launch", "draft_tree_expand_update_"]


def draft_tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """Write the draft tree expand rows of all ``S`` steps in one launch:
    :func:`draft_tree_expand_launch`, run once."""
    draft_tree_expand_launch(e, **kw)()


def draft_tree_expand_launch(
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
) -> ck.Launch:
    """Check and assemble the draft tree expand rows of all ``S`` steps for ``bs`` requests.

    Same bytes in every read region as ``reference.draft_expand`` written step by step the way
    the reference draft phase does: step ``d`` (1-based) has ``cache_seqlens = part + d`` with
    ``part = seq_lens % P`` the tokens of the last, partial prefix page, listing those token slots
    then branch ``k``'s first ``d`` drafts ``out_cache_loc[i, :d, k]``. Rows of padded requests:
    ``pad_len`` copies of ``pad_id``, no CSR entries, ``kv_last_page_len = 0``.

    Args:
        e: stacked buffers: ``cache_seqlens [S, >= bs*K]``, ``cu_seqlens_k [S, >= bs*K+1]``,
            the shared ``page_table [>= bs*K, >= P-1+S]`` (or None) and, for FlashInfer, per step
            ``kv_indptr [S, >= bs*K+1]``, ``kv_indices [S, cap]``, ``kv_last_page_len [S, >= bs*K]``.
        out_cache_loc: ``[n, S, K]`` int32/int64 token slots (``[bs, S, K]`` with ``num_real``).
        seq_lens, req_pool_indices: ``[n]`` (``[bs]`` with ``num_real``) committed lengths and rows.
        block_size: ``req_to_token`` is a page-level block table (see
            :func:`attnpool.update.triton.paged_launch`); the prefix page's slots are read from it.
    """
    dev = e.cache_seqlens.device
    ck.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    loc = check_tensor("out_cache_loc", out_cache_loc, None, 3, ck.INT, device=dev,
                       contiguous=False)
    if loc.shape[1] < 1 or loc.shape[2] < 1:
        raise InputError(f"out_cache_loc must be [n, S, K] with S, K >= 1, got shape "
                         f"{tuple(loc.shape)}")
    n, steps, topk = loc.shape
    if num_real is not None:
        ck.need(n == bs, InputError, f"with num_real, out_cache_loc must have bs={bs} rows, got {n}")
    ck.real_count(num_real, n, bs, dev)
    ck.need(is_int(page_size) and page_size >= 1, InputError,
            f"page_size must be an int >= 1, got {page_size}")
    width = page_size - 1 + steps
    ck.need(0 <= pad_len <= width, InputError, f"pad_len must be in [0, P-1+S={width}], got {pad_len}")
    seq_lens = ck.vec("seq_lens", seq_lens, n, dev)
    req_pool_indices = ck.vec("req_pool_indices", req_pool_indices, n, dev)
    table = ck.table(req_to_token, dev)
    tok_cols, tp, block_table = ck.block(table, block_size)
    rows = bs * topk
    has_pt, has_fi = ck.layouts(e, rows, dev, width, steps)
    pt, ip, idx, last = e.page_table, e.kv_indptr, e.kv_indices, e.kv_last_page_len
    dummy = e.cache_seqlens
    from . import triton_draft_kernels as k

    args = (
        seq_lens, req_pool_indices, table, loc, num_real if num_real is not None else dummy,
        e.cache_seqlens, e.cu_seqlens_k,
        pt if pt is not None else dummy, ip if ip is not None else dummy,
        idx if idx is not None else dummy, last if last is not None else dummy,
        n, bs, topk, steps, width, pad_len, pad_id, page_size, *loc.stride(),
        table.shape[0], tok_cols, table.stride(0), pt.stride(0) if pt is not None else 0,
        e.cache_seqlens.stride(0), e.cu_seqlens_k.stride(0),
        ip.stride(0) if ip is not None else 0, idx.stride(0) if idx is not None else 0,
        last.stride(0) if last is not None else 0, idx.shape[1] if idx is not None else 0, tp,
    )
    kw = {"DEVICE_N": num_real is not None, "HAS_PT": has_pt, "HAS_FI": has_fi,
          "BLOCK": ck.scan_block(rows), "BLOCK_W": ck.pow2(width, 2), "BLOCK_TABLE": block_table,
          "num_warps": ck.warps(rows), "maxnreg": ck.MAXNREG}
    dyn = ck.dyn(n=(11, n), seq_lens=(0, seq_lens), req_pool_indices=(1, req_pool_indices),
                 req_to_token=(2, table), out_cache_loc=(3, loc), num_real=(4, num_real))
    return ck.Launch(k.draft_expand_kernel, (rows,), args, kw, dyn)


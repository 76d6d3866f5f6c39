"""Fused draft-tree expand update: every step of a speculative round in one launch.

The prefix pass of a draft tree is :func:`attnpool.update.triton.paged_update_` with
``full_pages=True``; chain rounds are ``paged_update_`` with ``steps=S``. This module adds the tree
expand part, whose ``bs*K`` token-slot rows (page size 1) serve all ``S`` steps: one shared table
``[bs*K, P-1+S]`` and, per step, lengths, cumsums and a small CSR. The same rules as the other
fused updates hold (one launch, no aten op, no host sync, capturable with ``num_real``).
"""

from __future__ import annotations

from typing import Any

from ...config import is_int
from ...errors import CapacityError, InputError
from ...inputs import check_tensor
from ..buffers import PagedBuffers
from ..launch import Launch, part_pointers, pointer_or, replayable
from ..parts import DraftExpandPart
from . import checks
from .loaders import draft_kernels
from .tuning import MAXNREG, pow2, scan_block, warps

__all__ = ["draft_tree_expand_launch", "draft_tree_expand_update_"]


def draft_tree_expand_update_(e: PagedBuffers, **kw: Any) -> None:
    """Write the draft tree expand rows of all ``S`` steps in one launch:
    :func:`draft_tree_expand_launch` of ``DraftExpandPart(**kw)``, run once."""
    draft_tree_expand_launch(e, DraftExpandPart(**kw))()


def draft_tree_expand_launch(e: PagedBuffers, part: DraftExpandPart) -> Launch:
    """Check and assemble the draft tree expand rows of all ``S`` steps for ``bs`` requests.

    Same bytes in every read region as ``reference.draft_expand`` written step by step the way
    the reference draft phase does: step ``d`` (1-based) has ``cache_seqlens = part + d`` with
    ``part = seq_lens % P`` the tokens of the last, partial prefix page, listing those token slots
    then branch ``k``'s first ``d`` drafts ``out_cache_loc[i, :d, k]``. Rows of padded requests:
    ``pad_len`` copies of ``pad_id``, no CSR entries, ``kv_last_page_len = 0``.

    ``e``: stacked buffers: ``cache_seqlens [S, >= bs*K]``, ``cu_seqlens_k [S, >= bs*K+1]``,
    the shared ``page_table [>= bs*K, >= P-1+S]`` (or None) and, for FlashInfer, per step
    ``kv_indptr [S, >= bs*K+1]``, ``kv_indices [S, cap]``, ``kv_last_page_len [S, >= bs*K]``.
    """
    bs, num_real, page_size, pad_len = part.bs, part.num_real, part.page_size, part.pad_len
    dev = e.cache_seqlens.device
    checks.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    loc = check_tensor("out_cache_loc", part.out_cache_loc, None, 3, checks.INT, device=dev,
                       contiguous=False)
    if loc.shape[1] < 1 or loc.shape[2] < 1:
        raise InputError(f"out_cache_loc must be [n, S, K] with S, K >= 1, got shape "
                         f"{tuple(loc.shape)}")
    n, steps, topk = loc.shape
    if num_real is not None:
        checks.need(n == bs, InputError, f"with num_real, out_cache_loc must have bs={bs} rows, got {n}")
    checks.real_count(num_real, n, bs, dev)
    checks.need(is_int(page_size) and page_size >= 1, InputError,
            f"page_size must be an int >= 1, got {page_size}")
    width = page_size - 1 + steps
    checks.need(0 <= pad_len <= width, InputError,
                f"pad_len must be in [0, P-1+S={width}], got {pad_len}")
    seq_lens = checks.vec("seq_lens", part.seq_lens, n, dev)
    req_pool_indices = checks.vec("req_pool_indices", part.req_pool_indices, n, dev)
    table = checks.table(part.req_to_token, dev)
    tok_cols, tp, block_table = checks.block(table, part.block_size)
    rows = bs * topk
    has_pt, has_fi = checks.layouts(e, rows, dev, width, steps)
    pt, ip, idx, last = e.page_table, e.kv_indptr, e.kv_indices, e.kv_last_page_len
    dummy = e.cache_seqlens
    args = {
        "seq_ptr": seq_lens, "rpi_ptr": req_pool_indices, "tok_ptr": table, "loc_ptr": loc,
        "nreal_ptr": pointer_or(num_real, dummy), **part_pointers(e, dummy),
        "n": n, "bs": bs, "K": topk, "S": steps, "W": width, "pad_len": pad_len,
        "pad_id": part.pad_id, "P": page_size,
        "ls0": loc.stride(0), "ls1": loc.stride(1), "ls2": loc.stride(2),
        "tok_rows": table.shape[0], "tok_cols": tok_cols, "tok_stride": table.stride(0),
        "pt_stride": pt.stride(0) if pt is not None else 0,
        "len_ss": e.cache_seqlens.stride(0), "cu_ss": e.cu_seqlens_k.stride(0),
        "ip_ss": ip.stride(0) if ip is not None else 0,
        "idx_ss": idx.stride(0) if idx is not None else 0,
        "last_ss": last.stride(0) if last is not None else 0,
        "indices_cap": idx.shape[1] if idx is not None else 0, "TP": tp,
        "DEVICE_N": num_real is not None, "HAS_PT": has_pt, "HAS_FI": has_fi,
        "BLOCK": scan_block(rows), "BLOCK_W": pow2(width, 2), "BLOCK_TABLE": block_table,
    }
    inputs = replayable(n=("n", n), seq_ptr=("seq_lens", seq_lens),
                        rpi_ptr=("req_pool_indices", req_pool_indices),
                        tok_ptr=("req_to_token", table), loc_ptr=("out_cache_loc", loc),
                        nreal_ptr=("num_real", num_real))
    return Launch(draft_kernels().draft_expand_kernel, (rows,), args,
                  {"num_warps": warps(rows), "maxnreg": MAXNREG}, inputs)

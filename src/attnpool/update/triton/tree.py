"""Fused verify tree *expand* part: :func:`tree_expand_launch`, one launch of ``bs`` programs.

The rules of :mod:`attnpool.update.triton`'s docstring hold (one launch, no aten op, no host
sync, capturable with ``num_real``); the rows are token slots (page size 1).
"""

from __future__ import annotations

import torch

from ...config import is_int
from ...errors import CapacityError, InputError
from ...inputs import check_tensor
from ..buffers import PagedBuffers
from ..launch import Launch, part_pointers, pointer_or, replayable
from ..parts import TreeExpandPart
from . import checks, tuning
from .loaders import kernels
from .tuning import pow2

__all__ = ["tree_expand_launch"]


def tree_expand_launch(e: PagedBuffers, part: TreeExpandPart) -> Launch:
    """Check and assemble the verify tree *expand* part (``bs*N`` token-slot rows, page size 1).

    Row ``i*N + j`` lists the slots ``req_to_token[r_i, seq_lens[i] + k]`` of the drafts ``k``
    that ``tree_mask[i, j, k]`` allows, allowed first in increasing ``k``; its length is the
    allowed count. Rows of padded requests get ``pad_len`` copies of ``pad_id`` (the pad page's
    first slot). Same bytes in every read region as ``reference.tree_expand`` written with
    ``page_size=1``. ``num_real`` works as in :func:`paged_update_` (inputs padded to ``bs``),
    ``block_size`` as in :func:`paged_launch` (the expand rows are token slots either way).
    """
    bs, num_real, pad_len = part.bs, part.num_real, part.pad_len
    dev = e.cache_seqlens.device
    tree_mask = check_tensor("tree_mask", part.tree_mask, None, 3, (torch.bool,), device=dev,
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
    seq_lens = checks.vec("seq_lens", part.seq_lens, n, dev)
    req_pool_indices = checks.vec("req_pool_indices", part.req_pool_indices, n, dev)
    table = checks.table(part.req_to_token, dev)
    tok_cols, tp, block_table = checks.block(table, part.block_size)
    has_pt, has_fi = checks.layouts(e, bs * nd, dev, nd)
    dummy = e.cache_seqlens
    block_n = pow2(nd, 2)
    tile = tuning.tree_tile(block_n)
    args = {
        "mask_ptr": tree_mask, "seq_ptr": seq_lens, "rpi_ptr": req_pool_indices,
        "tok_ptr": table, "nreal_ptr": pointer_or(num_real, dummy), **part_pointers(e, dummy),
        "n": n, "bs": bs, "ND": nd, "pad_len": pad_len, "pad_id": part.pad_id,
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

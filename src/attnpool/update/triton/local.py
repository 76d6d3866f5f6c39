"""Fused chunked-local-attention part: :func:`local_launch`, one launch of ``bs *
rows_per_request`` programs over the virtual rows (the prefill shape is the reference part's on
both paths: :data:`attnpool.update.reference.local_extend_launch`).

The rules of :mod:`attnpool.update.triton`'s docstring hold.
"""

from __future__ import annotations

from torch import Tensor

from ...config import ceil_div, is_int
from ...errors import CapacityError, InputError
from ..buffers import PagedBuffers
from ..launch import Launch, part_pointers, pointer_or, replayable
from ..parts import LocalPart
from . import checks
from .loaders import kernels
from .tuning import MAX_BLOCK_P, MAXNREG, pow2, scan_block, warps

__all__ = ["local_launch"]


def local_launch(b: PagedBuffers, part: LocalPart) -> Launch:
    """Check and assemble the chunked-local-attention part (``bs * rows_per_request`` virtual rows).

    Same bytes in every read region as the reference local phase: ``reference.local_rows`` over
    ``seq_lens + extra`` with ``num_queries`` queries per request, pages gathered from each row's
    chunk start (rows past a request's last chunk: ``pad_len`` keys on ``pad_page``), and
    ``cu_seqlens_q`` where a padded request's first row takes ``num_queries`` queries so request
    ``i``'s queries start at row ``i * rows_per_request``. ``num_real`` as in
    :func:`paged_update_` (a count of requests; inputs padded to ``bs``); ``block_size`` as in
    :func:`paged_launch`.
    """
    bs, num_real, rows_per_request, chunk = part.bs, part.num_real, part.rows_per_request, part.chunk
    page_size, num_queries, pad_len = part.page_size, part.num_queries, part.pad_len
    dev = b.cache_seqlens.device
    checks.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    for name, x, lo in (("rows_per_request", rows_per_request, 1), ("chunk", chunk, 1),
                        ("page_size", page_size, 1), ("num_queries", num_queries, 0),
                        ("pad_len", pad_len, 0)):
        checks.need(is_int(x) and x >= lo, InputError, f"{name} must be an int >= {lo}, got {x}")
    if not isinstance(part.seq_lens, Tensor):
        raise InputError(f"seq_lens must be a torch.Tensor, got {type(part.seq_lens).__name__}")
    seq_lens = checks.vec("seq_lens", part.seq_lens,
                          bs if num_real is not None else part.seq_lens.shape[0], dev)
    n = seq_lens.shape[0]
    checks.real_count(num_real, n, bs, dev)
    req_pool_indices = checks.vec("req_pool_indices", part.req_pool_indices, n, dev)
    table = checks.table(part.req_to_token, dev)
    tok_cols, tp, block_table = checks.block(table, part.block_size)
    rows = bs * rows_per_request
    pad_pages = ceil_div(pad_len, page_size)
    has_pt, has_fi = checks.layouts(b, rows, dev, pad_pages)
    cu_seqlens_q = part.cu_seqlens_q
    checks.buf("cu_seqlens_q", cu_seqlens_q, rows + 1, dev)
    if b.page_table is not None:
        width, pt_stride = b.page_table.shape[1], b.page_table.stride(0)
    else:
        width, pt_stride = ceil_div(min(chunk, tok_cols), page_size), 0
    dummy = b.cache_seqlens
    args = {
        "seq_ptr": seq_lens, "rpi_ptr": req_pool_indices, "tok_ptr": table,
        "nreal_ptr": pointer_or(num_real, dummy), **part_pointers(b, dummy), "cuq_ptr": cu_seqlens_q,
        "n": n, "bs": bs, "per": rows_per_request, "extra": part.extra, "q": num_queries,
        "chunk": chunk, "pad_len": pad_len, "pad_page": part.pad_page, "P": page_size,
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

"""Host-side checks of the fused update wrappers.

Everything here reads tensor *metadata* only (shape, dtype, device, strides): no aten op, no
device sync, so a rejected call raises an attnpool error before anything is written, and an
accepted one costs nothing but the launch. The tensor checks are :mod:`attnpool.inputs`' (the
same messages as the phases and the pools); these wrappers only add what a pool buffer needs
(int32, a minimum row count, unit stride in its last dim).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import INT_DTYPES
from ...errors import CapacityError, InputError, LayoutError
from ...inputs import check_table, check_tensor
from ..buffers import PagedBuffers

INT = INT_DTYPES
I32 = (torch.int32,)


def need(ok: bool, err: type[Exception], msg: str) -> None:
    """Raise ``err(msg)`` unless ``ok``: for the scalar arguments no tensor check covers."""
    if not ok:
        raise err(msg)


def vec(name: str, t: object, rows: int, dev: torch.device, dtypes: tuple[torch.dtype, ...] = INT
         ) -> Tensor:
    """A 1-D tensor of ``rows`` elements on ``dev`` with unit stride (the kernels index it flat)."""
    return check_tensor(name, t, None, 1, dtypes, rows, dev)


def buf(name: str, t: Tensor, numel: int, dev: torch.device, ndim: int = 1, steps: int = 0
         ) -> None:
    """A pool buffer: int32 on ``dev``, ``ndim`` dims, unit stride in the last, at least ``numel``
    rows; with ``steps``, an extra leading dim of at least ``steps`` (one row per draft step)."""
    lead = 1 if steps else 0
    check_tensor(name, t, None, ndim + lead, I32, device=dev, contiguous=False)
    if steps and t.shape[0] < steps:
        raise CapacityError(f"{name} must have >= {steps} step rows, got shape {tuple(t.shape)}")
    if t.shape[lead] < numel:
        raise CapacityError(f"{name} must have >= {numel} rows for this batch, got shape "
                            f"{tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise InputError(f"{name} must have unit stride in its last dim, got strides {t.stride()}")


def table(t: object, dev: torch.device) -> Tensor:
    """The request table ``req_to_token`` (token slots or, with a ``block_size``, page ids): a
    non-empty 2-D int table with contiguous rows. No minimum width: the wrappers take no config."""
    return check_table("req_to_token", t, dev)


def block(table: Tensor, block_size: int | None) -> tuple[int, int, bool]:
    """A request table's kernel facts: (width in tokens, the table's page size ``TP``, whether it
    is a page-level block table). ``block_size`` None: a token-level ``req_to_token``."""
    if block_size is None:
        return table.shape[1], 1, False
    if type(block_size) is not int or block_size < 1:
        raise InputError(f"block_size must be an int >= 1 (or None), got {block_size!r}")
    return table.shape[1] * block_size, block_size, True


_CSR = ("kv_indptr", "kv_indices", "kv_last_page_len")


def layouts(b: PagedBuffers, rows: int, dev: torch.device, min_width: int, steps: int = 0
             ) -> tuple[bool, bool]:
    """Check the part's buffers for ``rows`` rows; return (has page table, has CSR).

    ``steps > 0``: lengths and cumsums are ``[steps, ...]`` (one row per step, stacked)."""
    buf("cache_seqlens", b.cache_seqlens, rows, dev, steps=steps)
    buf("cu_seqlens_k", b.cu_seqlens_k, rows + 1, dev, steps=steps)
    has_pt = b.page_table is not None
    if b.page_table is not None:
        buf("page_table", b.page_table, rows, dev, ndim=2)
        if b.page_table.shape[1] < min_width:
            raise CapacityError(f"page_table must have >= {min_width} columns, got shape "
                                f"{tuple(b.page_table.shape)}")
    csr = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    has_fi = all(t is not None for t in csr)
    if not has_fi and any(t is not None for t in csr):
        raise LayoutError("kv_indptr, kv_indices and kv_last_page_len must all be given or all "
                          f"be None, got {[n for n, t in zip(_CSR, csr, strict=True) if t is not None]}")
    if b.kv_indptr is not None and b.kv_indices is not None and b.kv_last_page_len is not None:
        buf("kv_indptr", b.kv_indptr, rows + 1, dev, steps=steps)
        buf("kv_indices", b.kv_indices, 1, dev, steps=steps)
        buf("kv_last_page_len", b.kv_last_page_len, rows, dev, steps=steps)
    return has_pt, has_fi


def real_count(num_real: Tensor | None, n: int, bs: int, dev: torch.device) -> None:
    if num_real is None:
        if n > bs:
            raise CapacityError(f"real rows n must be <= bs={bs}, got n={n}")
    else:
        vec("num_real", num_real, 1, dev)

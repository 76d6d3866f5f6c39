"""Host-side checks and launch parameters shared by the fused update wrappers.

Everything here reads tensor *metadata* only (shape, dtype, device, strides): no aten op, no
device sync, so a rejected call raises an attnpool error before anything is written, and an
accepted one costs nothing but the launch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..errors import CapacityError, InputError, LayoutError
from .reference import PagedBuffers

INT = (torch.int32, torch.int64)
INT32_MAX = 2**31 - 1
MAX_BLOCK_P = 1024  # page columns per loop step of a row (a row loops over its own live pages)
BLOCK_T = 256  # query tokens per loop step of an extend row's position / slot writes


def kernels() -> ModuleType:
    """The jit kernels; imported on first use so importing attnpool never imports triton."""
    from . import triton_kernels

    return triton_kernels


def pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, x - 1).bit_length())


def warps(rows: int) -> int:
    """Warps per program: enough threads for the ``rows``-lane scan every program runs."""
    return 4 if rows <= 2048 else 8 if rows <= 8192 else 16


def need(ok: bool, err: type[Exception], msg: str) -> None:
    if not ok:
        raise err(msg)


def vec(name: str, t: object, rows: int, dev: torch.device, dtypes: tuple[torch.dtype, ...] = INT
         ) -> Tensor:
    """A 1-D tensor of ``rows`` elements on ``dev`` with unit stride (the kernels index it flat)."""
    if not isinstance(t, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    need(t.dim() == 1 and t.shape[0] == rows, InputError,
          f"{name} must have shape [{rows}], got {tuple(t.shape)}")
    need(t.dtype in dtypes, InputError,
          f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    need(t.device == dev, InputError, f"{name} must be on {dev}, got {t.device}")
    need(rows <= 1 or t.stride(0) == 1, InputError,
          f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")
    return t


def buf(name: str, t: Tensor, numel: int, dev: torch.device, ndim: int = 1, steps: int = 0
         ) -> None:
    """A pool buffer: int32 on ``dev``, ``ndim`` dims, unit stride in the last, at least ``numel``
    rows; with ``steps``, an extra leading dim of at least ``steps`` (one row per draft step)."""
    if not isinstance(t, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    need(t.dtype == torch.int32, InputError, f"{name} must be int32, got {t.dtype}")
    need(t.device == dev, InputError, f"{name} must be on {dev}, got {t.device}")
    lead = 1 if steps else 0
    need(t.dim() == ndim + lead, InputError,
          f"{name} must have {ndim + lead} dim(s), got shape {tuple(t.shape)}")
    need(not steps or t.shape[0] >= steps, CapacityError,
          f"{name} must have >= {steps} step rows, got shape {tuple(t.shape)}")
    need(t.shape[lead] >= numel, CapacityError,
          f"{name} must have >= {numel} rows for this batch, got shape {tuple(t.shape)}")
    need(t.stride(-1) == 1, InputError, f"{name} must have unit stride in its last dim")


def table(t: object, dev: torch.device) -> Tensor:
    if not isinstance(t, Tensor):
        raise InputError(f"req_to_token must be a torch.Tensor, got {type(t).__name__}")
    need(t.dim() == 2 and t.shape[0] >= 1 and t.shape[1] >= 1, InputError,
          f"req_to_token must be a non-empty 2-D table, got shape {tuple(t.shape)}")
    need(t.dtype in INT, InputError, f"req_to_token must be int32/int64, got {t.dtype}")
    need(t.device == dev, InputError, f"req_to_token must be on {dev}, got {t.device}")
    need(t.stride(1) == 1, InputError,
          f"req_to_token rows must be contiguous (stride(1)=1), got {t.stride()}")
    return t


def block(table: Tensor, block_size: int | None) -> tuple[int, int, bool]:
    """A request table's kernel facts: (width in tokens, the table's page size ``TP``, whether it
    is a page-level block table). ``block_size`` None: a token-level ``req_to_token``."""
    if block_size is None:
        return table.shape[1], 1, False
    need(type(block_size) is int and block_size >= 1, InputError,
         f"block_size must be an int >= 1 (or None), got {block_size!r}")
    return table.shape[1] * block_size, block_size, True


def layouts(b: PagedBuffers, rows: int, dev: torch.device, min_width: int, steps: int = 0
             ) -> tuple[bool, bool]:
    """Check the part's buffers for ``rows`` rows; return (has page table, has CSR).

    ``steps > 0``: lengths and cumsums are ``[steps, ...]`` (one row per step, stacked)."""
    buf("cache_seqlens", b.cache_seqlens, rows, dev, steps=steps)
    buf("cu_seqlens_k", b.cu_seqlens_k, rows + 1, dev, steps=steps)
    has_pt = b.page_table is not None
    if b.page_table is not None:
        buf("page_table", b.page_table, rows, dev, ndim=2)
        need(b.page_table.shape[1] >= min_width, CapacityError,
              f"page_table must have >= {min_width} columns, got {tuple(b.page_table.shape)}")
    csr = (b.kv_indptr, b.kv_indices, b.kv_last_page_len)
    has_fi = all(t is not None for t in csr)
    need(has_fi or all(t is None for t in csr), LayoutError,
          "kv_indptr, kv_indices and kv_last_page_len must all be given or all be None")
    if b.kv_indptr is not None and b.kv_indices is not None and b.kv_last_page_len is not None:
        buf("kv_indptr", b.kv_indptr, rows + 1, dev, steps=steps)
        buf("kv_indices", b.kv_indices, 1, dev, steps=steps)
        buf("kv_last_page_len", b.kv_last_page_len, rows, dev, steps=steps)
    return has_pt, has_fi


def real_count(num_real: Tensor | None, n: int, bs: int, dev: torch.device) -> None:
    if num_real is None:
        need(n <= bs, CapacityError, f"real rows n must be <= bs={bs}, got n={n}")
    else:
        vec("num_real", num_real, 1, dev)


class Launch:
    """One kernel launch with every argument resolved, replayable with new inputs.

    The wrappers check everything and assemble the ~20-45 arguments of a launch once; a phase
    keeps the result per batch shape and replays it, so its hot path is its own one-pass input
    check plus :meth:`__call__`. ``dyn`` maps the inputs a replay may change (the real row count
    ``n`` and the caller's tensors that were given, by the wrapper's parameter names) to their
    argument positions; :meth:`take` says where in the phase's value tuple each one is.
    """

    __slots__ = ("args", "dyn", "fn", "kw", "map")

    def __init__(self, kernel: Any, grid: tuple[int, ...], args: tuple[object, ...],
                 kw: dict[str, Any], dyn: dict[str, int]) -> None:
        self.fn: Callable[..., object] = kernel[grid]
        # Constexprs go positionally, in the kernel's parameter order: expanding a dozen
        # keywords at every launch costs about as much as the rest of the replay. Only launch
        # options (num_warps) stay keywords.
        names = getattr(kernel, "arg_names", None) or ()
        pos, rest = list(args), dict(kw)
        for name in names[len(pos):]:
            if name not in rest:
                break
            pos.append(rest.pop(name))
        self.args, self.kw, self.dyn = tuple(pos), rest, dyn
        self.map: tuple[tuple[int, int], ...] = ()

    def take(self, names: tuple[str, ...], **alias: str) -> Launch:
        """Read the replayed inputs from value tuples laid out as ``names`` (``alias``: wrapper
        parameter -> the name it has there, e.g. ``seq_lens="encoder_lens"``). After this the
        launch must be called with values (the built-in inputs are released)."""
        self.map = tuple((p, names.index(alias.get(k, k))) for k, p in self.dyn.items())
        # Every replay supplies these: drop the binding call's tensors, so a cached launch never
        # keeps a caller's (possibly large, since replaced) table alive.
        a = list(self.args)
        for p, _ in self.map:
            a[p] = None
        self.args = tuple(a)
        return self

    def __call__(self, vals: tuple[object, ...] | None = None) -> None:
        """Launch, with the inputs of :meth:`take` read from ``vals`` (None: as built)."""
        if vals is None:
            self.fn(*self.args, **self.kw)
            return
        a = list(self.args)
        for p, i in self.map:
            a[p] = vals[i]
        self.fn(*a, **self.kw)

    def bound(self, vals: tuple[object, ...]) -> Callable[[], object]:
        """The launch with ``vals`` fixed: a no-argument callable (a bound update's replay)."""
        a = list(self.args)
        for p, i in self.map:
            a[p] = vals[i]
        return partial(self.fn, *a, **self.kw)


def dyn(**given: tuple[int, object]) -> dict[str, int]:
    """``name -> position`` of the replayable inputs that were given (``(position, value)``
    pairs; absent optional inputs stay the dummies the launch was built with)."""
    return {k: p for k, (p, v) in given.items() if v is not None}

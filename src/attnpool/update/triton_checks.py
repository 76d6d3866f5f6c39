"""Host-side checks and launch parameters shared by the fused update wrappers.

Everything here reads tensor *metadata* only (shape, dtype, device, strides): no aten op, no
device sync, so a rejected call raises an attnpool error before anything is written, and an
accepted one costs nothing but the launch. The tensor checks are :mod:`attnpool.inputs`' (the
same messages as the phases and the pools); these wrappers only add what a pool buffer needs
(int32, a minimum row count, unit stride in its last dim).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..config import INT_DTYPES, is_int
from ..errors import CapacityError, InputError, LayoutError
from ..inputs import check_table, check_tensor
from .reference import PagedBuffers
from .reference_ops import window_width

INT = INT_DTYPES
I32 = (torch.int32,)
INT32_MAX = 2**31 - 1
MAX_BLOCK_P = 1024  # page columns per loop step of a row (a row loops over its own live pages)
#: rows per step of a program's prefix sums over the batch (the sums loop over the batch in
#: chunks of this many rows, so a program's registers do not grow with the batch)
MAX_BLOCK = 1024
BLOCK_T = 256  # query tokens per loop step of an extend row's position / slot writes

#: A launch recorder, normally None. When set (only by :mod:`attnpool.tools.kernels`, which
#: enumerates every kernel specialization the pools can launch, to compile each one for a GPU
#: target), it is called as ``RECORD(kernel, grid, args, kw)`` for every launch a wrapper
#: assembles, after the constexprs are made positional, and for every KV store launch;
#: returning True makes the launch a no-op (the enumerator needs the arguments, not the bytes).
#: Read once per *assembled* launch, never per replay, so it costs nothing on the hot path.
RECORD: Callable[[Any, tuple[int, ...], tuple[object, ...], dict[str, Any]], bool] | None = None


def kernels() -> ModuleType:
    """The jit kernels; imported on first use so importing attnpool never imports triton."""
    from . import triton_kernels

    return triton_kernels


def paged_kernels() -> ModuleType:
    """The paged-part kernel's module (imported on first use, like :func:`kernels`)."""
    from . import triton_paged_kernels

    return triton_paged_kernels


def pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, x - 1).bit_length())


#: ``maxnreg`` of every update launch: the architecture's limit, so it caps nothing. Without a
#: ``.maxnreg`` in the PTX, ptxas at the register-allocation level Triton 3.9 always asks for
#: (``--regAllocOptLevel=2``) keeps some specializations at a low register count (32 or 40)
#: and spills a few bytes to stay there; with one it compiles them spill-free (the module
#: docstring of :mod:`.triton_kernels`).
MAXNREG = 255
#: 32-bit registers one thread block may use on sm_80 and sm_90 (the register file of an SM)
REGISTERS_PER_BLOCK = 65536


def maxnreg(num_warps: int) -> int:
    """The ``maxnreg`` of a launch of ``num_warps`` warps: :data:`MAXNREG`, lowered so that
    the whole block fits the register file. ptxas honours an explicit ``.maxnreg`` over the
    block size, so a 16-warp program given 255 may compile to more registers than a block of
    512 threads can hold and then fail to launch (at 128 it compiles to fit)."""
    return min(MAXNREG, REGISTERS_PER_BLOCK // (32 * num_warps))


def scan_block(rows: int) -> int:
    """``BLOCK``: the rows a program's prefix sums take per loop step, for a ``rows``-row part
    (the whole part up to :data:`MAX_BLOCK` rows, one step)."""
    return min(MAX_BLOCK, pow2(rows))


def warps(rows: int) -> int:
    """Warps per program: the ``scan_block(rows)`` lanes of one scan step, a few per thread.
    One count for every size: the scan's registers do not grow past :data:`MAX_BLOCK` rows."""
    return 4


def tile_rows(block_n: int) -> int:
    """Mask rows the verify tree expand kernel handles at a time: all of them up to 32 x 32,
    else as many as keep a tile at 2048 entries (its registers then stay flat as ``N`` grows)."""
    return block_n if block_n <= 32 else max(1, 2048 // block_n)


@cache
def tree_tile(block_n: int) -> dict[str, int]:
    """The verify tree expand kernel's size-dependent launch keywords for ``BLOCK_N``
    (``BLOCK_R``, ``BLOCK_J``, ``num_warps``, ``maxnreg``): constants of the tree size, built once
    per size rather than on every update (callers copy them into their own keyword dict)."""
    w = tile_warps(block_n)
    return {"BLOCK_R": max(1, 4096 // block_n), "BLOCK_J": tile_rows(block_n), "num_warps": w,
            "maxnreg": maxnreg(w)}


def tile_warps(block_n: int) -> int:
    """Warps of the verify tree expand kernel, whose program holds a ``tile_rows x block_n``
    tile of its request's mask (and its column positions) in registers: 4 up to 32 x 32, 8 for
    the 2048-entry tiles of larger trees (64 x 64 whole on sm_90 took 186 registers with 4
    warps, near the limit of 255)."""
    return 4 if block_n <= 32 else 8


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


def _skip(*args: object, **kw: object) -> None:
    """A recorded launch that the recorder asked not to run."""


class Launch:
    """One kernel launch with every argument resolved, replayable with new inputs.

    The wrappers check everything and assemble the ~20-45 arguments of a launch once; a phase
    keeps the result per batch shape and replays it, so its hot path is its own one-pass input
    check plus :meth:`__call__`. ``dyn`` maps the inputs a replay may change (the real row count
    ``n`` and the caller's tensors that were given, by the wrapper's parameter names) to their
    argument positions; :meth:`take` says where in the phase's value tuple each one is. An
    input passed at two positions has a second key ``name@where`` (the paged kernel's window
    part reading the part's own table).
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
        if RECORD is not None and RECORD(kernel, grid, self.args, rest):
            self.fn = _skip

    def take(self, names: tuple[str, ...], **alias: str) -> Launch:
        """Read the replayed inputs from value tuples laid out as ``names`` (``alias``: wrapper
        parameter -> the name it has there, e.g. ``seq_lens="encoder_lens"``). After this the
        launch must be called with values (the built-in inputs are released)."""
        base = {k: k.partition("@")[0] for k in self.dyn}
        self.map = tuple((p, names.index(alias.get(base[k], base[k])))
                         for k, p in self.dyn.items())
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


def window_args(
    w: PagedBuffers | None, *, table: Tensor, block_size: int | None, window_size: int | None,
    window_table: Tensor | None, window_out_slots: Tensor | None, bs: int, dev: torch.device,
    has_layouts: tuple[bool, bool], pad_pages: int, steps: int, page_size: int, extra: int,
    tokens: bool, dummy: Tensor,
) -> tuple[tuple[object, ...], Tensor | None, bool]:
    """The paged kernel's ``w_*`` arguments for a window part ``w`` (None: no window part, and
    every window argument must be None too): ``(args, window table or None, W_TOKENS)``.

    The window table defaults to the part's own table; a separate one (an engine's
    sliding-window KV group) must be of the same kind and dtype (the kernel reads both through
    one code path) and wide enough for any row: positions up to the part's ``max_len``.
    """
    if w is None:
        if window_size is not None or window_table is not None or window_out_slots is not None:
            raise LayoutError("window_size, window_table and window_out_slots need a window part "
                              "(window buffers), got no window part")
        return (dummy, dummy, *(dummy,) * 6, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0), None, False
    need(is_int(window_size) and window_size >= 1, InputError,
         f"window_size must be an int >= 1, got {window_size!r}")
    wt = table if window_table is None else check_table("window_table", window_table, dev)
    if wt.dtype != table.dtype:
        raise InputError(f"the window table must have the request table's dtype {table.dtype}, "
                         f"got {wt.dtype}")
    w_cols, _, _ = block(wt, block_size)  # (columns are clamped into it, as the part's own)
    lay = layouts(w, bs, dev, pad_pages, steps if steps > 1 else 0)
    if lay != has_layouts:
        raise LayoutError(f"the window part must keep the part's layouts (page table, CSR) = "
                          f"{has_layouts}, got {lay}")
    wslot_cap = 0
    if window_out_slots is not None:
        need(tokens, InputError, "window_out_slots needs the part's token buffers (extend)")
        need(isinstance(window_out_slots, Tensor), InputError,
             f"window_out_slots must be a torch.Tensor, got {type(window_out_slots).__name__}")
        wslot_cap = window_out_slots.shape[0]
        vec("window_out_slots", window_out_slots, wslot_cap, dev)
    cap = window_width(w)
    pt_stride = w.page_table.stride(0) if w.page_table is not None else 0
    args = (
        wt, window_out_slots if window_out_slots is not None else dummy,
        w.cache_seqlens, w.cu_seqlens_k,
        *(t if t is not None else dummy
          for t in (w.page_table, w.kv_indptr, w.kv_indices, w.kv_last_page_len)),
        window_size, max(extra, 1), max(cap * page_size - (steps - 1), 0),
        wt.shape[0], w_cols, wt.stride(0), pt_stride, cap,
        w.kv_indices.shape[0] if w.kv_indices is not None else 0, wslot_cap,
        w.cache_seqlens.stride(0) if steps > 1 else 0,
        w.cu_seqlens_k.stride(0) if steps > 1 else 0,
    )
    return args, wt, window_out_slots is not None

"""The one place that checks caller tensors: used by the phases, the KV and LoRA pools and the
fused update wrappers, so a bad argument gets the same message whichever entry point it reaches.

It sits low in the layering (it imports only ``config`` and ``errors``) so every module above may
use it: ``update/`` sits below ``phases/``, and ``kv/`` above the pool, and neither may import a
phase's helpers. The rules every check here keeps:

- no device sync: only tensor metadata is read (shape, dtype, device, strides), never values;
- raise before any write: callers check every input first, so a rejected call changes nothing;
- messages name the expected and the actual value, and are built only when a check fails (the
  accepted case is one expression of attribute reads).

What cannot be checked without reading device memory (values of ``seq_lens``,
``req_pool_indices``) is checked from ``seq_lens_cpu`` when the caller passes it, and otherwise
documented as the caller's contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

import torch
from torch import Tensor

from .config import INT_DTYPES, PoolConfig, is_int
from .errors import CapacityError, InputError


def check_bs(cfg: PoolConfig, bs: int, n: int | None = None) -> None:
    """``1 <= bs <= max_bs`` and ``0 <= n <= bs``."""
    if type(bs) is int and 1 <= bs <= cfg.max_bs and (n is None or n <= bs):
        return
    if not is_int(bs):
        raise InputError(f"bs must be an int, got {type(bs).__name__}")
    if not 1 <= bs <= cfg.max_bs:
        raise CapacityError(f"bs must be in [1, max_bs={cfg.max_bs}], got {bs}")
    if n is not None and n > bs:
        raise CapacityError(f"real rows n must be <= bs={bs}, got n={n}")


def check_count(bs: object, hi: int, bound: str) -> int:
    """``bs`` a real int in ``[1, hi]`` (``bound`` names ``hi`` in the message), else a
    CapacityError: the batch-size check of pools sized by one bound (KV tokens, LoRA rows)."""
    if is_int(bs) and 1 <= bs <= hi:
        return bs
    raise CapacityError(f"bs must be an int in [1, {bound}={hi}], got {bs!r}")


#: an address range no tensor lies in: the default of the ``outside`` checks below
NOWHERE = (0, 0)


def check_tensor(
    name: str,
    t: object,
    cfg: PoolConfig | None,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] = INT_DTYPES,
    rows: int | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
    outside: tuple[int, int] = NOWHERE,
) -> Tensor:
    """A tensor of ``ndim`` dims, one of ``dtypes``, on the pool's device (or ``device``), whose
    data does not start inside ``outside``'s address range (a pool's own storage: see
    :func:`not_inside`).

    The hot path is one expression of attribute reads; the per-check messages below are only
    reached (and formatted) when it fails, or for a device spelled without its index."""
    if device is None:
        if cfg is None:
            raise TypeError("check_tensor needs a config or a device")
        device = cfg.torch_device
    want = device
    lo, hi = outside
    # (a 1-D tensor is contiguous iff its stride is 1 or it has at most one element; a tensor
    # without strided storage, a sparse one, raises in data_ptr(): the checks below name it)
    try:
        if (type(t) is Tensor and t.dim() == ndim and t.dtype in dtypes and t.device == want
                and (rows is None or t.shape[0] == rows)
                and (not contiguous or ndim != 1 or t.is_contiguous())
                and not lo <= t.data_ptr() < hi):
            return t
    except RuntimeError:
        pass
    if not isinstance(t, Tensor):
        raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise InputError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.dim() != ndim:
        raise InputError(f"{name} must have {ndim} dim(s), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise InputError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
        raise InputError(f"{name} must be on {want}, got {t.device}")
    if rows is not None and t.shape[0] != rows:
        raise InputError(f"{name} must have {rows} rows, got {t.shape[0]}")
    if contiguous and ndim == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        # Kernels index per-row vectors flat; a strided one would need a copy (an allocation).
        raise InputError(f"{name} must be contiguous (stride 1), got stride {t.stride(0)}")
    return not_inside(name, t, outside)


def check_shaped(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
                 device: torch.device, outside: tuple[int, int] = NOWHERE
                 ) -> tuple[Tensor, tuple[int, ...]]:
    """:func:`check_tensor` for an input whose every dimension is known (a tree mask ``[n, N,
    N]``, draft slots ``[n, S, K]``), also returning its strides as the check read them (a
    launch key holds them: the kernel indexes the input with them). One shape compare instead of
    a read per dimension: the accepted case is one expression, as in :func:`check_tensor`."""
    lo, hi = outside
    try:  # (a sparse tensor raises in data_ptr(): check_tensor names it)
        if (type(t) is Tensor and t.shape == shape and t.dtype in dtypes and t.device == device
                and not lo <= t.data_ptr() < hi):
            return t, t.stride()
    except RuntimeError:
        pass
    t = check_tensor(name, t, None, len(shape), dtypes, shape[0], device, False, outside)
    if t.shape != shape:
        raise InputError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    return t, t.stride()


def not_inside(name: str, t: Tensor, outside: tuple[int, int]) -> Tensor:
    """Refuse an input whose data starts inside ``outside``, a pool's own storage (e.g. a view's
    ``cache_seqlens`` passed back as ``seq_lens``). Overlaid phases share those bytes, and the
    fused path reads inputs while it writes the arena, so such an input could be overwritten
    half-way through its own update. One pointer compare; copy the tensor first instead."""
    lo, hi = outside
    if lo <= t.data_ptr() < hi:
        raise InputError(f"{name} must not alias the pool's own buffers (copy it first), got a "
                         f"tensor at arena offset {t.data_ptr() - lo}")
    return t


def check_table(name: str, t: object, device: torch.device, cols: int = 1, what: str = "",
                cfg: PoolConfig | None = None, outside: tuple[int, int] = NOWHERE) -> Tensor:
    """A request table ``[>= 1, >= cols]`` of ints on ``device``, rows contiguous (kernels index
    it row-major), not inside ``outside`` (:func:`not_inside`). Needs no config: ``what`` names
    the bound ``cols`` comes from in the message, and ``cfg``, when given, adds the sizes it was
    derived from."""
    return check_table_layout(name, t, device, cols, what, cfg, outside)[0]


def check_table_layout(name: str, t: object, device: torch.device, cols: int = 1,
                       what: str = "", cfg: PoolConfig | None = None,
                       outside: tuple[int, int] = NOWHERE
                       ) -> tuple[Tensor, torch.Size, tuple[int, ...]]:
    """:func:`check_table`, also returning the table's shape and strides as the check read them:
    an update's launch key is made of them, and each read is a call into torch as costly as a
    small check. The accepted case is one expression of attribute reads."""
    lo, hi = outside
    if (type(t) is Tensor and t.dim() == 2 and t.dtype in INT_DTYPES and t.device == device
            and (shape := t.shape)[0] >= 1 and shape[1] >= cols
            and (strides := t.stride())[1] == 1 and not lo <= t.data_ptr() < hi):
        return t, shape, strides
    t = _table(name, t, device, cols, what, cfg, outside)
    return t, t.shape, t.stride()


def _table(name: str, t: object, device: torch.device, cols: int, what: str,
           cfg: PoolConfig | None, outside: tuple[int, int]) -> Tensor:
    """The table checks one by one: each failure's message (or the table, for a device spelled
    without its index)."""
    t = check_tensor(name, t, None, 2, device=device)
    if t.shape[0] < 1:
        raise InputError(f"{name} must have >= 1 row, got shape {tuple(t.shape)}")
    if t.shape[1] < cols:
        bound = f"{what}={cols}" if what else str(cols)
        src = ("" if cfg is None else
               f" (max_context_len={cfg.max_context_len}, page_size={cfg.page_size})")
        raise InputError(f"{name} must have >= {bound} columns{src}, got {t.shape[1]}")
    if t.stride(1) != 1:
        raise InputError(f"{name} rows must be contiguous (stride(1)=1), got {t.stride()}")
    return not_inside(name, t, outside)


def check_req_to_token(t: object, cfg: PoolConfig, device: torch.device | None = None,
                       name: str = "req_to_token", outside: tuple[int, int] = NOWHERE) -> Tensor:
    """``[num_req_slots, >= max_context_len]`` int token slots (:func:`check_table`)."""
    return check_table(name, t, cfg.torch_device if device is None else device,
                       cfg.max_context_len, "max_context_len", cfg, outside)


def check_block_table(t: object, cfg: PoolConfig, device: torch.device | None = None,
                      name: str = "block_table", outside: tuple[int, int] = NOWHERE) -> Tensor:
    """``[num_rows, >= max_pages]`` int page ids (:func:`check_table`)."""
    return check_table(name, t, cfg.torch_device if device is None else device,
                       cfg.max_pages, "max_pages", cfg, outside)


def host_lens(
    name: str, v: Tensor | Sequence[int] | None, n: int, lo: int, hi: int
) -> list[int] | None:
    """Validate host lengths: ``n`` values in ``[lo, hi]``. A CUDA tensor is refused: it would sync."""
    if v is None:
        return None
    if isinstance(v, Tensor):
        if v.device.type != "cpu":
            raise InputError(f"{name} must be on the CPU (it is read on the host), got {v.device}")
        if v.dim() != 1:
            raise InputError(f"{name} must be 1-D, got shape {tuple(v.shape)}")
        if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise InputError(f"{name} must hold integers, got dtype {v.dtype}")
        vals = v.tolist()  # ints by the dtype check: no per-element check needed
    elif type(v) is list and all(type(x) is int for x in v):
        vals = v  # the common case, checked in one pass (read only, never stored)
    else:
        try:
            vals = list(v)
        except TypeError as e:
            raise InputError(f"{name} must be a sequence of ints, got {type(v).__name__}") from e
        # ints only: a float would be truncated silently, a bool is not a length
        for i, x in enumerate(vals):
            if isinstance(x, bool) or not isinstance(x, Integral):
                raise InputError(f"{name} must hold ints, got {name}[{i}] = {x!r} "
                                 f"({type(x).__name__})")
        vals = [int(x) for x in vals]
    if len(vals) != n:
        raise InputError(f"{name} must have n={n} values (one per real row), got {len(vals)}")
    if vals and not (lo <= min(vals) and max(vals) <= hi):
        i = next(i for i, x in enumerate(vals) if not lo <= x <= hi)
        raise CapacityError(f"{name}[{i}] must be in [{lo}, {hi}], got {vals[i]}")
    return vals

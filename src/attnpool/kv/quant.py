"""fp8 KV cache arithmetic: the quantizing store's reference, the dequantizing read, scale checks.

Semantics (those of vLLM's ``reshape_and_cache_flash``, so a cache written here reads the same in
an engine's kernels): the stored value of ``x`` is ``x / scale`` computed in float32, saturated to
the finite range of the fp8 type (``float8_e4m3fn``: +-448, ``float8_e5m2``: +-57344) and rounded
to nearest even. Saturation matters: e4m3fn has no infinity, so an unsaturated cast of an outlier
would store NaN, and e5m2 would store inf; either poisons every attention row that reads it. A NaN
input stays NaN (with its sign), as torch's own cast keeps it. Reading multiplies back:
``x ~= stored * scale``.

Scales are float32 tensors on the cache's device with one element (per tensor) or ``num_kv_heads``
elements (per KV head). They are device tensors, not Python floats, so an engine can capture the
store in a CUDA graph and still change the scales between replays (calibration, per-layer values
loaded after capture).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError

#: The fp8 cache dtypes and, per dtype, ``(finite max, mantissa bits, min normal exponent)``.
FP8: dict[torch.dtype, tuple[float, int, int]] = {
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}
#: Source dtypes a quantizing store accepts (model dtypes).
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8


def quantize(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``x [n, H, d]`` (any float dtype) to fp8: ``clamp(x.float() / scale, -max, max).to(dtype)``.

    ``scale`` has 1 or ``H`` elements (broadcast over the head dim). torch's float32 -> fp8 cast
    rounds to nearest even; the clamp runs first so the cast never sees a value past the range
    (``clamp`` propagates NaN, so NaN inputs stay NaN).
    """
    fmax = FP8[dtype][0]
    return (x.float() / scale.reshape(-1, 1)).clamp_(-fmax, fmax).to(dtype)


def dequantize(x: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """fp8 rows ``[..., H, d]`` times ``scale`` (1 or ``H`` elements), computed in float32, then cast
    to ``dtype``: the values the quantizing store approximated."""
    return (x.float() * scale.float().reshape(-1, 1)).to(dtype)


def check_scales(cache_dtype: torch.dtype, heads: int, device: torch.device,
                 scales: tuple[tuple[str, object], ...], check_values: bool
                 ) -> tuple[Tensor, ...] | None:
    """Validate the named scales of one call; return them flattened (fp8 cache) or ``None``.

    Shape, dtype and device are checked always (metadata, no sync). Values (``> 0`` and finite) need
    a host read: one copy of all the call's scales together, done when ``check_values`` is set and
    never while the current CUDA stream is capturing a graph (a host read is illegal there, so a
    captured store trusts its scales; check them once with an eager call before capture).
    """
    if not is_fp8(cache_dtype):
        given = [n for n, s in scales if s is not None]
        if given:
            raise InputError(f"{given[0]} must be None: scales are only for fp8 caches, this cache "
                             f"is {cache_dtype}")
        return None
    out: list[Tensor] = []
    for name, s in scales:
        if s is None:
            raise InputError(f"{name} is required for an fp8 cache ({cache_dtype}): a float32 tensor "
                             f"of 1 or num_kv_heads={heads} elements")
        if not isinstance(s, Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
        if s.dtype != torch.float32 or s.device != device or s.numel() not in (1, heads):
            raise InputError(f"{name} must be a float32 tensor on {device} with 1 or {heads} "
                             f"elements, got {s.dtype} on {s.device} with {s.numel()}")
        out.append(s.reshape(-1))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing:
        vals = torch.cat(out).cpu()  # the one host read
        bad = ~(vals > 0) | torch.isinf(vals)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            for (name, _), s in zip(scales, out, strict=True):
                if i < s.numel():
                    raise InputError(f"{name} must be finite and > 0, got {s.tolist()}")
                i -= s.numel()
    return tuple(out)


def store_reference_(pairs: tuple[tuple[Tensor, Tensor], ...], slots: Tensor, page_size: int,
                     num_slots: int, scales: tuple[Tensor, ...] | None = None) -> None:
    """Vectorised torch store: ``dst[page, off] = src`` for each ``(src [n, H, d], dst)`` pair,
    quantized with the pair's scale when ``scales`` is given (an fp8 cache).

    ``dst`` is a layer part in NHD order ``[num_pages + 1, P, H, >= d]`` (a transposed view for
    HND). Slots outside ``[0, num_slots)`` are redirected to the scratch page ``num_pages`` with
    ``torch.where``: no boolean-mask indexing, so no host sync and a fixed shape (graph-safe).
    """
    s = slots.to(torch.int64)
    skip = (s < 0) | (s >= num_slots)
    page = torch.where(skip, num_slots // page_size, torch.div(s, page_size, rounding_mode="floor"))
    off = torch.where(skip, 0, torch.remainder(s, page_size))
    for i, (src, dst) in enumerate(pairs):
        val = src if scales is None else quantize(src, scales[i], dst.dtype)
        dst.index_put_((page, off), val)

"""Fused KV store: one Triton launch writes every new token's rows into a paged KV cache.

Imported lazily by :mod:`attnpool.kv` (never at ``import attnpool``). One program per token: it
loads the token's slot, and when the slot lies in ``[0, num_slots)`` it copies the token's rows of
two sources into the cache page ``slot // page_size`` at offset ``slot % page_size``; other slots
(``-1`` padding, or a caller bug past the cache) write nothing. The two sources are K and V for MHA,
or the latent and rope parts of one MLA row (the second written at a column offset).

The destination strides are passed in NHD order (page, offset in page, head), so the same kernel
serves NHD and HND caches; the last dimension of every tensor must have stride 1. Each destination
has its own strides: K and V of different head sizes (``KVCacheConfig(head_dim_v=)``) have rows,
pages and heads of different widths, and one launch still writes both. Offsets are
computed in int64: a cache of many GiB overflows int32 element offsets.

fp8 caches (``QUANT``): each element becomes ``x / scale`` (float32, correctly rounded division),
clamped to the finite fp8 range, like the torch reference in :mod:`attnpool.kv.quant`. The rounding
to the fp8 grid is done here in float32 arithmetic, not left to the float32 -> fp8 cast, because
casts differ between backends (the Triton interpreter flushes fp8 subnormals and turns NaN into a
finite byte): adding and subtracting ``2^(e + 23 - mbits)``, with ``e`` the value's exponent floored
at the format's smallest normal exponent, rounds to nearest even at exactly the fp8 quantum, so
the cast then only sees representable values. NaN is written as the canonical fp8 NaN byte
``0x7F`` with the input's sign, which is what torch's cast stores. The kernel stores bytes through
a uint8 view of the cache.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..update.launch import record_launch


@triton.jit  # type: ignore[untyped-decorator,misc]
def _store_kernel(  # type: ignore[no-untyped-def]
    slot_ptr, slot_stride,
    src1, src1_tok, src1_head, dst1,
    src2, src2_tok, src2_head, dst2,
    page_stride, off_stride, head_stride,
    page_stride2, off_stride2, head_stride2,
    num_slots, num_heads, dim1, dim2,
    scale1, scale1_head, scale2, scale2_head,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr = False,
    FP8_MAX: tl.constexpr = 0.0,
    MBITS: tl.constexpr = 0,
    EMIN: tl.constexpr = 0,
    FP8: tl.constexpr = None,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t * slot_stride).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # The slot test is broadcast to the tile: a scalar mask is not accepted everywhere.
    s = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot
    ok = (s >= 0) & (s < num_slots) & (h < num_heads)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    base = page * page_stride + off * off_stride + h.to(tl.int64) * head_stride + d
    base2 = page * page_stride2 + off * off_stride2 + h.to(tl.int64) * head_stride2 + d
    m1 = ok & (d < dim1)
    x1 = tl.load(src1 + t * src1_tok + h * src1_head + d, mask=m1)
    m2 = ok & (d < dim2)
    x2 = tl.load(src2 + t * src2_tok + h * src2_head + d, mask=m2)
    if QUANT:
        hm = h < num_heads
        s1 = tl.load(scale1 + h * scale1_head, mask=hm, other=1.0)
        s2 = tl.load(scale2 + h * scale2_head, mask=hm, other=1.0)
        x1 = _fp8_bytes(x1, s1, FP8_MAX, MBITS, EMIN, FP8)
        x2 = _fp8_bytes(x2, s2, FP8_MAX, MBITS, EMIN, FP8)
    tl.store(dst1 + base, x1, mask=m1)
    tl.store(dst2 + base2, x2, mask=m2)


@triton.jit  # type: ignore[untyped-decorator,misc]
def _fp8_bytes(x, scale, FP8_MAX: tl.constexpr, MBITS: tl.constexpr,  # type: ignore[no-untyped-def]
               EMIN: tl.constexpr, FP8: tl.constexpr):
    """The fp8 byte of ``clamp(x / scale, +-FP8_MAX)`` rounded to nearest even (see the module)."""
    q = tl.math.div_rn(x.to(tl.float32), scale)
    c = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    bits = c.to(tl.int32, bitcast=True)
    sign = bits & -2147483648
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, EMIN + 127)
    big = ((e + 23 - MBITS) << 23).to(tl.float32, bitcast=True)
    rb = ((mag + big) - big).to(tl.int32, bitcast=True)  # |value| on the fp8 grid
    # the fp8 bits, assembled in integers: no hardware fp8 cast (sm_80 has no e4m3 one)
    unb = (rb >> 23) - 127
    man = rb & 0x7FFFFF
    normal = ((unb + (1 - EMIN)) << MBITS) | (man >> (23 - MBITS))
    sub = (man | 0x800000) >> tl.minimum((23 - MBITS) + (EMIN - unb), 31)
    byte = tl.where(unb >= EMIN, normal, sub) | ((sign >> 24) & 0x80)
    qsign = (q.to(tl.int32, bitcast=True) >> 24) & 0x80
    return tl.where(q != q, qsign | 0x7F, byte).to(tl.uint8)


def store_(
    pairs: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]],
    slots: Tensor,
    page_size: int,
    num_slots: int,
    scales: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Write ``src [n, H, d]`` rows into ``dst [pages, P, H, >= d]`` (NHD-ordered strides, each
    destination its own) for two ``(src, dst)`` pairs, in one launch over the ``n`` tokens.

    The caller (:mod:`attnpool.kv`) has validated shapes, dtypes, devices and unit last strides.
    Every input is addressed through its own strides (a strided ``slot_mapping`` such as
    ``slots[::2]`` included), never assumed contiguous. ``scales`` (float32, 1 or ``H`` elements
    each, one per pair) make it a quantizing store into fp8 destinations.
    """
    (s1, d1), (s2, d2) = pairs
    n = slots.shape[0]
    if n == 0:
        return
    heads = d1.shape[2]
    block_d = triton.next_power_of_2(max(s1.shape[2], s2.shape[2], 1))
    args: list[Any] = [
        slots, slots.stride(0),
        s1, s1.stride(0), s1.stride(1), d1,
        s2, s2.stride(0), s2.stride(1), d2,
        d1.stride(0), d1.stride(1), d1.stride(2),
        d2.stride(0), d2.stride(1), d2.stride(2),
        num_slots, heads, s1.shape[2], s2.shape[2],
    ]
    quant: dict[str, Any] = {}
    if scales is None:
        args += [slots, 0, slots, 0]  # unused: QUANT is off
    else:
        from .quant import FP8

        fmax, mbits, emin = FP8[d1.dtype]
        fp8 = tl.float8e4nv if d1.dtype == torch.float8_e4m3fn else tl.float8e5
        args[5], args[9] = d1.view(torch.uint8), d2.view(torch.uint8)
        for sc in scales:
            args += [sc, 0 if sc.numel() == 1 else sc.stride(0)]
        quant = {"QUANT": True, "FP8_MAX": fmax, "MBITS": mbits, "EMIN": emin, "FP8": fp8}
    kw = {"PAGE_SIZE": page_size, "BLOCK_H": triton.next_power_of_2(heads), "BLOCK_D": block_d,
          **quant}
    if record_launch(_store_kernel, (n,), tuple(args), kw):
        return  # recorded, not run: see attnpool.update.launch.recording
    # Launch on the cache's device (the current device may be another GPU).
    guard = torch.cuda.device(slots.device) if slots.device.type == "cuda" else nullcontext()
    with guard:
        _store_kernel[(n,)](*args, **kw)

"""fp8 KV caches in the adapters: which adapter reads one how, and the scale arguments they take.

A cache written by :meth:`attnpool.KVCachePool.store_kv_` with ``k_scale`` / ``v_scale`` holds
``x / scale`` in fp8 (:mod:`attnpool.kv.quant`); reading it means multiplying back. Scales are
float32 device tensors of 1 element (per tensor) or ``H_kv`` elements (per KV head).

=================  ==================  =========================  ================================
adapter            fp8 cache dtypes    scales                     how the scales reach the kernel
=================  ==================  =========================  ================================
sdpa               e4m3fn, e5m2        per tensor or per head,    the gathered rows are dequantized
                                       device tensors             (``stored * scale``, float32)
flash-attn FA3     e4m3fn only         per tensor or per head,    ``k_descale`` / ``v_descale``
                                       device tensors             ``[bs, H_kv]`` views (no copy);
                                                                  ``q`` is cast to e4m3fn (FA3
                                                                  takes one dtype for q, k and v)
flash-attn FA2     none (refused)      --                         --
FlashInfer         e4m3fn, e5m2        per tensor, Python floats  ``run(k_scale=, v_scale=)``;
                                       (:func:`host_scales`)      ``plan(kv_dtype=<cache dtype>)``
=================  ==================  =========================  ================================

Why FA3 gets views and FlashInfer floats: FA3's ``q_descale`` / ``k_descale`` / ``v_descale`` are
float32 tensors of shape ``[batch_size, num_heads_k]`` that the kernel reads on the device through
their strides, so a stride-0 expansion of our ``[1]`` or ``[H_kv]`` scale is accepted as is: a
captured graph bakes the scale's address and sees in-place changes of its value, at no copy or
launch. FlashInfer's paged wrappers take the scales in ``run`` as Python floats (the decode
wrapper types them ``Optional[float]``; some newer prefill backends also take tensors, not all):
``k_scale`` is multiplied into the softmax scale on the host and the output by ``v_scale`` after
the kernel, so a captured graph bakes the *values*. Floats are what every version and backend
takes, so the adapter passes floats. Turning a device scale into a float is a host read (a sync,
and illegal during capture); it belongs at model load, once per layer (:func:`host_scales`),
never per step. A float has no per-head form, so per-head scales are refused there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, LayoutError
from ..kv.quant import FP8, check_scales, is_fp8

#: The one fp8 dtype FA3 computes in (q, k and v alike).
FA3_FP8 = torch.float8_e4m3fn
#: FA3 in fp8 needs head dims that are multiples of this (16-bit inputs: 8).
FA3_FP8_HEAD_MULTIPLE = 16


def cache_scales(cache: Tensor, h_kv: int, k_scale: object, v_scale: object
                 ) -> tuple[Tensor | None, Tensor | None]:
    """``(k_scale, v_scale)`` flattened and checked for dtype, device and size (no value read, so
    no host sync per layer), or ``(None, None)`` when neither is given (a model-dtype cache, or an
    fp8 cache read raw, as the SDPA adapter allows).

    Raises:
        InputError: scales given for a model-dtype cache, one of the two missing, or a scale that
            is not a float32 tensor of 1 or ``h_kv`` elements on the cache's device.
    """
    if k_scale is None and v_scale is None:
        return None, None
    sc = check_scales(cache.dtype, h_kv, cache.device,
                      (("k_scale", k_scale), ("v_scale", v_scale)), False)
    return (sc[0], sc[1]) if sc is not None else (None, None)


def descale(scale: Tensor, bs: int, h_kv: int) -> Tensor:
    """A flat ``[1]`` or ``[H_kv]`` scale seen as FA3's ``[bs, H_kv]`` descale: an expanded view
    (batch stride 0, and head stride 0 for one element), never a copy.

    Graph safety: the view aliases the caller's scale tensor, so a graph captured with it reads
    whatever that tensor holds at replay; keep the tensor alive and update it in place.
    """
    return scale.view(1, -1).expand(bs, h_kv)


def quantize_q(q: Tensor, h_kv: int, q_scale: Tensor | None, dtype: torch.dtype = FA3_FP8
               ) -> Tensor:
    """Queries ``[n, H, D]`` in fp8 for a kernel that takes q in the cache's dtype (FA3):
    ``clamp(q / q_scale, -max, max)`` in float32, cast with round to nearest even, the store's
    rule (:func:`attnpool.kv.quant.quantize`) so an outlier saturates instead of becoming NaN.

    ``q_scale`` has 1 or ``h_kv`` elements (query head ``h`` uses KV head ``h // (H // h_kv)``'s,
    FA3's ``q_descale`` convention); None means 1. Allocates the fp8 copy (a graph captures it).
    """
    fmax = FP8[dtype][0]
    x = q.float()
    if q_scale is not None:
        grouped = x.reshape(x.shape[0], h_kv, -1, x.shape[2])  # query heads by KV head
        x = (grouped / q_scale.view(-1, 1, 1)).reshape(q.shape)
    return torch.clamp(x, -fmax, fmax).to(dtype)


def host_scales(k_cache: Tensor, k_scale: Tensor, v_scale: Tensor) -> tuple[float, float]:
    """An fp8 cache's per-tensor device scales as the Python floats FlashInfer's ``run`` takes.

    One host read of both scales (a device sync): call it once per layer when the scales are
    loaded, outside any graph capture, and pass the floats to every run of that layer.

    Raises:
        InputError: the cache is not fp8, a scale is not a float32 ``[1]`` tensor on the cache's
            device (per-head scales included: FlashInfer's run has no per-head form; the SDPA and
            FA3 adapters read them), or a value is not finite and > 0.
    """
    if k_cache.dim() != 4:
        raise InputError(f"k_cache must be [num_pages, page_size, H_kv, D], got "
                         f"{tuple(k_cache.shape)}")
    if not is_fp8(k_cache.dtype):
        raise InputError(f"host_scales is for fp8 caches, this cache is {k_cache.dtype}")
    h_kv = k_cache.shape[2]
    sc = check_scales(k_cache.dtype, h_kv, k_cache.device,
                      (("k_scale", k_scale), ("v_scale", v_scale)), False)
    assert sc is not None  # an fp8 cache
    for name, s in zip(("k_scale", "v_scale"), sc, strict=True):
        if s.numel() != 1:
            raise InputError(f"{name} must have 1 element for FlashInfer (its run takes one float "
                             f"per K and V), got {s.numel()} (per-head scales: use the sdpa or "
                             "FA3 adapter)")
    k, v = torch.cat(sc).tolist()  # the one host read
    return check_float("k_scale", k), check_float("v_scale", v)


def check_float(name: str, s: object) -> float:
    """``s`` as a float if it is a finite Python number > 0 (not a bool, not a tensor)."""
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        raise InputError(f"{name} must be a Python float (FlashInfer's run folds it in on the host "
                         f"and a graph bakes it; convert device scales once with host_scales), "
                         f"got {type(s).__name__}")
    if not (math.isfinite(s) and s > 0):
        raise InputError(f"{name} must be finite and > 0, got {s!r}")
    return float(s)


def float_scales(k_cache: Tensor, k_scale: object, v_scale: object) -> dict[str, float]:
    """FlashInfer ``run`` keyword arguments for the scales: ``{}`` when neither is given, else
    both as floats (checked on the host, no device read).

    Raises:
        InputError: scales for a model-dtype cache, one of the two missing, or not a finite
            Python float > 0.
    """
    if k_scale is None and v_scale is None:
        return {}
    if not is_fp8(k_cache.dtype):
        name = "k_scale" if k_scale is not None else "v_scale"
        raise InputError(f"{name} must be None: scales are only for fp8 caches, this cache is "
                         f"{k_cache.dtype}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise InputError(f"{name} is required with the other scale for an fp8 cache "
                             f"({k_cache.dtype}): a Python float (see host_scales)")
    return {"k_scale": check_float("k_scale", k_scale), "v_scale": check_float("v_scale", v_scale)}


def fa3_fp8_kwargs(
    bs: int,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    q_scale: Tensor | None = None,
) -> dict[str, Any]:
    """FA3's fp8 arguments for a part of ``bs`` rows: ``{}`` for a model-dtype cache, else ``q``
    in ``float8_e4m3fn`` and the ``*_descale`` tensors.

    FA3 takes one dtype for q, k and v (it checks ``k.dtype == q.dtype``) and reads its descale
    arguments only when that dtype is ``float8_e4m3fn``, as float32 ``[batch_size, num_heads_k]``
    tensors through their strides. So a model-dtype ``q`` is cast (:func:`quantize_q`: saturated,
    a new tensor) and each scale is passed as a stride-0 ``[bs, H_kv]`` view of itself
    (:func:`descale`): no copy, no launch, and a captured
    graph reads the scale tensor's current value at every replay. The kernel multiplies the
    softmax scale by ``q_descale * k_descale`` and the output by ``v_descale``, per row and KV
    head, so the result is attention over ``stored * scale``; its output is bfloat16, cast back
    to ``q``'s dtype by :func:`run`.

    Raises:
        LayoutError: a ``float8_e5m2`` cache (FA3 has no e5m2 kernels), or a head dim that is not
            a multiple of 16 (FA3's fp8 alignment).
        InputError: scales for a model-dtype cache, one of ``k_scale`` / ``v_scale`` missing,
            a scale that is not float32 with 1 or ``H_kv`` elements on the cache's device, or
            ``v_cache`` of another dtype than ``k_cache``.
    """
    h_kv = k_cache.shape[2]
    if not is_fp8(k_cache.dtype):
        check_scales(k_cache.dtype, h_kv, k_cache.device,
                     (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)), False)
        return {}
    if k_cache.dtype != FA3_FP8:
        raise LayoutError(f"FA3 reads fp8 KV caches as {FA3_FP8} only, got {k_cache.dtype}; use "
                          "the sdpa or FlashInfer adapter")
    if v_cache.dtype != k_cache.dtype:
        raise InputError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if k_cache.shape[3] % FA3_FP8_HEAD_MULTIPLE or v_cache.shape[3] % FA3_FP8_HEAD_MULTIPLE:
        raise LayoutError(f"FA3 in fp8 needs head dims that are multiples of "
                          f"{FA3_FP8_HEAD_MULTIPLE}, got {k_cache.shape[3]} / {v_cache.shape[3]}")
    ks, vs = cache_scales(k_cache, h_kv, k_scale, v_scale)
    qs = None
    if q_scale is not None:
        (qs,) = check_scales(k_cache.dtype, h_kv, k_cache.device, (("q_scale", q_scale),),
                             False) or (None,)
    kw: dict[str, Any] = {"q": q if q.dtype == FA3_FP8 else quantize_q(q, h_kv, qs)}
    for name, s in (("q_descale", qs), ("k_descale", ks), ("v_descale", vs)):
        if s is not None:
            kw[name] = descale(s, bs, h_kv)
    return kw

"""Attention variants every adapter shares: logit softcapping and attention sinks.

* **Softcapping** (Gemma 2, Grok): scores become ``softcap * tanh(scores / softcap)`` after the
  softmax scale and before the mask, as transformers' eager attention computes them; ``0``
  turns it off (flash-attn's convention for ``softcap=``; FlashInfer's ``logits_soft_cap``).
* **Attention sinks** (gpt-oss): one learned logit per query head joins the softmax denominator
  of every query row and contributes no value: ``out = sum_i e^{s_i} v_i / (sum_i e^{s_i} +
  e^{sink_h})``. From a pass's natural-log log-sum-exp ``lse`` that is exactly ``out * sigmoid(lse
  - sink_h)``, with the row's new log-sum-exp ``logaddexp(lse, sink_h)``: :func:`with_sinks`.

A sink is applied **once per query row**. A view with two passes (a tree verify's prefix and
expand parts, a draft tree step) runs both without it, merges them by log-sum-exp (the union
of their keys) and applies the sink to the merged row; a kernel's own sink argument would apply
it in each pass and count it twice. A single pass may hand it to the kernel instead.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from ..errors import InputError


def check_softcap(softcap: object) -> float:
    """``softcap`` as a host float: 0 (off) or a finite value > 0; anything else (a negative or
    non-finite number, a bool, a tensor) is refused, naming what was given."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise InputError(f"softcap must be a float (0 = off, else > 0), got "
                         f"{type(softcap).__name__}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise InputError(f"softcap must be 0 (off) or a finite float > 0, got {softcap!r}")
    return cap


def check_sinks(sinks: object, num_heads: int, device: torch.device,
                dtype: torch.dtype | None = torch.float32) -> Tensor | None:
    """``sinks [num_heads]`` of ``dtype`` (None: any floating dtype) on ``device``, contiguous
    (a kernel reads it flat), or None. Casting per call would give a captured graph a
    temporary's address: the caller casts once, at load, into the dtype its kernel takes."""
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise InputError(f"sinks must be a torch.Tensor [{num_heads}], got {type(sinks).__name__}")
    if tuple(sinks.shape) != (num_heads,):
        raise InputError(f"sinks must have shape [{num_heads}] (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if dtype is None and not sinks.dtype.is_floating_point:
        raise InputError(f"sinks must be floating point, got {sinks.dtype}")
    if dtype is not None and sinks.dtype != dtype:
        raise InputError(f"sinks must be {dtype} here, got {sinks.dtype}; cast it once when the "
                         "model loads (a per-call cast is a new tensor every step, which a "
                         "captured graph cannot follow)")
    if sinks.device != device:
        raise InputError(f"sinks must be on {device} like q, got {sinks.device}")
    if not sinks.is_contiguous():
        raise InputError(f"sinks must be contiguous, got strides {sinks.stride()}")
    return sinks


def sink_argument(fn: object) -> str | None:
    """The name under which kernel ``fn`` takes per-head sinks: ``s_aux`` (vLLM's FA3 build),
    ``sinks`` (sgl-kernel's FA3, FlashInfer's sink-capable runs), or None (upstream FA2/FA3:
    no such argument). Read from its signature, once per call of an adapter."""
    try:
        params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    for name in ("s_aux", "sinks"):
        if name in params:
            return name
    return None


def cap_scores_(scores: Tensor, softcap: float) -> Tensor:
    """``softcap * tanh(scores / softcap)`` in place (scores already scaled, not yet masked)."""
    return scores.div_(softcap).tanh_().mul_(softcap)


def with_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """``(out * sigmoid(lse - sink), logaddexp(lse, sink))`` per query head (``out [T, H, D]``,
    ``lse [T, H]``), in float32 at least (float64 stays float64). A row with no keys (``lse =
    -inf``, or flash-attn's ``+inf``) keeps output 0 and takes the sink as its log-sum-exp."""
    ct = torch.promote_types(torch.promote_types(lse.dtype, out.dtype), torch.float32)
    lse = torch.where(torch.isposinf(lse), float("-inf"), lse.to(ct))
    sink = sinks.to(ct)[None, :]
    weight = torch.sigmoid(lse - sink)
    scaled = (out.to(ct) * weight[..., None]).to(out.dtype)
    return scaled, torch.logaddexp(lse, sink.expand_as(lse))

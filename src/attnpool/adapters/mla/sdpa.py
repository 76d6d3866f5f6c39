"""Absorbed multi-head latent attention (MLA) over a latent cache, with PyTorch SDPA.

A latent :class:`attnpool.KVCachePool` (``kind=KVKind.MLA``) keeps one row per token,
``[c_kv (L) | k_pe (R)]``, ``kv_cache(l) [num_pages, P, 1, L + R]``. With the key projection
absorbed into the query (:mod:`attnpool.adapters.mla.absorb`), DeepSeek's attention over it is
multi-query attention (one KV head for all ``H`` query heads):

* **query** ``[T, H, L + R]`` = ``[q_nope · W_UK | q_pe]``: the absorbed latent query, then the
  rope query. It may also come as two tensors, FlashInfer's ``q_nope [T, H, L]`` (already
  absorbed: FlashInfer names the latent query so) and ``q_pe [T, H, R]``: pass the first as ``q``
  and the second as ``q_pe=``. The packed form is FlashMLA's; flash-attn's ``qv`` path takes the
  split one (``qv`` = the latent query, ``q`` = ``q_pe``).
* **keys** = the whole row (``L + R``), **values** = its first ``L`` columns: a view of the same
  cache, never a copy (the SDPA gather copies the key lanes once and reads the values from that
  copy: :func:`attnpool.adapters.sdpa.gather.gather_pair`).
* **output** ``[T, H, L]`` (the latent output ``o_lat``; the engine applies ``W_UV``, see
  :func:`attnpool.adapters.mla.absorb.unabsorb_out`) and the natural-log log-sum-exp
  ``[T, H]`` float32, like every adapter, so tree passes merge (:mod:`attnpool.adapters.merge`).
* **scale**: the unabsorbed head's, ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``
  (:attr:`attnpool.kv.mla_shape.MLAShape.softmax_scale`), not ``(L + R) ** -0.5``.

Every view the other adapters take works here, the same way (decode, chain and tree verify,
draft steps, draft extend, extend with a cached prefix, both layouts, any page size), because
this module only puts the latent cache into the SDPA adapter's shape. The kernel adapters for the
same computation are :mod:`attnpool.adapters.mla.flashinfer` (FlashInfer's MLA wrapper) and
:mod:`attnpool.adapters.mla.fa4` (flash-attn 4's ``qv`` path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import Layout
from ...errors import InputError
from ...kv.mla_shape import MLAShape
from ...views import PagedView
from ..merge import Attn
from ..sdpa import paged
from ..sdpa.planning import Plan


def check_shape(shape: object) -> MLAShape:
    if not isinstance(shape, MLAShape):
        raise InputError(f"shape must be an attnpool.kv.mla_shape.MLAShape, got "
                         f"{type(shape).__name__}")
    return shape


def latent_kv(kv_cache: Tensor, shape: MLAShape) -> tuple[Tensor, Tensor]:
    """``(keys, values)`` of a latent cache ``[num_pages, P, 1, L + R]``: the cache itself and
    its first ``L`` columns (a view)."""
    if not isinstance(kv_cache, Tensor) or kv_cache.dim() != 4 or kv_cache.shape[2] != 1 \
            or kv_cache.shape[3] != shape.latent_row:
        got = tuple(kv_cache.shape) if isinstance(kv_cache, Tensor) else type(kv_cache).__name__
        raise InputError(f"kv_cache must be a latent cache [num_pages, page_size, 1, "
                         f"{shape.latent_row}] (kv_lora_rank {shape.kv_lora_rank} + rope "
                         f"{shape.qk_rope_head_dim}: KVCachePool.kv_cache(layer)), got {got}")
    return kv_cache, kv_cache[..., : shape.kv_lora_rank]


def _check_q(q: Tensor, shape: MLAShape, q_pe: Tensor | None) -> None:
    h, lat, r = shape.num_heads, shape.kv_lora_rank, shape.qk_rope_head_dim
    if not isinstance(q, Tensor) or q.dim() != 3 or q.shape[1] != h:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise InputError(f"q must be [T, {h}, D] (num_heads={h}), got {got}")
    if q_pe is None:
        if q.shape[2] != lat + r:
            raise InputError(f"a packed absorbed query must be [T, {h}, {lat + r}] "
                             f"([q_nope·W_UK (L={lat}) | q_pe (R={r})]), got {tuple(q.shape)}; "
                             "pass the rope part as q_pe= for the split form")
        return
    if q.shape[2] != lat:
        raise InputError(f"with q_pe given, q is the absorbed latent query [T, {h}, {lat}], got "
                         f"{tuple(q.shape)}")
    if not isinstance(q_pe, Tensor) or tuple(q_pe.shape) != (q.shape[0], h, r) \
            or q_pe.dtype != q.dtype or q_pe.device != q.device:
        what = (f"{tuple(q_pe.shape)} {q_pe.dtype}" if isinstance(q_pe, Tensor)
                else type(q_pe).__name__)
        raise InputError(f"q_pe must be [{q.shape[0]}, {h}, {r}] of q's dtype {q.dtype} on "
                         f"{q.device}, got {what}")


def packed_q(q: Tensor, shape: MLAShape, q_pe: Tensor | None = None) -> Tensor:
    """The absorbed query as one ``[T, H, L + R]`` tensor: ``q`` itself when packed, else
    ``cat(q [T, H, L], q_pe [T, H, R])`` (a copy of the queries, not of the cache)."""
    _check_q(q, shape, q_pe)
    return q if q_pe is None else torch.cat((q, q_pe), dim=-1)


def split_q(q: Tensor, shape: MLAShape, q_pe: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The absorbed query as ``(latent [T, H, L], rope [T, H, R])``: ``(q, q_pe)`` when split,
    else two column views of the packed ``q`` (no copy): what FlashInfer and flash-attn take."""
    _check_q(q, shape, q_pe)
    if q_pe is not None:
        return q, q_pe
    return q[..., : shape.kv_lora_rank], q[..., shape.kv_lora_rank:]


def _scale(shape: MLAShape, softmax_scale: float | None) -> float:
    return shape.softmax_scale if softmax_scale is None else float(softmax_scale)


def attention(view: object, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
              q_pe: Tensor | None = None, softmax_scale: float | None = None,
              layout: Layout | None = None, kv_scale: Tensor | None = None) -> Attn:
    """Absorbed MLA over ``kv_cache`` for a :class:`PagedView` or a verify / draft step view
    (a tree's two passes merged by log-sum-exp): ``Attn(out [T, H, L], lse [T, H])``.

    Args:
        view: any view :func:`attnpool.adapters.sdpa.attention` takes.
        q: ``[T, H, L + R]`` packed absorbed query, or ``[T, H, L]`` with ``q_pe``.
        kv_cache: ``KVCachePool.kv_cache(layer)``, ``[num_pages, P, 1, L + R]``.
        shape: the layer's :class:`MLAShape`.
        q_pe: ``[T, H, R]``, the rope query, for the split form.
        softmax_scale: default ``shape.softmax_scale``, ``(nope + rope) ** -0.5``.
        layout: which of the view's layouts to read (default: the page table when present).
        kv_scale: an fp8 latent cache's ``[1]`` float32 scale (keys and values share it).

    Padded rows are computed like real ones (their output is finite and discarded), as in the
    SDPA adapter; positions no row covers hold 0 and ``-inf``.
    """
    shape = check_shape(shape)
    k, v = latent_kv(kv_cache, shape)
    return paged.attention(view, packed_q(q, shape, q_pe), k, v,
                          softmax_scale=_scale(shape, softmax_scale), layout=layout,
                          k_scale=kv_scale, v_scale=kv_scale)


def attention_out(view: object, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
                  q_pe: Tensor | None = None, softmax_scale: float | None = None,
                  layout: Layout | None = None, kv_scale: Tensor | None = None) -> Tensor:
    """:func:`attention`'s output alone ``[T, H, L]``: a single pass runs PyTorch's SDPA and
    computes no log-sum-exp (a tree view's two passes still do, to merge)."""
    shape = check_shape(shape)
    k, v = latent_kv(kv_cache, shape)
    return paged.attention_out(view, packed_q(q, shape, q_pe), k, v,
                              softmax_scale=_scale(shape, softmax_scale), layout=layout,
                              k_scale=kv_scale, v_scale=kv_scale)


def plan(view: PagedView, *, num_q: int, shape: MLAShape, layout: Layout | None = None,
         dtype: torch.dtype | None = None, prefix_free: bool = False) -> Plan:
    """The layer-independent half of a single pass (:func:`attnpool.adapters.sdpa.plan` with
    ``H`` query heads over one KV head): compute it once per forward, then :func:`run_plan`
    per layer."""
    shape = check_shape(shape)
    return paged.plan(view, num_q=num_q, num_heads=shape.num_heads, num_kv_heads=1,
                     layout=layout, dtype=dtype, prefix_free=prefix_free)


def run_plan(pl: Plan, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
             q_pe: Tensor | None = None, softmax_scale: float | None = None,
             kv_scale: Tensor | None = None) -> Tensor:
    """One layer's latent output ``[num_q, H, L]`` from a :func:`plan` of the view."""
    shape = check_shape(shape)
    k, v = latent_kv(kv_cache, shape)
    return paged.run_plan(pl, packed_q(q, shape, q_pe), k, v,
                         softmax_scale=_scale(shape, softmax_scale), k_scale=kv_scale,
                         v_scale=kv_scale)

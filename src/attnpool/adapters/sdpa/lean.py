"""A layer's pass with nothing between it and SDPA: one query per row, keys read in place.

On a CPU a decode step of a model runs the same pass in every layer, and once the pass's keys
are views of the cache itself (``Gather.run``, :mod:`attnpool.adapters.sdpa.gather`), what
:func:`~attnpool.adapters.sdpa.paged.run_plan` adds around SDPA (its general checks, the scale
and copy decisions, the query regrouping, the scatter back) is most of what a layer costs besides
SDPA: each of those steps is a Python call, and between two layers the weights have pushed all
of it out of the CPU's caches. :func:`lean_out` is the same pass in as few steps as it takes:
two strided views, one SDPA call with the plan's mask, one view of the output. It computes
exactly what ``run_plan`` computes for such a plan (the same SDPA call over the same tensors),
and it takes a call only when its few checks hold; anything else returns None and goes the
general way, which checks everything and names the problem.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .gather import read_in_place, token_rows
from .planning import Plan


def lean_ready(pl: Plan) -> bool:
    """Whether :func:`lean_out` serves layers of ``pl``: one query per row, every row's (packed
    query ``i`` is row ``i``), the keys read in place, a mask to apply (not a prefix-free plan)
    and no query that can lack a key."""
    return (pl.gather.run is not None and pl.q_idx is None and pl.b == pl.total
            and pl.allowed is not None and pl.keyed is None)


def lean_out(pl: Plan, q: Tensor, k_cache: Tensor, v_cache: Tensor,
             softmax_scale: float | None) -> Tensor | None:
    """``[b, H, Dv]``: ``run_plan(pl, q, k_cache, v_cache, softmax_scale=...)`` for a plan that
    :func:`lean_ready` accepts (no fp8 scales, softcap or sinks), or None when ``q`` or the
    caches are not what such a pass reads: not of the plan's shape, another dtype than ``q``'s
    (the keys would be converted, a copy), on another device, token rows not one run, or rows
    reaching past the cache's end."""
    run, mask = pl.gather.run, pl.allowed
    if run is None or mask is None:
        return None
    b, hk = pl.b, pl.num_kv_heads
    dt = q.dtype
    if (q.dim() != 3 or q.shape[0] != b or q.shape[1] != pl.num_heads
            or k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.dtype != dt
            or v_cache.dtype != dt or k_cache.shape[2] != hk or k_cache.shape[3] != q.shape[2]
            or v_cache.shape[:3] != k_cache.shape[:3]
            or (mask.dtype != dt and mask.is_floating_point())
            or not q.device == k_cache.device == v_cache.device
            or run[2] > k_cache.shape[0] * k_cache.shape[1]
            or not (token_rows(k_cache) and token_rows(v_cache))):
        return None
    k, v = read_in_place(b, pl.lmax, run, k_cache), read_in_place(b, pl.lmax, run, v_cache)
    o = F.scaled_dot_product_attention(q.reshape(b, hk, -1, q.shape[2]), k, v, attn_mask=mask,
                                       scale=softmax_scale)
    return o.view(b, pl.num_heads, -1)

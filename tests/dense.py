"""Dense, unpaged attention: the oracle for the attention adapters.

It knows nothing about pages, views or layouts: each query is given the list of KV token slots it
may attend (built by a test from the phase semantics and the engine's ``req_to_token`` table), and
attention is a plain softmax in float64, one query at a time. Slot ``s`` is row ``s`` of the cache
flattened to ``[tokens, H_kv, D]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def flat(cache: Tensor) -> Tensor:
    """``[num_pages, P, H_kv, D]`` -> ``[num_pages * P, H_kv, D]`` (token slot = page * P + offset)."""
    return cache.reshape(-1, cache.shape[2], cache.shape[3])


def dense_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    keys: Sequence[Sequence[int]],
    softmax_scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q[m]`` over the token slots ``keys[m]``, for ``m < len(keys)``.

    Args:
        q: ``[>= len(keys), H, D]``.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]``.
        keys: per query, the slots it attends (any order; a slot listed twice counts twice).

    Returns:
        ``(out [len(keys), H, D], lse [len(keys), H])`` in float64; a query with no keys gets
        output 0 and lse ``-inf``.
    """
    k, v = flat(k_cache).double(), flat(v_cache).double()
    h, d = q.shape[1], q.shape[2]
    grp = h // k.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros(len(keys), h, v.shape[2], dtype=torch.float64)
    lse = torch.full((len(keys), h), float("-inf"), dtype=torch.float64)
    for m, slots in enumerate(keys):
        if not slots:
            continue
        idx = torch.tensor(list(slots), dtype=torch.int64)
        km = k[idx].repeat_interleave(grp, dim=1)  # [L, H, D]
        vm = v[idx].repeat_interleave(grp, dim=1)
        s = torch.einsum("hd,lhd->hl", q[m].double(), km) * scale  # [H, L]
        lse[m] = torch.logsumexp(s, dim=-1)
        out[m] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), vm)
    return out, lse

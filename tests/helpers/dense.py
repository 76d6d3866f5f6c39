"""Dense, unpaged attention: the oracle for the attention adapters.

It knows nothing about pages, views or layouts: each query is given the list of KV token slots it
may attend (built by a test from the phase semantics and the engine's ``req_to_token`` table), and
attention is a plain softmax in float64, one query at a time. Slot ``s`` is row ``s`` of the cache
flattened to ``[tokens, H_kv, D]``; V's head size ``Dv`` may differ from K's (the output has
``Dv``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def flat(cache: Tensor) -> Tensor:
    """``[num_pages, P, H_kv, D]`` -> ``[num_pages * P, H_kv, D]`` (token slot = page * P + offset;
    any last dim)."""
    return cache.reshape(-1, cache.shape[2], cache.shape[3])


def dense_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    keys: Sequence[Sequence[int]],
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q[m]`` over the token slots ``keys[m]``, for ``m < len(keys)``.

    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` after the scale (Gemma 2's
    eager attention). ``sinks [H]``: as gpt-oss's eager attention computes them, a sink logit
    column is appended to each head's scores, the softmax runs over keys and sink, and the sink
    column is dropped before the values (so the log-sum-exp includes the sink).

    Args:
        q: ``[>= len(keys), H, D]``.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]`` and ``[num_pages, P, H_kv, Dv]``.
        keys: per query, the slots it attends (any order; a slot listed twice counts twice).

    Returns:
        ``(out [len(keys), H, Dv], lse [len(keys), H])`` in float64; a query with no keys gets
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
            if sinks is not None:
                lse[m] = sinks.double()
            continue
        idx = torch.tensor(list(slots), dtype=torch.int64)
        km = k[idx].repeat_interleave(grp, dim=1)  # [L, H, D]
        vm = v[idx].repeat_interleave(grp, dim=1)
        s = torch.einsum("hd,lhd->hl", q[m].double(), km) * scale  # [H, L]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], dim=1)
        lse[m] = torch.logsumexp(s, dim=-1)
        probs = torch.softmax(s, dim=-1)
        if sinks is not None:
            probs = probs[:, :-1]
        out[m] = torch.einsum("hl,lhd->hd", probs, vm)
    return out, lse

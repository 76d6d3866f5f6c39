"""A CPU fake of flash-attn 4's ``flash_attn_varlen_func`` on its absorbed-MLA (``qv``) path.

Read from flash-attn-4 4.0.0b36 (``flash_attn/cute/interface.py``: ``flash_attn_varlen_func`` and
``_flash_attn_fwd``; ``cute_dsl_utils.maybe_contiguous``). The fake takes the real keyword names
and asserts what ``_flash_attn_fwd`` asserts for this path: a page table excludes
``cu_seqlens_k``, is int32, contiguous in its last dim and ``(batch, max_pages)``; ``k`` is
``(num_pages, page_size, h_kv, head_dim)`` and ``v`` ``(.., head_dim_v)``; ``cu_seqlens_q`` is
``(batch + 1,)`` and ``seqused_k`` ``(batch,)``, both int32 with unit stride; q, k, v and qv share
one dtype among fp16 / bf16 / fp8; ``qv`` needs a Blackwell arch (``arch // 10 in (10, 11)``),
``qv.shape[:-1] == q.shape[:-1]``, ``qv.shape[-1] == head_dim_v == 512``, ``head_dim == 64``, no
window and no softcap. The default scale with ``qv`` is ``(head_dim + head_dim_v) ** -0.5``.

Made loud here: an input flash-attn would copy (``maybe_contiguous`` keeps a tensor only when its
pointer and strides are 16-byte aligned with a unit last stride; a copied cache would be read,
not the one the engine writes). Computed in float64 from the inputs: row ``i`` attends the first
``seqused_k[i]`` tokens of its pages, its queries aligned to the end of its keys when causal;
``lse`` is natural-log ``(total_q, H)``; output rows past ``cu_seqlens_q[-1]`` are NaN (left as
allocated).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


def _aligned(t: Tensor, name: str) -> None:
    size = t.element_size()
    ok = t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(
        (st * size) % 16 == 0 for st, n in zip(t.stride()[:-1], t.shape[:-1], strict=True)
        if n > 1)
    if not ok:
        raise AssertionError(f"fake flash-attn 4: {name} (strides {t.stride()}) is not 16-byte "
                             "aligned: maybe_contiguous would copy it")


class FA4:
    def __init__(self, arch: int = 100) -> None:
        self.arch = arch
        self.calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(
        self, q: Tensor, k: Tensor, v: Tensor, qv: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
        max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
        min_seqlen_k: int | None = None, seqused_q: Tensor | None = None,
        seqused_k: Tensor | None = None, gather_kv_indices: Tensor | None = None,
        page_table: Tensor | None = None, softmax_scale: float | None = None,
        causal: bool = False, window_size: tuple[int | None, int | None] = (None, None),
        learnable_sink: Tensor | None = None, softcap: float = 0.0, num_splits: int = 1,
        return_lse: bool = False, **kw: Any,
    ) -> tuple[Tensor, Tensor | None]:
        self.calls.append({"q": q, "k": k, "v": v, "qv": qv, "page_table": page_table,
                           "softmax_scale": softmax_scale, "causal": causal})
        assert cu_seqlens_q is not None and page_table is not None and seqused_k is not None
        b = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        assert page_table.dtype == torch.int32, "page_table must be int32"
        assert page_table.stride(-1) == 1, "page_table must be contiguous in the last dimension"
        assert page_table.shape == (b, page_table.shape[1])
        num_pages, page_size = v.shape[:2]
        h_kv, dv, d = v.shape[-2], v.shape[-1], q.shape[-1]
        assert k.shape == (num_pages, page_size, h_kv, d)
        assert v.shape == (num_pages, page_size, h_kv, dv)
        assert cu_seqlens_q.shape == (b + 1,), "cu_seqlens_q must have shape (batch_size + 1,)"
        assert seqused_k.shape == (b,), "seqused_k must have shape (batch_size,)"
        for t in (cu_seqlens_q, seqused_k):
            assert t.dtype == torch.int32 and t.stride(0) == 1
        assert v.dtype in _DTYPES, "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
        assert all(t is None or t.dtype == v.dtype for t in (q, k, qv)), \
            "q, k, v, and qv must have the same dtype"
        assert qv is not None
        assert self.arch // 10 in (10, 11), "only support Blackwell arch with qv"
        assert qv.shape[:-1] == q.shape[:-1] and qv.shape[-1] == dv
        assert dv == 512 and d == 64
        assert window_size == (None, None), "local not yet supported with qv"
        assert not softcap
        assert q.shape[1] % h_kv == 0, "num_head must be divisible by num_head_kv"
        for name, t in (("q", q), ("k", k), ("v", v), ("qv", qv)):
            _aligned(t, name)
        scale = 1.0 / math.sqrt(d + dv) if softmax_scale is None else softmax_scale
        total, h = q.shape[0], q.shape[1]
        out = torch.full((total, h, dv), float("nan"), dtype=torch.float64)
        lse = torch.full((total, h), float("nan"), dtype=torch.float64)
        cu, lens, pt = cu_seqlens_q.tolist(), seqused_k.tolist(), page_table.tolist()
        kf = k.double().reshape(-1, h_kv, d)[:, 0]
        vf = v.double().reshape(-1, h_kv, dv)[:, 0]
        for i in range(b):
            n, nq = lens[i], cu[i + 1] - cu[i]
            slots = torch.tensor([pt[i][t // page_size] * page_size + t % page_size
                                  for t in range(n)], dtype=torch.int64)
            for j in range(nq):
                r = cu[i] + j
                seen = min(n, n - nq + j + 1) if causal else n
                if seen <= 0:
                    out[r], lse[r] = 0.0, float("-inf")
                    continue
                sl = slots[:seen]
                s = (q[r].double() @ kf[sl].T + qv[r].double() @ vf[sl].T) * scale
                lse[r] = torch.logsumexp(s, -1)
                out[r] = torch.softmax(s, -1) @ vf[sl]
        return out.to(q.dtype), (lse.float() if return_lse else None)

"""A CPU fake of flash-attn 4's ``flash_attn.cute.flash_attn_varlen_func`` on its paged path
(no ``qv``; the absorbed-MLA path is ``fakes_fa4_mla.py``).

Read from flash-attn-4 4.0.0b36 (``flash_attn/cute/interface.py``: ``flash_attn_varlen_func``,
``_flash_attn_fwd``, ``_validate_head_dims``, ``_resolve_causal_local_window``). It takes the real
keyword names and asserts what ``_flash_attn_fwd`` asserts on this path: a page table excludes
``cu_seqlens_k``, is int32, contiguous in its last dim and ``(batch, max_pages)`` with ``batch =
cu_seqlens_q.shape[0] - 1``; ``k`` / ``v`` are ``(num_pages, page_size, h_kv, d / dv)``;
``cu_seqlens_q`` ``(batch + 1,)`` and ``seqused_k`` ``(batch,)`` int32 with unit stride; one dtype
for q, k and v, fp16 / bf16 (fp8 only on Blackwell); ``learnable_sink`` ``(num_head,)`` in fp16 /
bf16 / fp32; on Hopper ``8 <= d, dv <= 256`` and multiples of ``16 // element_size``; ``num_head %
h_kv == 0``; ``max_seqlen_q`` a host int when given. ``window_size=(left, 0)`` with ``causal`` is
its local mask, ``softcap`` 0 is off; on Hopper (the default arch 90) only ``num_splits=1``.
Computed in float32 by the SDPA adapter (whose correctness ``tests/adapters/sdpa/test_paged.py``
checks against dense attention); returns ``(out, lse [num_head, total_q])``, output rows past
``cu_seqlens_q[-1]`` NaN (left as allocated by the kernel).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor

from tests.helpers.fakes_fa3 import _attend

_DTYPES = (torch.float16, torch.bfloat16)
_SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FA4:
    """``flash_attn_varlen_func`` of one fake module; ``calls`` keeps every call's kwargs."""

    def __init__(self, arch: int = 90) -> None:
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
        pack_gqa: bool | None = None, return_lse: bool = False, **kw: Any,
    ) -> tuple[Tensor, Tensor | None]:
        unknown = set(kw) - {"deterministic", "score_mod", "score_mod_bwd", "mask_mod",
                             "block_sparse_tensors", "aux_tensors", "aux_scalars",
                             "scheduler_metadata", "seqlen_k_per_split",
                             "disable_scheduler_metadata", "gather_bwd_recompute_p",
                             "gather_bwd_token_chunk"}
        assert not unknown, f"flash_attn_varlen_func() got unexpected keyword(s) {unknown}"
        self.calls.append({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                           "seqused_k": seqused_k, "page_table": page_table,
                           "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k,
                           "softmax_scale": softmax_scale, "causal": causal,
                           "window_size": window_size, "learnable_sink": learnable_sink,
                           "softcap": softcap, "return_lse": return_lse})
        assert qv is None, "this fake is the paged path; qv is fakes_fa4_mla"
        assert cu_seqlens_q is not None and page_table is not None and seqused_k is not None
        b = cu_seqlens_q.shape[0] - 1
        assert cu_seqlens_k is None, "page_table is not supported with cu_seqlens_k"
        assert page_table.dtype == torch.int32, "page_table must be int32"
        assert page_table.stride(-1) == 1, "page_table must be contiguous in the last dimension"
        assert page_table.shape == (b, page_table.shape[1])
        num_pages, page_size = v.shape[:2]
        h, d = q.shape[-2:]
        h_kv, dv = v.shape[-2], v.shape[-1]
        assert k.shape == (num_pages, page_size, h_kv, d)
        assert v.shape == (num_pages, page_size, h_kv, dv)
        assert cu_seqlens_q.shape == (b + 1,), "cu_seqlens_q must have shape (batch_size + 1,)"
        assert seqused_k.shape == (b,), "seqused_k must have shape (batch_size,)"
        for t in (cu_seqlens_q, seqused_k):
            assert t.dtype == torch.int32, "cu_seqlens_q, seqused_k must be int32"
            assert t.stride(0) == 1, "cu_seqlens_q, seqused_k must be contiguous"
        assert v.dtype in _DTYPES, f"fake flash-attn 4 (arch {self.arch}): fp16 / bf16 only"
        assert q.dtype == k.dtype == v.dtype, "q, k, v must have the same dtype"
        if learnable_sink is not None:
            assert learnable_sink.shape == (h,)
            assert learnable_sink.dtype in _SINK_DTYPES, \
                "learnable_sink must be float16, bfloat16, or float32"
        assert h % h_kv == 0, "num_head must be divisible by num_head_kv"
        align = 16 // v.element_size()
        assert 8 <= d <= 256 and 8 <= dv <= 256 and d % align == 0 and dv % align == 0, \
            f"(head_dim, head_dim_v)=({d}, {dv}) is not supported on SM90"
        assert max_seqlen_q is None or isinstance(max_seqlen_q, int), "max_seqlen_q: a host int"
        # Hopper has no split-KV (seen on an H100: the SM 9.0 path asserts it); the heuristic
        # (num_splits < 1) may pick a split there too
        assert self.arch // 10 != 9 or num_splits == 1, "SplitKV not supported on SM 9.0"
        assert isinstance(window_size, tuple) and len(window_size) == 2
        left, right = window_size
        assert right in (None, 0), "only left windows here (the adapter passes right = 0)"
        scale = d ** -0.5 if softmax_scale is None else softmax_scale
        out, lse = _attend(q, k, v, cache_seqlens=seqused_k, cu_seqlens_q=cu_seqlens_q,
                           page_table=page_table, causal=causal, scale=scale,
                           left=-1 if left is None else left, softcap=softcap or 0.0,
                           sinks=learnable_sink)
        lse = torch.where(torch.isposinf(lse), float("-inf"), lse)  # an empty row: -inf
        return out, (lse.transpose(0, 1).contiguous() if return_lse else None)

    def module(self) -> types.ModuleType:
        """A ``flash_attn.cute`` module whose entry point is this fake."""
        mod = types.ModuleType("flash_attn.cute")
        mod.flash_attn_varlen_func = self.flash_attn_varlen_func  # type: ignore[attr-defined]
        return mod

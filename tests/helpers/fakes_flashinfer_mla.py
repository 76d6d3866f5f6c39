"""A CPU fake of FlashInfer's ``BatchMLAPagedAttentionWrapper`` that checks what the real one checks.

Read from flashinfer-python 0.7.2.post1 (``flashinfer/mla/_batch_mla/_wrapper.py``,
``_backends/_fa_common.py``, ``_contracts.py``) and the earlier single-module wrapper
(``flashinfer/mla.py``), whose keyword names 0.7 still takes:

* ``__init__(float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
  kv_indices=None, kv_len_arr=None, backend="auto")``; a backend outside ``auto / fa2 / fa3 /
  cutlass`` is a ``ValueError``.
* ``plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
  page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False)``: the CSR tensors
  are int32; in graph mode the four reserved buffers must all be given, int32, contiguous,
  ``kv_indices`` of rank 1 and at least as long as the planned one, the others exactly the
  planned shapes; reserved buffers must not overlap one another, and a planned tensor may
  overlap a reserved one only when it *is* that buffer (the same memory, same extent); the plan
  copies the planned tensors into the reserved buffers. ``kv_indptr`` must cover every row of
  ``kv_len_arr``. Graph-mode re-planning is allowed on the fa2 / fa3 backends. The plan reads
  ``qo_indptr``, ``kv_indptr`` and ``kv_len_arr`` on the host.
* ``run(q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False, ...)``: the
  split query and cache are rank 3 with matching leading dims, last dims the planned
  ``(head_dim_ckv, head_dim_kpe)`` and dtypes the planned ones; ``out`` is ``q_nope``'s shape and
  dtype, ``lse`` ``q_nope.shape[:2]`` float32; the log-sum-exp is base 2.

Like a replayed graph, ``run`` computes from the wrapper's reserved buffers: row ``i`` attends to
the ``kv_len_arr[i]`` first tokens of the pages ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``, its
queries ``qo_indptr[i]:qo_indptr[i+1]`` aligned to the end of its keys when causal. Made loud here
(FlashInfer has no exception for them, its kernel reads out of bounds): a ``kv_len_arr`` longer
than the row's pages hold, and a ``q`` with fewer rows than ``qo_indptr[-1]``. A row with no keys
gets output 0 and ``lse = -inf``. Output rows past ``qo_indptr[-1]`` keep what they held.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

_BACKENDS = ("auto", "fa2", "fa3", "cutlass")


def _interval(t: Tensor) -> tuple[int, int, int]:
    start = t.data_ptr()
    return t.untyped_storage().data_ptr(), start, start + t.numel() * t.element_size()


class BatchMLAPagedAttentionWrapper:
    def __init__(self, float_workspace_buffer: Tensor, use_cuda_graph: bool = False,
                 qo_indptr: Tensor | None = None, kv_indptr: Tensor | None = None,
                 kv_indices: Tensor | None = None, kv_len_arr: Tensor | None = None,
                 backend: str = "auto") -> None:
        if backend not in _BACKENDS:
            raise ValueError("backend must be one of 'auto', 'fa2', 'fa3', or 'cutlass', "
                             f"got {backend!r}.")
        self._float_workspace_buffer = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf = qo_indptr
        self._kv_indptr_buf = kv_indptr
        self._kv_indices_buf = kv_indices
        self._kv_len_arr_buf = kv_len_arr
        self._backend = "fa2" if backend == "auto" else backend
        self.plans = 0
        self.runs: list[dict[str, Any]] = []

    def _graph_buffers(self, named: tuple[tuple[str, Tensor | None, Tensor, bool], ...]) -> None:
        if any(reserved is None for _, reserved, _, _ in named):
            raise ValueError("CUDA graph mode requires reserved qo_indptr, kv_indptr, "
                             "kv_indices, and kv_len_arr buffers.")
        for name, reserved, source, larger in named:
            assert reserved is not None
            if reserved.dtype != torch.int32:
                raise ValueError(f"CUDA graph reserved {name} buffer must have dtype "
                                 "torch.int32.")
            if not reserved.is_contiguous():
                raise ValueError(f"CUDA graph reserved {name} buffer must be contiguous.")
            if name == "kv_indices" and reserved.ndim != 1:
                raise ValueError("CUDA graph reserved kv_indices buffer must have rank 1.")
            if (larger and reserved.shape[0] < source.shape[0]) or (
                    not larger and reserved.shape != source.shape):
                raise ValueError(f"CUDA graph reserved {name} buffer has insufficient or "
                                 "incompatible capacity.")
        spans = [(n, _interval(r)) for n, r, _, _ in named if r is not None]
        for i, (a, (pa, sa, ea)) in enumerate(spans):
            for b, (pb, sb, eb) in spans[i + 1:]:
                if pa == pb and max(sa, sb) < min(ea, eb):
                    raise ValueError(f"CUDA graph reserved metadata buffers must not overlap: "
                                     f"{a} overlaps {b}.")
        targets = {n: (r[: s.shape[0]] if larger else r) for n, r, s, larger in named
                   if r is not None}
        for sname, _, source, _ in named:
            si = _interval(source)
            for tname, target in targets.items():
                ti = _interval(target)
                overlaps = si[0] == ti[0] and max(si[1], ti[1]) < min(si[2], ti[2])
                if overlaps and not (sname == tname and si == ti):
                    raise ValueError(f"CUDA graph {sname} source overlaps reserved {tname} "
                                     "target; only exact same-source/same-target reuse is "
                                     "allowed.")

    def plan(self, qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, kv_len_arr: Tensor,
             num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int, causal: bool,
             sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype,
             use_profiler: bool = False) -> None:
        if self._use_cuda_graph and self.plans and self._backend not in ("fa2", "fa3"):
            raise RuntimeError(f"CUDA graph plans for backend {self._backend!r} cannot replan "
                               "because captured metadata pointers must remain stable.")
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}.")
        if kv_indptr.numel() < kv_len_arr.numel() + 1:
            raise ValueError("FA MLA requires KV offsets for every request.")
        if qo_indptr.numel() < kv_len_arr.numel() + 1:
            raise ValueError("FA MLA requires query offsets for every KV request.")
        self.host = (qo_indptr.to("cpu").tolist(), kv_indptr.to("cpu").tolist(),
                     kv_len_arr.to("cpu").tolist())
        if self._use_cuda_graph:
            self._graph_buffers((("qo_indptr", self._qo_indptr_buf, qo_indptr, False),
                                 ("kv_indptr", self._kv_indptr_buf, kv_indptr, False),
                                 ("kv_indices", self._kv_indices_buf, kv_indices, True),
                                 ("kv_len_arr", self._kv_len_arr_buf, kv_len_arr, False)))
            assert self._qo_indptr_buf is not None and self._kv_indptr_buf is not None
            assert self._kv_indices_buf is not None and self._kv_len_arr_buf is not None
            self._qo_indptr_buf.copy_(qo_indptr)
            self._kv_indptr_buf.copy_(kv_indptr)
            self._kv_indices_buf[: len(kv_indices)].copy_(kv_indices)
            self._kv_len_arr_buf.copy_(kv_len_arr)
        else:
            self._qo_indptr_buf, self._kv_indptr_buf = qo_indptr.clone(), kv_indptr.clone()
            self._kv_indices_buf, self._kv_len_arr_buf = kv_indices.clone(), kv_len_arr.clone()
        self._dims = (head_dim_ckv, head_dim_kpe)
        self._heads, self._page_size, self._causal = num_heads, page_size, causal
        self._sm_scale, self._dtypes = sm_scale, (q_data_type, kv_data_type)
        self.plans += 1

    def run(self, q_nope: Tensor | None = None, q_pe: Tensor | None = None,
            ckv_cache: Tensor | None = None, kpe_cache: Tensor | None = None,
            out: Tensor | None = None, lse: Tensor | None = None, return_lse: bool = False,
            **kw: Any) -> Any:
        if q_nope is None or q_pe is None:
            raise ValueError("q_nope and q_pe must both be provided.")
        if ckv_cache is None or kpe_cache is None:
            raise ValueError("ckv_cache and kpe_cache must both be provided.")
        if not self.plans:
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run() called before plan().")
        for name, (a, b), dt in (("query", (q_nope, q_pe), self._dtypes[0]),
                                 ("KV cache", (ckv_cache, kpe_cache), self._dtypes[1])):
            if a.ndim != 3 or b.ndim != 3:
                raise ValueError(f"split {name} tensors must have rank 3.")
            if a.shape[:-1] != b.shape[:-1]:
                raise ValueError(f"split {name} tensor shapes must match before the last axis.")
            if a.dtype != dt or b.dtype != dt:
                raise ValueError(f"{name} dtype {a.dtype} does not match the planned {dt}.")
            if (a.shape[-1], b.shape[-1]) != self._dims:
                raise ValueError(f"split {name} last dimensions do not match planned widths.")
        if out is not None and (out.shape != q_nope.shape or out.dtype != q_nope.dtype):
            raise ValueError(f"Invalid out: expected {tuple(q_nope.shape)} {q_nope.dtype}")
        if lse is not None and (tuple(lse.shape) != tuple(q_nope.shape[:2])
                                or lse.dtype != torch.float32):
            raise ValueError(f"Invalid lse: expected {tuple(q_nope.shape[:2])} float32")
        if q_nope.shape[1] != self._heads:
            raise RuntimeError(f"fake FlashInfer: q has {q_nope.shape[1]} heads, planned "
                               f"{self._heads}")
        self.runs.append({"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache,
                          "kpe_cache": kpe_cache})
        res, res_lse = self._compute(q_nope, q_pe, ckv_cache, kpe_cache)
        done = int(self._qo_indptr_buf[-1])  # type: ignore[index]
        if out is None:
            out = torch.full_like(q_nope, float("nan"))
        if lse is None:
            lse = torch.full(q_nope.shape[:2], float("nan"), dtype=torch.float32)
        out[:done] = res[:done].to(out.dtype)
        lse[:done] = res_lse[:done]
        return (out, lse) if return_lse else out

    def _compute(self, q_nope: Tensor, q_pe: Tensor, ckv: Tensor, kpe: Tensor
                 ) -> tuple[Tensor, Tensor]:
        assert self._qo_indptr_buf is not None and self._kv_indptr_buf is not None
        assert self._kv_indices_buf is not None and self._kv_len_arr_buf is not None
        qo, kv_ptr = self._qo_indptr_buf.tolist(), self._kv_indptr_buf.tolist()
        lens, idx = self._kv_len_arr_buf.tolist(), self._kv_indices_buf
        if q_nope.shape[0] < qo[-1]:
            raise RuntimeError(f"fake FlashInfer: q has {q_nope.shape[0]} rows, the plan "
                               f"computes {qo[-1]}: the kernel would read past q")
        p = self._page_size
        keys = torch.cat((ckv, kpe), -1).double().reshape(-1, ckv.shape[-1] + kpe.shape[-1])
        q = torch.cat((q_nope, q_pe), -1).double()
        h, lat = q.shape[1], ckv.shape[-1]
        out = torch.zeros(q.shape[0], h, lat, dtype=torch.float64)
        lse = torch.full((q.shape[0], h), float("-inf"), dtype=torch.float64)
        for i, n in enumerate(lens):
            pages = idx[kv_ptr[i]:kv_ptr[i + 1]].tolist()
            if n > len(pages) * p:
                raise RuntimeError(f"fake FlashInfer: kv_len_arr[{i}] = {n} needs "
                                   f"{-(-n // p)} pages, the row owns {len(pages)}: the "
                                   "kernel would read pages the row does not have")
            slots = [pages[t // p] * p + t % p for t in range(n)]
            k = keys[torch.tensor(slots, dtype=torch.int64)] if slots else keys[:0]
            nq = qo[i + 1] - qo[i]
            for j in range(nq):
                seen = min(n, n - nq + j + 1) if self._causal else n
                if seen <= 0:
                    continue
                s = q[qo[i] + j] @ k[:seen].T * self._sm_scale  # [H, seen]
                lse[qo[i] + j] = torch.logsumexp(s, -1)
                out[qo[i] + j] = torch.softmax(s, -1) @ k[:seen, :lat]
        return out, (lse / math.log(2.0)).float()

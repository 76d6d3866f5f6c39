"""CPU fakes of FlashInfer's CUDA-graph paged wrappers that check what the real ones check.

``BatchDecodeWithPagedKVCacheWrapper`` and ``BatchPrefillWithPagedKVCacheWrapper`` take the real
constructor, ``plan`` and ``run`` arguments and raise the real errors (type and message) on the
real conditions, as read from flashinfer-python 0.7.2.post1 (``decode.py``, ``prefill.py``,
``utils.py``): 16-byte aligned workspace, the buffers of CUDA-graph mode and their lengths, the
batch size fixed for life, ``paged_kv_indices`` within its buffer, the planned dtypes, and:

* prefill, CUDA-graph mode: the *first* plan's ``qo_indptr[-1]`` is the most rows any later plan
  may have; ``run`` requires ``q.shape[0] == qo_indptr[-1]`` of the latest plan;
* decode: ``run`` reads ``q.shape[0] // batch_size`` queries per row and the non-tensor-core
  kernel refuses more than one.

Two checks have no exception in FlashInfer and are made loud here: the float workspace must be
zero at the decode wrapper's first use (its docstring: "Must be initialized to 0 for its first
use"), and a decode ``q`` with fewer rows than the batch (the kernel would read past it).

Sliding windows: ``plan(window_left=)`` fixes the window (-1: none; a JIT flag of the kernel);
``run(window_left=)`` may only repeat it (FlashInfer's kernels assert it). A query at the end of
its row sees ``window_left`` keys before it and itself.

Softcapping: ``plan(logits_soft_cap=)`` (None or 0: off) caps the scaled scores. Sinks: the
decode wrapper's ``run(sinks=)`` applies them only on the ``trtllm-gen`` and ``cute-dsl``
backends and drops them on the others (as FlashInfer's ``decode.py`` forwards them); the prefill
wrapper's ``run`` has no such argument.

Head sizes: the prefill wrapper's ``plan(head_dim_qk, page_size, head_dim_vo=None)`` (None:
``head_dim_qk``) compiles a kernel for the pair, and its ``run`` allocates the output with
``v_cache``'s last dim; the ``cute-dsl`` backend raises ``NotImplementedError`` for a pair that
differs. The decode wrapper's ``plan`` takes one ``head_dim`` for q, k and v. A ``run`` whose q, k
or v head size is not the planned one has no exception in FlashInfer (the kernel reads rows of
the planned width) and is made loud here.

fp8 caches: ``plan``'s ``kv_data_type`` must be the cache's dtype (checked at ``run``), and
``run(q_scale=, k_scale=, v_scale=)`` are Python floats: ``q_scale`` and ``k_scale`` multiply the
softmax scale on the host, ``v_scale`` multiplies the output after the kernel, in its dtype.

Like a replayed graph, ``run`` computes from the wrapper's *buffers* (the pool's tensors it was
built on) with the SDPA adapter: a row with no pages has length 0 (FlashInfer's ``get_length``;
the prefill ``plan`` refuses such a row unless its ``kv_last_page_len`` is 0, see
:func:`_check_empty_rows`),
the log-sum-exp is base 2, and output rows past the computed ones are NaN (unwritten memory).
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
from torch import Tensor

from attnpool import Layout, PagedView
from attnpool.adapters import sdpa

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _canon(dtype: str | torch.dtype) -> torch.dtype:
    return _DTYPES[dtype] if isinstance(dtype, str) else dtype


def _aligned(x: Tensor, name: str) -> None:
    if x.numel() and x.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, got data_ptr % 16 = {x.data_ptr() % 16}")


def _layout(kv_layout: str) -> None:
    if kv_layout not in ("NHD", "HND"):
        raise KeyError(f"Invalid kv_layout {kv_layout}")


def _check_dtypes(q: Tensor, k: Tensor, dq: torch.dtype, dkv: torch.dtype) -> None:
    if q.dtype != dq:
        raise ValueError(f"The dtype of q {q.dtype} does not match the q_data_type {dq} "
                         "specified in plan function.")
    if k.dtype != dkv:
        raise ValueError(f"The dtype of k {k.dtype} does not match the kv_data_type {dkv} "
                         "specified in plan function.")


def _sm_scale(sm_scale: float, q_scale: object, k_scale: object) -> float:
    """``run``'s ``sm_scale *= q_scale; sm_scale *= k_scale`` on the host. The scales are typed
    ``Optional[float]``; the product is the kernel's ``double sm_scale`` argument, which takes a
    Python number, not a tensor (a tensor scale would turn the product into one)."""
    for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
        if s is None:
            continue
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"fake FlashInfer: {name} must be a Python float (Optional[float]); "
                            f"got {type(s).__name__}, which would reach the kernel's double "
                            "sm_scale argument")
        sm_scale *= s
    return sm_scale


def _scale_out(out: Tensor, v_scale: object) -> Tensor:
    """``run``'s ``out *= v_scale`` after the kernel, in the output's dtype."""
    if v_scale is None:
        return out
    if isinstance(v_scale, bool) or not isinstance(v_scale, (int, float)):
        raise TypeError(f"fake FlashInfer: v_scale must be a Python float (Optional[float]), got "
                        f"{type(v_scale).__name__}")
    out *= v_scale
    return out


def _compute(q: Tensor, k: Tensor, v: Tensor, qo: Tensor, indptr: Tensor, indices: Tensor,
             last: Tensor, causal: bool, scale: float, left: int = -1, softcap: float = 0.0,
             sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    bs, page, total = last.shape[0], k.shape[1], q.shape[0]
    q_lens = (qo[1:] - qo[:-1]).tolist()
    pages = (indptr[1:] - indptr[:-1]).tolist()
    view = PagedView(bs=bs, cache_seqlens=torch.zeros(bs, dtype=torch.int32), cu_seqlens_q=qo,
                     cu_seqlens_k=torch.zeros(bs + 1, dtype=torch.int32), page_table=None,
                     kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last,
                     max_seqlen_q=max([1, *q_lens]), max_seqlen_k=max([1, *pages]) * page,
                     page_size=page, causal=causal or left >= 0, window_left=left)
    got = sdpa.paged_attention(view, q.float(), k.float(), v.float(), softmax_scale=scale,
                               layout=Layout.FLASHINFER, softcap=softcap, sinks=sinks)
    done = torch.arange(total) < int(qo[-1])
    out = torch.where(done[:, None, None], got.out, float("nan")).to(q.dtype)
    lse = torch.where(done[:, None], got.lse / math.log(2.0), float("nan"))
    return out, lse


def _check_out(t: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """``run(out=, lse=)``: FlashInfer's ``check_shape_dtype_device`` on a given output."""
    if t is not None and (tuple(t.shape) != shape or t.dtype != dtype):
        raise ValueError(f"Invalid {name}: expected shape {shape} and dtype {dtype}, got "
                         f"{tuple(t.shape)} and {t.dtype}")


def _written(res: Tensor, res_lse: Tensor, out: Tensor | None, lse: Tensor | None, done: int,
             return_lse: bool) -> Any:
    """``run``'s result: into ``out`` / ``lse`` when given, where the kernel writes the ``done``
    rows it computes and nothing past them (they keep what they held)."""
    if out is not None:
        out[:done] = res[:done]
        res = out
    if lse is not None:
        lse[:done] = res_lse[:done]
        res_lse = lse
    return (res, res_lse) if return_lse else res


def _check_empty_rows(indptr: Tensor, last: Tensor) -> None:
    """The prefill plan's host lengths (``get_seq_lens``: ``max(pages - 1, 0) * P + last``) give a
    row with no pages ``last`` keys, which its Hopper kernels then read from ``kv_indices`` at the
    row's start, a page the row does not own (an illegal address when that entry is unwritten).
    The device side (``get_length``) says 0: only ``last = 0`` agrees."""
    pages = (indptr[1:] - indptr[:-1]).to("cpu")
    host_last = last.to("cpu")
    for i in range(len(host_last)):
        if int(pages[i]) == 0 and int(host_last[i]) != 0:
            raise RuntimeError(f"fake FlashInfer: row {i} owns no pages but kv_last_page_len is "
                               f"{int(host_last[i])}: the prefill plan takes its length as "
                               f"{int(host_last[i])} and the kernel reads a page it does not own")


def _check_dims(q: Tensor, k: Tensor, v: Tensor, qk: int, vo: int) -> None:
    got = (q.shape[-1], k.shape[-1], v.shape[-1])
    if got != (qk, qk, vo):
        raise RuntimeError(f"fake FlashInfer: q, k, v head sizes {got} differ from the planned "
                           f"{(qk, qk, vo)} (head_dim_qk, head_dim_qk, head_dim_vo); the kernel "
                           "would read rows of the planned width")


class _Wrapper:
    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str) -> None:
        _aligned(float_workspace_buffer, "float_workspace_buffer")
        _layout(kv_layout)
        self._float_workspace_buffer = float_workspace_buffer
        self._kv_layout = kv_layout
        self.plans = 0

    def _planned(self, kw: dict[str, Any], head_dim: int) -> None:
        self._q_dtype = _canon(kw.get("q_data_type", "float16"))
        kvd = kw.get("kv_data_type")
        self._kv_dtype = self._q_dtype if kvd is None else _canon(kvd)
        sm = kw.get("sm_scale")
        self._sm_scale = 1.0 / math.sqrt(head_dim) if sm is None else sm
        self._window_left = int(kw.get("window_left", -1))
        self._softcap = float(kw.get("logits_soft_cap") or 0.0)
        self.plans += 1

    def _window(self, kw: dict[str, Any]) -> int:
        """``run``'s ``window_left``: None (the plan's) or the plan's value."""
        got = kw.get("window_left")
        if got is not None and got != self._window_left:
            raise RuntimeError(f"fake FlashInfer: run(window_left={got}) differs from the plan's "
                               f"{self._window_left} (the kernel asserts they match)")
        return self._window_left


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Tensor | None = None,
                 paged_kv_indices_buffer: Tensor | None = None,
                 paged_kv_last_page_len_buffer: Tensor | None = None, backend: str = "auto",
                 jit_args: Any = None) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self._backend = backend
        if use_cuda_graph:
            for name, t in (("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                            ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                            ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer)):
                if not torch.is_tensor(t):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            assert paged_kv_last_page_len_buffer is not None and paged_kv_indptr_buffer is not None
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            if len(paged_kv_indptr_buffer) != self._fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        else:
            self._fixed_batch_size = 0
        self._use_cuda_graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    def plan(self, indptr: Tensor, indices: Tensor, last_page_len: Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *args: Any, **kw: Any) -> None:
        _aligned(self._float_workspace_buffer, "float_workspace_buffer")
        if self.plans == 0 and bool((self._float_workspace_buffer != 0).any()):
            raise RuntimeError("fake FlashInfer: the float workspace must be initialized to 0 "
                               "for its first use (BatchDecodeWithPagedKVCacheWrapper docs)")
        batch_size = len(last_page_len)
        if self._use_cuda_graph:
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    "The batch size should be fixed in cudagraph mode, the runtime batch size "
                    f"{batch_size}  mismatches the batch size set during initialization "
                    f"{self._fixed_batch_size}")
            assert self._paged_kv_indices_buf is not None
            if len(indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The size of indices should be less than or equal to the "
                                 "allocated buffer")
            assert self._paged_kv_indptr_buf is not None
            assert self._paged_kv_last_page_len_buf is not None
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.clone()
            self._paged_kv_indices_buf = indices.clone()
            self._paged_kv_last_page_len_buf = last_page_len.clone()
        self._page_size = page_size
        self._head_dims = (head_dim, head_dim)
        self._planned(kw, head_dim)

    def run(self, q: Tensor, paged_kv_cache: tuple[Tensor, Tensor], *args: Any,
            q_scale: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, return_lse: bool = False,
            sinks: Tensor | None = None, out: Tensor | None = None, lse: Tensor | None = None,
            **kw: Any) -> Any:
        k, v = paged_kv_cache
        _check_dtypes(q, k, self._q_dtype, self._kv_dtype)
        _check_dims(q, k, v, *self._head_dims)
        _check_out(out, (*q.shape[:-1], v.shape[-1]), q.dtype, "out")
        _check_out(lse, tuple(q.shape[:-1]), torch.float32, "lse")
        if self._backend not in ("trtllm-gen", "cute-dsl"):
            sinks = None  # dropped: only those backends forward it
        assert self._paged_kv_last_page_len_buf is not None
        bs = self._paged_kv_last_page_len_buf.size(0)
        q_len_per_req = q.size(0) // bs
        if not self.use_tensor_cores and q_len_per_req > 1:
            raise ValueError(f"q implies q_len_per_req={q_len_per_req}, but the non-tensor-core "
                             "decode kernel only supports q_len_per_req=1.")
        if self.use_tensor_cores and q_len_per_req != 1:
            raise ValueError(f"q implies q_len_per_req={q_len_per_req} but plan() used 1; "
                             "re-plan with the matching q_len_per_req.")
        if q.size(0) < bs:
            raise RuntimeError(f"fake FlashInfer: q has {q.size(0)} rows for a batch of {bs}; the "
                               "kernel would read past q")
        sm_scale = _sm_scale(self._sm_scale, q_scale, k_scale)
        assert self._paged_kv_indptr_buf is not None and self._paged_kv_indices_buf is not None
        qo = torch.arange(bs + 1, dtype=torch.int32)
        res, res_lse = _compute(q, k, v, qo, self._paged_kv_indptr_buf,
                                self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf,
                                False, sm_scale, self._window(kw), self._softcap, sinks)
        return _written(_scale_out(res, v_scale), res_lse, out, lse, bs, return_lse)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def __init__(self, float_workspace_buffer: Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: Tensor | None = None,
                 paged_kv_indptr_buf: Tensor | None = None,
                 paged_kv_indices_buf: Tensor | None = None,
                 paged_kv_last_page_len_buf: Tensor | None = None,
                 custom_mask_buf: Tensor | None = None, mask_indptr_buf: Tensor | None = None,
                 backend: str = "auto", jit_args: Any = None, jit_kwargs: Any = None,
                 variant_owns_mask: bool = False) -> None:
        super().__init__(float_workspace_buffer, kv_layout)
        self._backend = backend
        if use_cuda_graph:
            for name, t in (("qo_indptr_buf", qo_indptr_buf),
                            ("paged_kv_indptr_buf", paged_kv_indptr_buf),
                            ("paged_kv_indices_buf", paged_kv_indices_buf),
                            ("paged_kv_last_page_len_buf", paged_kv_last_page_len_buf)):
                if not torch.is_tensor(t):
                    raise ValueError(f"{name} should be a torch.Tensor in CUDA graph mode")
            assert qo_indptr_buf is not None and paged_kv_indptr_buf is not None
            assert paged_kv_last_page_len_buf is not None
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1:
                raise ValueError("The length of paged_kv_indptr_buf should be batch_size + 1.")
            if len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise ValueError("The length of paged_kv_last_page_len_buf should be batch_size.")
        else:
            self._fixed_batch_size = 0
        self._use_cuda_graph = use_cuda_graph
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._max_total_num_rows: int | None = None

    def plan(self, qo_indptr: Tensor, paged_kv_indptr: Tensor, paged_kv_indices: Tensor,
             paged_kv_last_page_len: Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim_qk: int, page_size: int, head_dim_vo: int | None = None, *args: Any,
             causal: bool = False, **kw: Any) -> None:
        _aligned(self._float_workspace_buffer, "float_workspace_buffer")
        if head_dim_vo is None:
            head_dim_vo = head_dim_qk
        batch_size = len(qo_indptr) - 1
        host = qo_indptr.to("cpu")
        self._qo_indptr_last = int(host[-1])
        total_num_rows = self._qo_indptr_last
        if self._use_cuda_graph:
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total_num_rows
            elif total_num_rows > self._max_total_num_rows:
                raise ValueError(
                    f"The total number of rows in qo_indptr {total_num_rows} in cuda graph mode "
                    "cannot exceed the number of rows set during initialization "
                    f"{self._max_total_num_rows}.")
            if batch_size != self._fixed_batch_size:
                raise ValueError(
                    "The batch size should be fixed during the lifecycle of the wrapper in cuda "
                    f"graph mode, the runtime batch size {batch_size} mismatches the batch size "
                    f"{self._fixed_batch_size}  set during initialization.")
            assert self._paged_kv_indices_buf is not None
            if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            assert self._qo_indptr_buf is not None and self._paged_kv_indptr_buf is not None
            assert self._paged_kv_last_page_len_buf is not None
            self._qo_indptr_buf.copy_(qo_indptr)
            self._paged_kv_indptr_buf.copy_(paged_kv_indptr)
            self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len)
            self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices)
        else:
            self._qo_indptr_buf = qo_indptr.clone()
            self._paged_kv_indptr_buf = paged_kv_indptr.clone()
            self._paged_kv_indices_buf = paged_kv_indices.clone()
            self._paged_kv_last_page_len_buf = paged_kv_last_page_len.clone()
        _check_empty_rows(paged_kv_indptr, paged_kv_last_page_len)
        for i in range(batch_size):  # PrefillSplitQOKVIndptr
            if host[i + 1] < host[i]:
                raise RuntimeError(f"qo_indptr[{i + 1}]{int(host[i + 1])} - qo_indptr[{i}]"
                                   f"{int(host[i])} should be non-negative")
        if num_qo_heads % num_kv_heads:
            raise RuntimeError(f"num_qo_heads {num_qo_heads} should be divisible by num_kv_heads "
                               f"{num_kv_heads}")
        if self._backend == "cute-dsl" and head_dim_vo != head_dim_qk:
            raise NotImplementedError("cute-dsl backend requires head_dim_vo == head_dim_qk")
        self._causal = causal
        self._head_dims = (head_dim_qk, head_dim_vo)
        self._planned(kw, head_dim_qk)

    def run(self, q: Tensor, paged_kv_cache: tuple[Tensor, Tensor], *args: Any,
            q_scale: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, return_lse: bool = False, out: Tensor | None = None,
            lse: Tensor | None = None, **kw: Any) -> Any:
        k, v = paged_kv_cache
        _check_dtypes(q, k, self._q_dtype, self._kv_dtype)
        _check_dims(q, k, v, *self._head_dims)
        sm_scale = _sm_scale(self._sm_scale, q_scale, k_scale)
        _check_out(out, (*q.shape[:-1], v.shape[-1]), q.dtype, "out")
        _check_out(lse, tuple(q.shape[:-1]), torch.float32, "lse")
        if q.size(0) != self._qo_indptr_last:
            raise ValueError(
                f"q.shape[0] ({q.size(0)}) does not match qo_indptr[-1] ({self._qo_indptr_last}). "
                "For paged prefill, q must have shape [total_tokens, num_heads, head_dim] where "
                "total_tokens = qo_indptr[-1].")
        assert self._qo_indptr_buf is not None and self._paged_kv_indptr_buf is not None
        assert self._paged_kv_indices_buf is not None
        assert self._paged_kv_last_page_len_buf is not None
        res, res_lse = _compute(q, k, v, self._qo_indptr_buf, self._paged_kv_indptr_buf,
                                self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf,
                                self._causal, sm_scale, self._window(kw), self._softcap)
        return _written(_scale_out(res, v_scale), res_lse, out, lse,
                        int(self._qo_indptr_buf[-1]), return_lse)


def module() -> types.ModuleType:
    """A ``flashinfer`` module of these fakes (the two paged wrappers), to put in
    ``sys.modules`` in place of the real library."""
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        BatchDecodeWithPagedKVCacheWrapper)
    mod.BatchPrefillWithPagedKVCacheWrapper = (  # type: ignore[attr-defined]
        BatchPrefillWithPagedKVCacheWrapper)
    return mod

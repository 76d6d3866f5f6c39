"""FlashInfer adapter: CUDA-graph wrappers on the pool's FLASHINFER buffers, planned from views.

FlashInfer's wrappers in CUDA-graph mode (``use_cuda_graph=True``) keep the CSR buffers they were
constructed with (``kv_indptr [bs+1]``, ``kv_indices``, ``kv_last_page_len [bs]``, and for prefill
``qo_indptr [bs+1]``) and their batch size is fixed for life. A graph captured with a wrapper bakes
those addresses, so :class:`GraphWrappers` builds **one wrapper per (part, captured bs)** directly
on the view's tensors: slices of the same arena buffers, never copies. Before each replay the
phase's ``update_`` refills those slices and :meth:`GraphWrappers.plan` re-plans the wrapper from
the same view (FlashInfer's plan reads the CSR on the host: it syncs, and must run outside the
graph). Plan copies its arguments into the wrapper's buffers; since the arguments *are* those
buffers (same data, same offset) the copies are no-ops and nothing in the pool is rewritten.

Which wrapper: rows with one query each (``max_seqlen_q == 1``: decode, tree expand rows, encoder
cross, local decode) use ``BatchDecodeWithPagedKVCacheWrapper``; every other part (verify, tree
prefix passes with N or K queries, draft extend, local verify) uses
``BatchPrefillWithPagedKVCacheWrapper`` with ``qo_indptr = cu_seqlens_q`` and ``causal =
view.causal``.

Outputs follow the adapters' convention (``out [total_q, H, D]``, natural-log ``lse [total_q,
H]``): FlashInfer returns a base-2 log-sum-exp, which is multiplied by ``ln 2`` here.

Wrapper classes are imported lazily from ``flashinfer``; ``decode_cls`` / ``prefill_cls`` inject
others (tests use fakes to check the plumbing on CPU).
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, LayoutError
from ..views import PagedView
from .sdpa import Attn, cache_as_pages, check_qkv


class WrapperKind(enum.Enum):
    """FlashInfer wrapper family for a part."""

    DECODE = "BatchDecodeWithPagedKVCacheWrapper"
    PREFILL = "BatchPrefillWithPagedKVCacheWrapper"


def wrapper_kind(view: PagedView) -> WrapperKind:
    """DECODE for one query per row (``max_seqlen_q == 1``), else PREFILL."""
    return WrapperKind.DECODE if view.max_seqlen_q == 1 else WrapperKind.PREFILL


def _csr(view: PagedView) -> tuple[Tensor, Tensor, Tensor]:
    if not isinstance(view, PagedView):
        raise InputError(f"expected a PagedView part, got {type(view).__name__}")
    if view.kv_indptr is None or view.kv_indices is None or view.kv_last_page_len is None:
        raise LayoutError("FlashInfer reads CSR page lists: expected a view with kv_indptr, "
                          "kv_indices and kv_last_page_len (Layout.FLASHINFER), got one without")
    return view.kv_indptr, view.kv_indices, view.kv_last_page_len


def _cls(kind: WrapperKind, given: type[Any] | None) -> type[Any]:
    if given is not None:
        return given
    import flashinfer  # lazy: importing attnpool never imports flashinfer

    return getattr(flashinfer, kind.value)  # type: ignore[no-any-return]


def make_wrapper(
    view: PagedView,
    workspace: Tensor,
    *,
    kind: WrapperKind | None = None,
    kv_layout: str = "NHD",
    use_tensor_cores: bool = False,
    wrapper_cls: type[Any] | None = None,
) -> Any:
    """A CUDA-graph FlashInfer wrapper whose buffers are ``view``'s CSR tensors.

    Args:
        view: a part from ``pool.<phase>.view(bs)`` (call before capture).
        workspace: FlashInfer's float workspace (uint8, typically 128 MiB), shared by wrappers
            that never run concurrently.
        kind: wrapper family (default :func:`wrapper_kind`).
        kv_layout: ``"NHD"`` for a cache ``[num_pages, P, H_kv, D]`` (the adapters' layout).
        use_tensor_cores: decode wrappers only.
        wrapper_cls: the class to build (default: from ``flashinfer``).
    """
    indptr, indices, last = _csr(view)
    kind = kind or wrapper_kind(view)
    cls = _cls(kind, wrapper_cls)
    if kind is WrapperKind.DECODE:
        return cls(workspace, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                   paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                   paged_kv_last_page_len_buffer=last)
    return cls(workspace, kv_layout, use_cuda_graph=True, qo_indptr_buf=view.cu_seqlens_q,
               paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices,
               paged_kv_last_page_len_buf=last)


def plan(
    wrapper: Any,
    view: PagedView,
    *,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    sm_scale: float | None = None,
    kind: WrapperKind | None = None,
) -> None:
    """Plan ``wrapper`` (built by :func:`make_wrapper` on this view's buffers) for the batch the
    view now holds. Host-side and syncing: call after ``update_``, before replay."""
    indptr, indices, last = _csr(view)
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise InputError(f"num_qo_heads must be a multiple of num_kv_heads ({num_kv_heads}), "
                         f"got {num_qo_heads}")
    kind = kind or wrapper_kind(view)
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    common: dict[str, Any] = {
        "q_data_type": q_dtype, "kv_data_type": kv_dtype or q_dtype, "sm_scale": scale,
    }
    if kind is WrapperKind.DECODE:
        wrapper.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim,
                     view.page_size, **common)
    else:
        wrapper.plan(view.cu_seqlens_q, indptr, indices, last, num_qo_heads, num_kv_heads,
                     head_dim, view.page_size, causal=view.causal, **common)


def run(wrapper: Any, view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Attn:
    """Run a planned wrapper: ``(out [total_q, H, D], natural-log lse [total_q, H])``.

    The cache is read as pages of ``view.page_size`` tokens (token-slot expand parts read it as
    ``[tokens, 1, H_kv, D]``, no copy). ``q`` is the packed query buffer (``[bs, H, D]`` for a
    decode wrapper).
    """
    check_qkv(q, k_cache, v_cache)
    kv = (cache_as_pages(k_cache, view.page_size), cache_as_pages(v_cache, view.page_size))
    out, lse = wrapper.run(q, kv, return_lse=True)
    return Attn(out, lse * math.log(2.0))


class GraphWrappers:
    """One FlashInfer CUDA-graph wrapper per (pool part, captured batch size).

    ``wrapper(view)`` before capture creates (or returns) the wrapper for ``view``'s part and ``bs``;
    ``plan(view, ...)`` before each replay plans it; ``run(view, q, k, v)`` inside the graph calls
    it. Parts are told apart by the address of their ``kv_indptr`` buffer, so a tree verify's
    prefix and expand passes get separate wrappers, as do different batch sizes, while every
    wrapper sits on slices of the same arena buffers.

    Args:
        workspace: FlashInfer float workspace shared by all wrappers (they run one at a time).
        decode_cls, prefill_cls: wrapper classes to use instead of FlashInfer's.
        use_tensor_cores: passed to decode wrappers.
    """

    def __init__(self, workspace: Tensor, *, decode_cls: type[Any] | None = None,
                 prefill_cls: type[Any] | None = None, use_tensor_cores: bool = False) -> None:
        self.workspace = workspace
        self._cls = {WrapperKind.DECODE: decode_cls, WrapperKind.PREFILL: prefill_cls}
        self.use_tensor_cores = use_tensor_cores
        self._by_key: dict[tuple[int, int, WrapperKind], Any] = {}

    def _key(self, view: PagedView) -> tuple[int, int, WrapperKind]:
        indptr, _, _ = _csr(view)
        return (indptr.data_ptr(), view.bs, wrapper_kind(view))

    def wrapper(self, view: PagedView) -> Any:
        """The wrapper of ``view``'s part and batch size, created on first use."""
        key = self._key(view)
        w = self._by_key.get(key)
        if w is None:
            kind = key[2]
            w = make_wrapper(view, self.workspace, kind=kind, wrapper_cls=self._cls[kind],
                             use_tensor_cores=self.use_tensor_cores)
            self._by_key[key] = w
        return w

    def __len__(self) -> int:
        return len(self._by_key)

    def plan(self, view: PagedView, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
             sm_scale: float | None = None) -> Any:
        """Plan the wrapper of ``view`` (created by :meth:`wrapper` before capture) for the batch
        ``view`` now holds; returns it."""
        w = self._existing(view)
        plan(w, view, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
             q_dtype=q_dtype, kv_dtype=kv_dtype, sm_scale=sm_scale)
        return w

    def run(self, view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor) -> Attn:
        """Run the planned wrapper of ``view`` (safe inside a graph: creates nothing)."""
        return run(self._existing(view), view, q, k_cache, v_cache)

    def _existing(self, view: PagedView) -> Any:
        # Never create a wrapper here: construction allocates FlashInfer's int workspace and
        # pinned host memory, which must not happen inside a graph capture.
        w = self._by_key.get(self._key(view))
        if w is None:
            raise LayoutError(f"no wrapper was created for this part at bs={view.bs}; call "
                              "wrapper(view) on the capture view before capturing")
        return w

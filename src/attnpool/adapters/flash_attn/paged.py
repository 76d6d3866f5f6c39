"""flash-attn adapter: paged-kernel arguments from a view, FA3 scheduler metadata, the kernel call.

Three kernel generations share the argument names and differ in what they take:

* **FA3** (Hopper): packed queries with ``cu_seqlens_q`` / ``max_seqlen_q``, ``page_table``,
  ``cache_seqlens``, any page size, and an optional precomputed ``scheduler_metadata``. Every
  :class:`attnpool.PagedView` maps onto it, token-slot expand parts included (the cache is read as
  pages of one token). No pip package ships flash-attention's own FA3 module, so
  :func:`load_fa3` takes the first importable of the modules engines use (:data:`FA3_MODULES`)
  and the returned :class:`FlashKernel` says which one runs.
* **FA2** (``flash_attn``): queries ``[bs, seqlen_q, H, D]`` (the same count for every row),
  ``block_table``, ``cache_seqlens``; its paged path requires a page size that is a multiple of
  256 (its C++ entry point checks ``page_block_size % 256 == 0``), so other pages are refused here
  with :class:`attnpool.LayoutError` instead of failing inside the extension.
* **FA4** (``flash_attn.cute``, package ``flash-attn-4``, Hopper and Blackwell): packed queries,
  ``page_table``, ``seqused_k``, any page size, windows, softcap and ``learnable_sink``; its
  kernels JIT-compile on first use per variant. Arguments: :mod:`attnpool.adapters.flash_attn.cute`.

Graph safety: every metadata tensor in the built arguments *is* the view's tensor (a slice of the
pool's arena), never a copy, so a graph captured on them reads what the next ``update_`` writes.
``cu_seqlens_k_new`` is not passed: KV of new tokens is written into the cache by the engine before
attention, not by this call.

fp8 KV caches: FA3 reads ``float8_e4m3fn`` caches (no e5m2 kernels) and takes one dtype for q, k
and v, so ``q`` is cast to e4m3fn and the cache's ``k_scale`` / ``v_scale`` (float32 ``[1]`` or
``[H_kv]``) go to ``k_descale`` / ``v_descale`` as stride-0 ``[bs, H_kv]`` views, graph-safe without
a copy (:func:`attnpool.adapters.fp8.fa3_fp8_kwargs`); plan its scheduler with ``qkv_dtype=
torch.float8_e4m3fn``. FA2 has no fp8 KV: an fp8 cache is refused with a
:class:`attnpool.LayoutError`. Scales with a model-dtype cache are refused (:class:`InputError`).

K and V of different head sizes (``D != Dv``, ``KVCacheConfig(head_dim_v=)``): FA3 takes them
where its kernels exist, on Hopper only: ``D`` in (128, 192] with ``Dv`` in (96, 128] (DeepSeek's
192 / 128), or ``D <= 64`` with ``Dv <= 512`` (``Dv > 256`` not in fp8); its scheduler is planned
with ``headdim_v`` (:func:`scheduler_metadata_`'s ``head_dim_v``). Other pairs are refused with
:class:`attnpool.LayoutError` before the call (:data:`FA3_HEAD_DIMS`). FA2 (flash-attn 2.x's
``flash_attn_with_kvcache`` checks ``v_cache`` against the query's head size) is refused too: the
workaround engines use for its dense varlen path, zero-padding V to ``D`` and slicing the output,
would here copy a layer's whole paged V cache on every call, and a captured graph would read that
copy instead of the cache the engine writes. A cache that must serve FA2 stores V zero-padded to
``D`` (``head_dim_v = head_dim``) and the caller slices ``out[..., :Dv]``.

Outputs follow the adapters' convention, ``out [total_q, H, Dv]`` and natural-log ``lse [total_q,
H]`` (FA3 returns ``lse [H, total_q]``, FA2 ``[bs, H, seqlen_q]``), so tree passes merge with
:func:`attnpool.adapters.sdpa.merge_by_lse`. A row with no keys gets ``lse = +inf`` from flash-attn
(not ``-inf``); the merge treats both as empty. FA3's ``out`` has ``q.shape[0]`` rows and writes
only the rows of ``cu_seqlens_q[:bs+1]``: rows past ``cu_seqlens_q[bs]`` are left as allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import Tensor

from ...errors import InputError, LayoutError
from ...kv.quant import check_scales, is_fp8
from ...views import DraftExtendView, LocalView, PagedView
from ..fp8 import FA3_FP8, fa3_fp8_kwargs
from ..merge import Attn, run_passes
from ..sdpa.checks import check_qkv, softmax_scale_of
from ..sdpa.gather import cache_as_pages
from ..variants import check_sinks, check_softcap, sink_argument
from .cute import fa4_kwargs
from .load import CallStyle, FlashAttnVersion, FlashKernel, Kernel, pick_kernel
from .sched import _paged, kernel_seqlen_k, window_kwargs

if TYPE_CHECKING:
    from typing import Unpack

#: FA2's paged KV cache needs ``page_block_size % FA2_PAGE_MULTIPLE == 0``.
FA2_PAGE_MULTIPLE = 256
#: FA3's ``(D, Dv)`` ranges, ``lo < size <= hi``, where K and V head sizes may differ (Hopper):
#: its ``mha_fwd`` refuses every other pair with ``D != Dv``.
FA3_HEAD_DIMS: tuple[tuple[tuple[int, int], tuple[int, int]], ...] = (
    ((128, 192), (96, 128)),
    ((0, 64), (0, 512)),
)


def check_fa3_head_dims(d: int, dv: int, fp8: bool = False) -> None:
    """Refuse K / V head sizes FA3 has no kernel for, before the call (FA3's own check raises a
    RuntimeError from inside the extension): equal sizes always pass; different ones need one of
    :data:`FA3_HEAD_DIMS` (and fp16 / bf16 when ``Dv > 256``). FA3 also needs a Hopper GPU for
    them, which only the kernel can see.

    Raises:
        LayoutError: naming the pair and the ranges FA3 takes.
    """
    if d == dv:
        return
    ok = any(a < d <= b and c < dv <= e for (a, b), (c, e) in FA3_HEAD_DIMS)
    if not ok or (fp8 and dv > 256):
        why = ("fp8 needs Dv <= 256" if ok else "FA3 takes D != Dv only for D in (128, 192] with "
               "Dv in (96, 128], or D <= 64 with Dv <= 512 (Hopper)")
        raise LayoutError(f"flash-attn 3 has no kernel for K head size D={d} with V head size "
                          f"Dv={dv}: {why}; use FlashInfer's prefill wrapper (head_dim_vo) or "
                          "the sdpa adapter")


def fa3_kwargs(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    softmax_scale: float | None = None,
    return_softmax_lse: bool = True,
    scheduler_metadata: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    q_scale: Tensor | None = None,
    softcap: float = 0.0,
) -> dict[str, Any]:
    """Keyword arguments of FA3 ``flash_attn_with_kvcache`` for one paged part.

    Args:
        view: the part (its ``page_size`` may differ from the cache's: token-slot parts read the
            cache as pages of ``view.page_size`` tokens, see :func:`cache_as_pages`).
        q: packed ``[total_q, H, D]`` with at least ``cu_seqlens_q[bs]`` rows (the padded query
            buffer a graph reads is fine), last dim contiguous.
        k_cache, v_cache: ``[num_pages, P, H_kv, D]`` and ``[num_pages, P, H_kv, Dv]``; ``Dv != D``
            only where FA3 has kernels (:func:`check_fa3_head_dims`).
        scheduler_metadata: what :func:`scheduler_metadata_` returned for this view (omitted
            when None); planned with ``head_dim_v`` when ``Dv != D``.
        k_scale, v_scale: an fp8 cache's float32 ``[1]`` or ``[H_kv]`` scales, passed as
            ``k_descale`` / ``v_descale`` (:func:`~attnpool.adapters.fp8.fa3_fp8_kwargs`);
            omitted for a raw read.
        q_scale: the scale ``q`` is divided by when it is cast to fp8 (default 1), passed as
            ``q_descale``; fp8 caches only.
        softcap: logit softcapping, passed as ``softcap=`` when > 0 (0: off, not passed).
    """
    table = _paged(view)
    _, _, d = check_qkv(q, k_cache, v_cache)
    check_fa3_head_dims(d, v_cache.shape[3], is_fp8(k_cache.dtype))
    if q.stride(-1) != 1:
        raise InputError(f"q must have a contiguous last dim, got strides {q.stride()}")
    kw: dict[str, Any] = {
        "q": q,
        "k_cache": cache_as_pages(k_cache, view.page_size),
        "v_cache": cache_as_pages(v_cache, view.page_size),
        "page_table": table,
        "cu_seqlens_q": view.cu_seqlens_q,
        "max_seqlen_q": view.max_seqlen_q,
        **_shared_kwargs(view, d, softmax_scale, return_softmax_lse, softcap),
    }
    if scheduler_metadata is not None:
        kw["scheduler_metadata"] = scheduler_metadata
    kw.update(fa3_fp8_kwargs(view.bs, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale,
                         q_scale=q_scale))
    return kw


def fa3_varlen_kwargs(view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                      **options: Any) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``flash_attn_varlen_func`` (FA3) for one paged part: the
    same tensors as :func:`fa3_kwargs` (``options``: its keywords) under its names
    (``seqused_k``, ``block_table``), with ``max_seqlen_k`` = :func:`kernel_seqlen_k` and
    ``fa_version=3`` (the fp8 arguments keep their names)."""
    kw = fa3_kwargs(view, q, k_cache, v_cache, **options)
    kw["k"], kw["v"] = kw.pop("k_cache"), kw.pop("v_cache")
    kw["seqused_k"], kw["block_table"] = kw.pop("cache_seqlens"), kw.pop("page_table")
    kw["max_seqlen_k"] = kernel_seqlen_k(view)
    kw["fa_version"] = 3
    return kw


def fa2_kwargs(view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor, *,
               softmax_scale: float | None = None, return_softmax_lse: bool = True,
               softcap: float = 0.0) -> dict[str, Any]:
    """Keyword arguments of FA2 ``flash_attn_with_kvcache`` for one paged part.

    FA2 takes ``q [bs, seqlen_q, H, D]``: every row has ``seqlen_q = view.max_seqlen_q`` queries,
    so ``q`` must hold exactly ``bs * max_seqlen_q`` packed rows (it is reshaped, not copied).
    Views whose rows have varying query counts (draft extend, local verify) are refused, and so
    are fp8 caches (FA2's kernels take float16 / bfloat16 K/V only and have no descale argument)
    and K / V of different head sizes (see the module docstring: no padding is done here).

    Raises:
        LayoutError: page size not a multiple of 256, no page table, varying queries per row, an
            fp8 cache, or ``v_cache``'s head size differing from ``k_cache``'s.
        InputError: ``q`` rows do not match ``bs * max_seqlen_q``.
    """
    table = _paged(view)
    if is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype):
        raise LayoutError(f"flash-attn 2 has no fp8 KV cache (float16 / bfloat16 only), got "
                          f"{k_cache.dtype}; fp8 caches are read by FA3 (float8_e4m3fn), the "
                          "sdpa adapter and FlashInfer")
    if view.page_size % FA2_PAGE_MULTIPLE:
        raise LayoutError(f"flash-attn 2 paged KV needs page_size a multiple of "
                          f"{FA2_PAGE_MULTIPLE}, got {view.page_size}; use FA3 or the sdpa adapter")
    if isinstance(view, DraftExtendView) or (isinstance(view, LocalView)
                                             and view.rows_per_request > 1):
        raise LayoutError(f"flash-attn 2 needs the same query count in every row; "
                          f"{type(view).__name__} rows vary, use FA3 or the sdpa adapter")
    h, _, d = check_qkv(q, k_cache, v_cache)
    if v_cache.shape[3] != d:
        raise LayoutError(f"flash-attn 2 needs equal K and V head sizes, got D={d}, "
                          f"Dv={v_cache.shape[3]}: zero-padding V here would copy the whole paged "
                          "V cache per call (and a graph would read the copy); store V padded to "
                          "D (head_dim_v = head_dim) and slice the output, or use FA3 (Hopper, "
                          "D in (128, 192] with Dv in (96, 128]), FlashInfer or the sdpa adapter")
    sq = view.max_seqlen_q
    if q.shape[0] != view.bs * sq:
        raise InputError(f"q must have bs * max_seqlen_q = {view.bs * sq} rows, got {q.shape[0]}")
    if k_cache.shape[1] != view.page_size:
        raise LayoutError(f"k_cache page size must equal the view's ({view.page_size}), got "
                          f"{k_cache.shape[1]}")
    return {
        "q": q.view(view.bs, sq, h, d),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": table,
        **_shared_kwargs(view, d, softmax_scale, return_softmax_lse, softcap),
    }


def _shared_kwargs(view: PagedView, d: int, softmax_scale: float | None,
                   return_softmax_lse: bool, softcap: float) -> dict[str, Any]:
    """What FA2's and FA3's ``flash_attn_with_kvcache`` take under the same names: the lengths
    the kernel reads (``cache_seqlens``, the view's own buffer, so a graph replays the refill),
    the scale, causality, the window and the softcap."""
    return {
        "cache_seqlens": view.cache_seqlens,
        "softmax_scale": softmax_scale_of(softmax_scale, d),
        "causal": view.causal,
        "return_softmax_lse": return_softmax_lse,
        **window_kwargs(view),
        **_softcap_kwargs(softcap),
    }


def _softcap_kwargs(softcap: float) -> dict[str, Any]:
    """``softcap=`` when it is on (flash-attn's 0 is off: the off case passes nothing)."""
    cap = check_softcap(softcap)
    return {"softcap": cap} if cap else {}


def run(
    view: PagedView,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    version: FlashAttnVersion = FlashAttnVersion.FA3,
    softmax_scale: float | None = None,
    scheduler_metadata: Tensor | None = None,
    fn: Kernel | None = None,
    kernel: FlashKernel | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    q_scale: Tensor | None = None,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
) -> Attn:
    """Call the paged kernel on one part; return ``(out, lse)`` in the adapters' convention
    (``[total_q, H, Dv]``, ``[total_q, H]``; ``total_q = q.shape[0]``, FA2: ``bs * seqlen_q``).

    Args:
        kernel: the entry point (default :func:`load_fa3` / :func:`load_fa2`); its ``name`` says
            which module ran.
        fn: a bare ``flash_attn_with_kvcache``-style callable instead of ``kernel``.
        k_scale, v_scale, q_scale: an fp8 cache's scales (FA3 only, see
            :func:`~attnpool.adapters.fp8.fa3_fp8_kwargs`). FA3 computes in fp8 and returns
            bfloat16; ``out`` is cast back to ``q``'s dtype (one extra op for a float16 ``q``,
            none for bfloat16).
        softcap: logit softcapping (0: off), every generation alike.
        sinks: per-query-head sink logits ``[H]``, handed to the kernel's own argument: vLLM's
            FA3 build takes ``s_aux`` (bfloat16: cast once at load), sgl-kernel's ``sinks``,
            FA4 ``learnable_sink`` (float32, bfloat16 or float16).
            A build without one, and FA2, raise :class:`LayoutError` naming what is missing;
            so does ``s_aux`` with K and V of different head sizes (vLLM's build needs them
            equal).
    """
    k = pick_kernel(version, fn, kernel)
    if version is FlashAttnVersion.FA4:
        if scheduler_metadata is not None:
            raise InputError("scheduler_metadata is an FA3 argument, got one with FA4")
        kw = fa4_kwargs(view, q, k_cache, v_cache, softmax_scale=softmax_scale, softcap=softcap,
                        sinks=sinks)
        check_scales(k_cache.dtype, k_cache.shape[2], k_cache.device,
                     (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)), False)
        out, lse = k.fn(**kw)[:2]
        return Attn(out, lse.transpose(0, 1))
    if version is FlashAttnVersion.FA3:
        build = fa3_varlen_kwargs if k.style is CallStyle.VARLEN else fa3_kwargs
        kw = build(view, q, k_cache, v_cache, softmax_scale=softmax_scale,
                   scheduler_metadata=scheduler_metadata, k_scale=k_scale, v_scale=v_scale,
                   q_scale=q_scale, softcap=softcap)
        if sinks is not None:
            name = sink_argument(k.fn)
            if name is None:
                raise LayoutError(f"{k.name} has no attention-sink argument (vLLM's FA3 build "
                                  "takes s_aux, sgl-kernel's sinks); use such a build or the sdpa "
                                  "adapter, which applies sinks exactly from the log-sum-exp")
            if name == "s_aux" and k_cache.shape[-1] != v_cache.shape[-1]:
                raise LayoutError(f"{k.name}'s s_aux needs equal K and V head sizes, got "
                                  f"D={k_cache.shape[-1]}, Dv={v_cache.shape[-1]}; use the sdpa "
                                  "adapter, which applies sinks exactly from the log-sum-exp")
            kw[name] = check_sinks(sinks, q.shape[1], q.device,
                                   torch.bfloat16 if name == "s_aux" else None)
        out, lse, *_ = k.fn(**kw)
        if out.dtype != q.dtype and q.dtype != FA3_FP8:  # fp8 in, bfloat16 out
            out = out.to(q.dtype)
        return Attn(out, lse.transpose(0, 1))
    if scheduler_metadata is not None:
        raise InputError("scheduler_metadata is an FA3 argument, got one with FA2")
    if sinks is not None:
        raise LayoutError("flash-attn 2 has no attention-sink argument; use FA3 (vLLM's s_aux, "
                          "sgl-kernel's sinks), FlashInfer or the sdpa adapter")
    kw = fa2_kwargs(view, q, k_cache, v_cache, softmax_scale=softmax_scale, softcap=softcap)
    check_scales(k_cache.dtype, k_cache.shape[2], k_cache.device,
                 (("k_scale", k_scale), ("v_scale", v_scale), ("q_scale", q_scale)), False)
    out, lse = k.fn(**kw)[:2]
    bs, sq, h = out.shape[0], out.shape[1], out.shape[2]
    return Attn(out.reshape(bs * sq, h, out.shape[3]), lse.transpose(1, 2).reshape(bs * sq, h))


class RunOptions(TypedDict, total=False):
    """:func:`run`'s keyword options, which :func:`attention` takes too (typed for checkers
    through ``**opts: Unpack[RunOptions]``, checked by name at run time)."""

    version: FlashAttnVersion
    softmax_scale: float | None
    scheduler_metadata: Tensor | None
    fn: Kernel | None
    kernel: FlashKernel | None
    k_scale: Tensor | None
    v_scale: Tensor | None
    q_scale: Tensor | None
    softcap: float
    sinks: Tensor | None


_RUN_OPTIONS = frozenset(RunOptions.__annotations__)


def attention(view: object, q: Tensor, k_cache: Tensor, v_cache: Tensor,
              **opts: Unpack[RunOptions]) -> Attn:
    """:func:`run` for a :class:`PagedView`, or both passes of a tree
    :class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView` merged by log-sum-exp.

    ``scheduler_metadata`` applies to the first pass only (it is planned per part). ``k_scale``,
    ``v_scale``, ``q_scale``: an fp8 cache's scales, for every pass
    (:func:`~attnpool.adapters.fp8.fa3_fp8_kwargs`). ``softcap`` applies to every pass;
    ``sinks`` once per query row: a single pass hands them to the kernel, a tree's two passes
    run without them and the merged rows get them from the merged log-sum-exp
    (:func:`~attnpool.adapters.merge.run_passes`).
    """
    if not _RUN_OPTIONS.issuperset(opts):
        raise InputError(f"attention got unexpected keyword(s) {sorted(set(opts) - _RUN_OPTIONS)}"
                         f"; it takes {sorted(_RUN_OPTIONS)}")
    sched, sinks = opts.get("scheduler_metadata"), opts.get("sinks")

    def one(part: PagedView, first: bool, s: Tensor | None) -> Attn:
        each: RunOptions = {**opts, "scheduler_metadata": sched if first else None, "sinks": s}
        return run(part, q, k_cache, v_cache, **each)

    if sinks is not None and opts.get("version") is FlashAttnVersion.FA2:
        raise LayoutError("flash-attn 2 has no attention-sink argument; use FA3 (vLLM's s_aux, "
                          "sgl-kernel's sinks), FlashInfer or the sdpa adapter")
    return run_passes(view, one, check_sinks(sinks, q.shape[1], q.device, None))


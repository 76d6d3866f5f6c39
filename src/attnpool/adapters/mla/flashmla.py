"""FlashMLA's dense MLA decode kernel over a latent cache, fed from the pool's scheduler metadata.

FlashMLA (``flash_mla.flash_mla_with_kvcache``) computes absorbed MLA (:mod:`attnpool.adapters.mla`)
for ``s_q`` query rows per request from a paged latent cache, spread over ``num_sm_parts``
persistent parts by a schedule of the whole batch. The pool writes that schedule
(``PoolConfig(flashmla=FlashMLAConfig(...))``, docs/design.md, FlashMLA metadata) on every
update of decode and verify, so a captured graph reads the current step's schedule and nothing
is planned per call: :func:`flashmla_kwargs` passes only the view's tensors and cache views.

Two call forms, picked by the metadata's layout (``FlashMLAConfig.layout``):

* **Arguments** (``SchedLayout.ARGUMENTS``; FlashMLA before its scheduler object, and vLLM's
  build of that API): ``flash_mla_with_kvcache(q [b, s_q, h_q, 576], k_cache [num_blocks, 64,
  h_k, 576], block_table [b, max_blocks] int32, cache_seqlens [b] int32, head_dim_v=512,
  tile_scheduler_metadata [num_sm_parts, 8] int32, num_splits [b + 1] int32, softmax_scale,
  causal)``. The kernel takes ``num_sm_parts`` from the tensor. An idle part holds ``begin_req =
  bs``: deepseek-ai's release of this API skips only ``begin_req >= b``
  (``csrc/sm90/decode/dense/splitkv_mla.cu``), vLLM's build ``begin_req < 0 or begin_req >= b``
  (its planner's mark is -1, which the former would run), so ``bs`` is idle for both.
* **Scheduler object** (``SchedLayout.DECODING_SCHED_META``; FlashMLA's current API, the copy
  vLLM vendors, and ``sgl-flash-mla`` 1.0.0): ``tile_scheduler_metadata`` is a
  ``FlashMLASchedMeta``; when its
  ``tile_scheduler_metadata`` / ``num_splits`` tensors are set the C++ side uses them instead of
  planning (``csrc/api/dense_decode.h``), after checking ``[num_sm_parts, 8]`` with
  ``num_sm_parts`` from the device's SM count, and the Python side checks ``config`` against the
  call once ``have_initialized`` (upstream's; sgl-flash-mla's dense path does not).
  Each part is a ``DecodingSchedMeta`` (begin and end request,
  begin and end block, begin split, first / last request split, pad); the kernel skips a part
  with ``begin_req >= b`` (``b`` = the call's batch, padded rows included, so the pool writes
  ``bs`` there, never -1), and takes whether a request is split from the part's flags, not from
  ``num_splits``. The combine kernel returns early for a row of exactly one split; a padded row
  (0 splits) combines nothing: output 0, log-sum-exp ``+inf``.

  Builds of that API differ in two ways, both resolved once (per class, per entry point) from
  what the installed package declares. Its ``FlashMLASchedMeta.Config`` may declare more fields:
  ``sgl-flash-mla`` 1.0.0 requires ``enable_batch_invariant`` (its kernels' batch-invariant
  mode, off here, as the dense kernel has no such mode), so the config is built from the
  fields the class declares (a required one this adapter does not know is refused). And
  ``sgl-flash-mla`` keeps dense decoding only in its legacy extension (upstream removed it; the
  current kernels are sparse only): its ``flash_mla_with_kvcache`` asserts ``use_legacy=True``
  when ``indices is None``. So the default entry point is called with ``use_legacy=True`` when
  its signature has that parameter, never otherwise (other builds have no legacy side and no
  such parameter); a package whose ``has_legacy()`` is False (the legacy extension was not
  built, or did not load) is refused with its loader's reason before any call. A custom ``fn``
  of such a build must bind ``use_legacy=True`` itself (``functools.partial``).

Both kernels write the **natural-log** log-sum-exp ``[b, h_q, s_q]``: the unsplit path stores
``log(L) + m / log2(e)`` and the combine kernel ``lse_2 / log2(e)`` (``splitkv_mla.cu`` /
``splitkv_mla.cuh`` and ``mla_combine.cu`` / ``combine.cu``), so no conversion but its ``+inf``
for a row without keys, mapped to ``-inf`` like every adapter's.

Refused before the call (FlashMLA's C++ checks, and what the pool's schedule assumes): a view
without ``flashmla`` metadata, tree verify's expand pass and sliding-window parts (the SDPA
adapter, :mod:`attnpool.adapters.mla`, and FlashInfer's, :mod:`attnpool.adapters.mla.flashinfer`,
serve those), pages other than 64 tokens, latent 512 / rope 64 only, fp16 / bf16 queries and a
cache of the same dtype (fp8 is not served here), a head count other than the metadata's, and
``q`` rows other than ``bs * s_q`` (padded rows included, as a captured graph runs them).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...config import FLASHMLA_PAGE_SIZE, SchedLayout, num_sm_parts
from ...errors import InputError, LayoutError
from ...kv.mla_shape import MLAShape
from ...views import FlashMLAMetadata, PagedView, VerifyView
from ..merge import Attn
from .sdpa import check_shape, latent_kv, packed_q

#: FlashMLA's only latent and rope widths (``head_size_k == 576``, ``head_size_v == 512``)
LATENT, ROPE = 512, 64
_OTHERS = ("attnpool.adapters.mla (SDPA) or attnpool.adapters.mla.flashinfer (FlashInfer's MLA "
           "wrapper)")


def _part(view: object) -> tuple[PagedView, FlashMLAMetadata]:
    """The one paged part FlashMLA runs (decode, or chain verify's prefix) and its metadata."""
    if isinstance(view, VerifyView):
        if view.expand is not None:
            raise LayoutError("FlashMLA's decode kernel runs a tree verify's prefix pass only, "
                              f"not its expand pass (token rows, page_size 1); use {_OTHERS}")
        view = view.prefix
    if not isinstance(view, PagedView):
        raise InputError(f"expected a decode view or a chain verify view, got "
                         f"{type(view).__name__}")
    if view.window_left >= 0:
        raise LayoutError(f"FlashMLA's decode kernel has no sliding window (this part has "
                          f"window_left={view.window_left}); use {_OTHERS}")
    if view.flashmla is None:
        raise LayoutError("FlashMLA reads the pool's scheduler metadata: expected a view with "
                          "flashmla (a pool built with PoolConfig(flashmla=FlashMLAConfig(...)): "
                          "its decode view or chain verify view), got a part without it")
    if view.page_table is None or view.page_table.dtype != torch.int32:
        got = None if view.page_table is None else view.page_table.dtype
        raise LayoutError(f"FlashMLA reads an int32 page table (Layout.FLASH_ATTN), got {got}")
    if view.page_size != FLASHMLA_PAGE_SIZE:
        raise LayoutError(f"FlashMLA needs page_size={FLASHMLA_PAGE_SIZE}, got {view.page_size}")
    return view, view.flashmla


def _query(part: PagedView, f: FlashMLAMetadata, q: Tensor, shape: MLAShape,
           q_pe: Tensor | None) -> Tensor:
    """The packed query as ``[bs, s_q, H, 576]`` (a view of ``q`` when it is packed)."""
    if (shape.kv_lora_rank, shape.qk_rope_head_dim) != (LATENT, ROPE):
        raise LayoutError(f"FlashMLA takes kv_lora_rank {LATENT} and qk_rope_head_dim {ROPE} "
                          f"only, got {shape.kv_lora_rank} and {shape.qk_rope_head_dim}")
    cfg = f.config
    if cfg.fp8 or cfg.num_heads_k != 1:
        raise LayoutError(f"this adapter runs FlashMLA's bf16 / fp16 kernel over a one-head "
                          f"latent cache; the metadata was sized for fp8={cfg.fp8}, "
                          f"num_heads_k={cfg.num_heads_k}")
    qp = packed_q(q, shape, q_pe)
    if qp.dtype not in (torch.bfloat16, torch.float16):
        raise InputError(f"FlashMLA takes bfloat16 or float16 queries, got {qp.dtype}")
    h = qp.shape[1]
    if h != cfg.num_heads_q or num_sm_parts(cfg.num_sms, f.s_q * h) != f.num_sm_parts:
        raise InputError(f"the scheduler metadata was sized for num_heads_q={cfg.num_heads_q} "
                         f"({f.num_sm_parts} parts at s_q={f.s_q}), got q with {h} heads")
    rows = part.bs * f.s_q
    if qp.shape[0] != rows:
        raise InputError(f"q must have bs * s_q = {part.bs} * {f.s_q} = {rows} rows (padded "
                         f"rows included: FlashMLA takes a uniform [bs, s_q] batch), got "
                         f"{qp.shape[0]}")
    return qp.reshape(part.bs, f.s_q, h, qp.shape[2])


def _cache(kv_cache: Tensor, shape: MLAShape, dtype: torch.dtype) -> Tensor:
    kv, _ = latent_kv(kv_cache, shape)
    if kv.shape[1] != FLASHMLA_PAGE_SIZE:
        raise LayoutError(f"FlashMLA needs a cache of {FLASHMLA_PAGE_SIZE}-token pages, got "
                          f"{kv.shape[1]}")
    if kv.dtype != dtype:
        raise InputError(f"FlashMLA reads a cache of the queries' dtype {dtype} (an fp8 cache "
                         f"is not served by this adapter), got {kv.dtype}")
    if kv.stride(-1) != 1:
        raise InputError(f"FlashMLA reads a cache with a contiguous last dimension, got strides "
                         f"{kv.stride()}")
    return kv


def flashmla_kwargs(view: object, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
                    q_pe: Tensor | None = None, softmax_scale: float | None = None,
                    sched_meta_cls: type[Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of ``flash_mla_with_kvcache`` for a decode or chain verify view: the
    view's tensors themselves (graph-safe: nothing read back, no metadata allocated) and the
    cache itself. ``sched_meta_cls`` (``FlashMLASchedMeta``) is needed by, and only by, a view
    whose metadata is in ``SchedLayout.DECODING_SCHED_META``."""
    part, f = _part(view)
    s = check_shape(shape)
    q4 = _query(part, f, q, s, q_pe)
    kw: dict[str, Any] = {
        "q": q4, "k_cache": _cache(kv_cache, s, q4.dtype), "block_table": part.page_table,
        "cache_seqlens": part.cache_seqlens, "head_dim_v": LATENT,
        "softmax_scale": s.softmax_scale if softmax_scale is None else float(softmax_scale),
        "causal": part.causal}
    layout = f.config.layout
    if layout is SchedLayout.ARGUMENTS:
        if sched_meta_cls is not None:
            raise LayoutError("the view's FlashMLA metadata is in the argument layout "
                              "(SchedLayout.ARGUMENTS), which FlashMLA's scheduler-object API "
                              "does not read; build the pool with FlashMLAConfig(layout="
                              "SchedLayout.DECODING_SCHED_META)")
        kw["tile_scheduler_metadata"] = f.tile_scheduler_metadata
        kw["num_splits"] = f.num_splits
        return kw
    if sched_meta_cls is None:
        raise LayoutError("the view's FlashMLA metadata is a DecodingSchedMeta table "
                          "(SchedLayout.DECODING_SCHED_META), read through a FlashMLASchedMeta: "
                          "pass sched_meta_cls, or build the pool with the argument layout for "
                          "the argument-style API")
    _check_sms(f, q4.device)
    config = sched_meta_cls.Config(**_config_fields(sched_meta_cls.Config)(
        b=part.bs, s_q=f.s_q, h_q=q4.shape[2], page_block_size=FLASHMLA_PAGE_SIZE,
        h_k=1, causal=part.causal, is_fp8_kvcache=False, topk=None,
        extra_page_block_size=None, extra_topk=None, enable_batch_invariant=False))
    kw["tile_scheduler_metadata"] = sched_meta_cls(
        have_initialized=True, config=config, tile_scheduler_metadata=f.tile_scheduler_metadata,
        num_splits=f.num_splits)
    kw["num_splits"] = None
    kw["is_fp8_kvcache"] = False
    return kw


def _check_sms(f: FlashMLAMetadata, device: torch.device) -> None:
    """The scheduler-object API sizes its parts from the device's SM count: the pool's must be
    the same (a host property, no sync)."""
    if device.type != "cuda":
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if sms != f.config.num_sms:
        raise LayoutError(f"FlashMLA plans num_sm_parts from this device's {sms} SMs; the pool "
                          f"was built with FlashMLAConfig(num_sms={f.config.num_sms})")


#: ``FlashMLASchedMeta.Config`` class -> a function keeping the keywords it declares
_CONFIGS: dict[type[Any], Callable[..., dict[str, Any]]] = {}
#: (entry point, ``has_legacy``, ``FlashMLASchedMeta``) -> the entry point to call
_ENTRIES: dict[tuple[Any, Any, Any], Callable[..., Any]] = {}


def _config_fields(config_cls: type[Any]) -> Callable[..., dict[str, Any]]:
    """The keywords of ``config_cls`` (a ``FlashMLASchedMeta.Config``) among those the adapter
    knows, resolved once per class: builds declare different fields (``sgl-flash-mla`` adds
    ``enable_batch_invariant``)."""
    keep = _CONFIGS.get(config_cls)
    if keep is None:
        if dataclasses.is_dataclass(config_cls):
            fields = {x.name: x.default is dataclasses.MISSING
                      and x.default_factory is dataclasses.MISSING
                      for x in dataclasses.fields(config_cls) if x.init}
        else:
            fields = {p.name: p.default is p.empty
                      for p in inspect.signature(config_cls).parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        known = {"b", "s_q", "h_q", "page_block_size", "h_k", "causal", "is_fp8_kvcache", "topk",
                 "extra_page_block_size", "extra_topk", "enable_batch_invariant"}
        unknown = sorted(n for n, required in fields.items() if required and n not in known)
        if unknown:
            raise LayoutError(f"the installed FlashMLA's FlashMLASchedMeta.Config requires "
                              f"fields this adapter does not know: {unknown}")
        names = frozenset(fields)

        def keep(**kw: Any) -> dict[str, Any]:
            return {k: v for k, v in kw.items() if k in names}

        _CONFIGS[config_cls] = keep
    return keep


def _default(layout: SchedLayout) -> tuple[Callable[..., Any], type[Any] | None]:
    import flash_mla  # lazy: importing attnpool never imports FlashMLA
    from flash_mla import flash_mla_interface as api

    cls: type[Any] | None = getattr(api, "FlashMLASchedMeta", None)
    if (cls is None) != (layout is SchedLayout.ARGUMENTS):
        have = "scheduler-object" if cls is not None else "argument-style"
        raise LayoutError(f"the installed FlashMLA takes the {have} API, which does not read "
                          f"metadata in the layout {layout}; build the pool with "
                          f"FlashMLAConfig(layout=SchedLayout."
                          f"{'DECODING_SCHED_META' if cls is not None else 'ARGUMENTS'})")
    fn = flash_mla.flash_mla_with_kvcache
    has_legacy = getattr(flash_mla, "has_legacy", None)
    key = (fn, has_legacy, cls)
    entry = _ENTRIES.get(key)
    if entry is None:
        if has_legacy is not None and not has_legacy():
            why = getattr(getattr(flash_mla, "_loader", None), "_LEGACY_UNAVAILABLE", None)
            raise LayoutError("the installed FlashMLA has no legacy extension (flash_mla."
                              "has_legacy() is False), the only one with its dense decode "
                              f"kernel: {why or 'no reason given'}")
        try:
            legacy = "use_legacy" in inspect.signature(fn).parameters
        except (TypeError, ValueError):  # no signature to read: a build without that keyword
            legacy = False
        entry = functools.partial(fn, use_legacy=True) if legacy else fn
        _ENTRIES[key] = entry
    return entry, cls


def attention(view: object, q: Tensor, kv_cache: Tensor, shape: MLAShape, *,
              q_pe: Tensor | None = None, softmax_scale: float | None = None,
              fn: Callable[..., Any] | None = None,
              sched_meta_cls: type[Any] | None = None) -> Attn:
    """FlashMLA over a decode view or a chain verify view: ``Attn(out [T, H, 512], lse [T, H])``
    with ``T = bs * s_q`` (every row, padded ones included: their output is discarded).

    Args:
        view: ``pool.decode`` / ``pool.verify`` view of a pool with ``PoolConfig(flashmla=...)``.
        q: ``[T, H, 576]`` packed absorbed query, or ``[T, H, 512]`` with ``q_pe [T, H, 64]``.
        kv_cache: ``KVCachePool.kv_cache(layer)``, ``[num_pages, 64, 1, 576]``, q's dtype.
        shape: the layer's :class:`MLAShape`; ``softmax_scale`` defaults to its unabsorbed one.
        fn: the kernel entry point (default ``flash_mla.flash_mla_with_kvcache``, imported on
            first call, with ``use_legacy=True`` where it takes that keyword; the installed API
            must match the metadata's layout).
        sched_meta_cls: ``FlashMLASchedMeta`` for a custom ``fn`` of the scheduler-object API.
    """
    cls = sched_meta_cls
    if fn is None:
        fn, cls = _default(_part(view)[1].config.layout)
    out, lse = fn(**flashmla_kwargs(view, q, kv_cache, shape, q_pe=q_pe,
                                    softmax_scale=softmax_scale, sched_meta_cls=cls))
    b, s_q, h, dv = out.shape
    out = out.reshape(b * s_q, h, dv)
    lse = lse.transpose(1, 2).reshape(b * s_q, h)  # [b, h, s_q] -> rows in q's order
    return Attn(out, torch.where(lse == float("inf"), float("-inf"), lse))

"""CPU fakes of FlashMLA's dense decode call, ``flash_mla_with_kvcache``, in its two API forms.

* :class:`ArgumentAPI`: the argument-style interface (deepseek-ai/FlashMLA c28eca9,
  ``flash_mla/flash_mla_interface.py``) and the checks of its C++ entry ``fwd_kvcache_mla``
  (``csrc/pybind.cpp``); with ``vllm_build=True`` (default) the idle-part rule of vLLM's build of
  that API (a part with ``begin_req < 0`` or ``>= b`` is skipped, rows of at most one split are
  not combined), else deepseek-ai's (only ``begin_req >= b`` skipped, one split not combined).
* :class:`SchedMetaAPI`: the scheduler-object interface (FlashMLA after its PR #150:
  ``FlashMLASchedMeta``, ``csrc/api/dense_decode.h``), given the device's SM count; parts are
  ``DecodingSchedMeta`` rows, skipped when ``begin_req >= b``, split or not by their flags.
* :class:`SglSchedMetaAPI`: that interface as ``sgl-flash-mla`` 1.0.0 has it
  (``flash_mla/flash_mla_interface.py``): its ``FlashMLASchedMeta.Config`` requires
  ``enable_batch_invariant``, and dense decoding exists only on its legacy side
  (``use_legacy=True``, asserted when ``indices is None``; the legacy extension may be absent,
  ``has_legacy()``). :meth:`SglSchedMetaAPI.module` is a ``flash_mla`` module object of it.

Each asserts what its source checks (dtypes, contiguity, shapes, page size 64, head sizes 576 /
512, the scheduler tensors' shapes) and then runs the kernel's walk in float64: every part
covers requests ``begin..end``, blocks ``[begin_block, end_block)`` of the first and last one
and all blocks of the others; an unsplit request's result goes straight to the output, a split
one's to accumulator slot ``num_splits[i] + split`` (its first split in a part that begins
inside it is ``begin_split``), and the combine merges a row's ``num_splits[i+1] - num_splits[i]``
slots by log-sum-exp. Outputs and accumulators start as NaN (``torch.empty`` on a GPU), so a
row the schedule misses reads NaN; a row whose blocks are not covered exactly once (or a padded
row given any block) is set to NaN, so a wrong schedule fails a comparison. Causal rows are
aligned to the end of the keys (query ``j`` of ``s_q`` sees keys ``< len - (s_q - 1 - j)``).
The log-sum-exp is natural-log ``[b, h_q, s_q]``, ``+inf`` for no keys, as the kernels write it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import Tensor

from attnpool.update.reference.flashmla import SchedLayout, get_mla_metadata, num_sm_parts

NAN = float("nan")


def _check_common(q: Tensor, k_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
                  head_dim_v: int, heads_k: tuple[int, ...]) -> tuple[int, int, int, int]:
    assert q.dtype in (torch.bfloat16, torch.float16)
    assert k_cache.dtype == q.dtype, "query and key must have the same dtype"
    assert cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32"
    assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert len({t.device for t in (q, k_cache, block_table, cache_seqlens)}) == 1
    assert q.stride(-1) == 1, "q must have contiguous last dimension"
    assert k_cache.stride(-1) == 1, "kcache must have contiguous last dimension"
    assert cache_seqlens.is_contiguous()
    assert block_table.stride(-1) == 1, "block_table must have contiguous last dimension"
    b, s_q, h_q, d = q.shape
    assert d in heads_k, f"Only head_size_k in {heads_k} is supported"
    assert head_dim_v == 512, "Only head_size_v == 512 is supported"
    num_blocks, page, h_k = k_cache.shape[:3]
    assert page == 64, "Currently page_block_size must be 64"
    assert b > 0, "batch size must be positive"
    assert h_q % h_k == 0, "Number of heads in key/value must divide number of heads in query"
    q.view(b, s_q, h_k, h_q // h_k, d)  # what the entry does (raises where a view cannot)
    assert tuple(k_cache.shape) == (num_blocks, page, h_k, d)
    assert tuple(cache_seqlens.shape) == (b,)
    assert block_table.dim() == 2 and block_table.shape[0] == b
    assert h_k == 1, "this fake computes one KV head (MLA's latent cache)"
    return b, s_q, h_q, h_k


def _partial(q: Tensor, kv: Tensor, pages: list[int], n: int, lo: int, hi: int, scale: float,
             causal: bool) -> tuple[Tensor, Tensor]:
    """Request keys ``[lo, hi)`` (of ``n``): ``(o [s_q, h, 512], lse [s_q, h])`` float64, the
    output 0 and the log-sum-exp ``-inf`` where a query sees none of them."""
    s_q, h = q.shape[:2]
    o = torch.zeros(s_q, h, 512, dtype=torch.float64)
    lse = torch.full((s_q, h), float("-inf"), dtype=torch.float64)
    for j in range(s_q):
        top = min(hi, n - (s_q - 1 - j)) if causal else min(hi, n)
        if top <= lo:
            continue
        keys = kv[[pages[t // 64] for t in range(lo, top)], [t % 64 for t in range(lo, top)]]
        s = q[j] @ keys.T * scale  # [h, keys]
        lse[j] = torch.logsumexp(s, -1)
        o[j] = torch.softmax(s, -1) @ keys[:, :512]
    return o, lse


def _walk(q: Tensor, k_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, scale: float,
          causal: bool, parts: list[tuple[int, int, int, int, int, bool, bool]],
          num_splits: list[int], combine_if: Any) -> tuple[Tensor, Tensor]:
    """The kernel's walk over ``parts`` (begin, end, begin block, end block, begin split,
    first request unsplit, last request unsplit), then its combine."""
    b, s_q, h, _ = q.shape
    qf, kv = q.double(), k_cache.double()[:, :, 0]
    lens, table = cache_seqlens.tolist(), block_table.tolist()
    if causal and s_q == 1:
        causal = False  # what the entry does
    total = b + len(parts)
    out = torch.full((b, s_q, h, 512), NAN, dtype=torch.float64)
    lse = torch.full((b, s_q, h), NAN, dtype=torch.float64)
    acc_o = torch.full((total, s_q, h, 512), NAN, dtype=torch.float64)
    acc_lse = torch.full((total, s_q, h), NAN, dtype=torch.float64)
    seen: list[list[int]] = [[] for _ in range(b)]
    for begin, end, bblk, eblk, split, first_unsplit, last_unsplit in parts:
        assert begin >= 0 and end < b, f"a part spans requests {begin}..{end} of {b}"
        for i in range(begin, end + 1):
            lo = bblk if i == begin else 0
            hi = eblk if i == end else -(-lens[i] // 64)
            seen[i] += range(lo, hi)
            o, l2 = _partial(qf[i], kv, table[i], lens[i], lo * 64, hi * 64, scale, causal)
            unsplit = first_unsplit if i == begin else (last_unsplit if i == end else True)
            if unsplit:
                out[i], lse[i] = o, torch.where(l2 == float("-inf"), float("inf"), l2)
            else:
                slot = num_splits[i] + (split if i == begin else 0)
                acc_o[slot], acc_lse[slot] = o, l2
    for i in range(b):
        k = num_splits[i + 1] - num_splits[i]
        if combine_if(k):
            ls = acc_lse[num_splits[i]: num_splits[i + 1]]
            g = torch.logsumexp(ls, 0) if k else torch.full((s_q, h), float("-inf"), dtype=torch.float64)
            g = torch.where(g == float("-inf"), float("inf"), g)
            w = torch.exp(ls - g).nan_to_num(0.0) if k else ls
            out[i] = (w[..., None] * acc_o[num_splits[i]: num_splits[i + 1]]).sum(0)
            lse[i] = g
        want = list(range(-(-lens[i] // 64))) if k else []
        if sorted(seen[i]) != want:  # a block missed or twice, or a padded row given work
            out[i], lse[i] = NAN, NAN
    return out.to(q.dtype), lse.float().transpose(1, 2).contiguous()


class ArgumentAPI:
    """``flash_mla_with_kvcache`` taking ``tile_scheduler_metadata [parts, 8]`` and
    ``num_splits [b + 1]`` tensors (row: begin_req, begin_block, end_req, end_block,
    begin_split)."""

    def __init__(self, vllm_build: bool = True) -> None:
        self.vllm_build = vllm_build
        self.calls: list[dict[str, Any]] = []

    def flash_mla_with_kvcache(
        self, q: Tensor, k_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
        head_dim_v: int, tile_scheduler_metadata: Tensor, num_splits: Tensor,
        softmax_scale: float | None = None, causal: bool = False, is_fp8_kvcache: bool = False,
        indices: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        md, ns = tile_scheduler_metadata, num_splits
        self.calls.append({"q": q, "k_cache": k_cache, "block_table": block_table,
                           "cache_seqlens": cache_seqlens, "tile_scheduler_metadata": md,
                           "num_splits": ns, "softmax_scale": softmax_scale, "causal": causal})
        assert not is_fp8_kvcache and indices is None, "the fake runs the dense bf16 kernel"
        assert md.dtype == torch.int32, "tile_scheduler_metadata must have dtype int32"
        assert ns.dtype == torch.int32, "num_splits must have dtype int32"
        assert md.is_contiguous() and ns.is_contiguous()
        b = _check_common(q, k_cache, block_table, cache_seqlens, head_dim_v, (576,))[0]
        assert md.dim() == 2 and md.shape[1] == 8
        assert tuple(ns.shape) == (b + 1,)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        splits = ns.tolist()
        parts = []
        for br, bb, er, eb, sp, *_ in md.tolist():
            if br >= b or (self.vllm_build and br < 0):
                continue
            parts.append((br, er, bb, eb, sp, splits[br + 1] - splits[br] == 1,
                          splits[er + 1] - splits[er] == 1))
        return _walk(q, k_cache, block_table, cache_seqlens, scale, causal, parts, splits,
                     (lambda k: k > 1) if self.vllm_build else (lambda k: k != 1))


@dataclasses.dataclass
class FlashMLASchedMeta:
    """The scheduler object of FlashMLA's current interface (the same fields)."""

    @dataclasses.dataclass
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: int | None
        extra_page_block_size: int | None
        extra_topk: int | None

    have_initialized: bool = False
    config: Config | None = None
    tile_scheduler_metadata: Tensor | None = None
    num_splits: Tensor | None = None


class SchedMetaAPI:
    """``flash_mla_with_kvcache`` taking a :class:`FlashMLASchedMeta`, on a device of
    ``num_sms`` SMs (the C++ side sizes ``num_sm_parts`` from it)."""

    meta_cls: type[Any] = FlashMLASchedMeta

    def __init__(self, num_sms: int) -> None:
        self.num_sms = num_sms
        self.calls: list[dict[str, Any]] = []
        self.planned = 0  # calls that planned the schedule themselves (no tensors given)

    def flash_mla_with_kvcache(
        self, q: Tensor, k_cache: Tensor, block_table: Tensor | None,
        cache_seqlens: Tensor | None, head_dim_v: int, tile_scheduler_metadata: Any,
        num_splits: None = None, softmax_scale: float | None = None, causal: bool = False,
        is_fp8_kvcache: bool = False, indices: Tensor | None = None, **extra: Any,
    ) -> tuple[Tensor, Tensor]:
        assert indices is None and not is_fp8_kvcache and all(v is None for v in extra.values())
        return self._dense(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits, softmax_scale, causal, {})

    def _dense(self, q: Tensor, k_cache: Tensor, block_table: Tensor | None,
               cache_seqlens: Tensor | None, head_dim_v: int, meta: Any, num_splits: None,
               softmax_scale: float | None, causal: bool, more: dict[str, Any]
               ) -> tuple[Tensor, Tensor]:
        """The dense bf16 call; ``more``: the config fields past upstream's."""
        self.calls.append({"q": q, "k_cache": k_cache, "block_table": block_table,
                           "cache_seqlens": cache_seqlens, "sched_meta": meta,
                           "softmax_scale": softmax_scale, "causal": causal})
        assert isinstance(meta, self.meta_cls), \
            "tile_scheduler_metadata must be of type FlashMLASchedMeta"
        assert num_splits is None, "num_splits must be None"
        assert block_table is not None and cache_seqlens is not None
        want = self.meta_cls.Config(q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1],
                                    k_cache.shape[2], causal, False, None, None, None, **more)
        if meta.have_initialized:
            assert meta.config == want, f"sched_meta.config {meta.config} != the call's {want}"
        else:
            meta.have_initialized, meta.config = True, want
        b, s_q, h_q, h_k = _check_common(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                         (576, 512))
        parts_n = num_sm_parts(self.num_sms, s_q * h_q // h_k, h_k)
        md, ns = meta.tile_scheduler_metadata, meta.num_splits
        if md is None:
            md, ns = get_mla_metadata(cache_seqlens, parts_n,
                                      layout=SchedLayout.DECODING_SCHED_META)
            self.planned += 1
        assert md.dtype == torch.int32 and ns is not None and ns.dtype == torch.int32
        assert md.is_contiguous() and ns.is_contiguous()
        assert tuple(md.shape) == (parts_n, 8), \
            f"tile_scheduler_metadata must have shape ({parts_n}, 8), got {tuple(md.shape)}"
        assert tuple(ns.shape) == (b + 1,)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        parts = [(br, er, bb, eb, sp, not first, not last)
                 for br, er, bb, eb, sp, first, last, _ in md.tolist() if br < b]
        out, lse = _walk(q, k_cache, block_table, cache_seqlens, scale, causal, parts,
                         ns.tolist(), lambda k: k != 1)
        meta.tile_scheduler_metadata, meta.num_splits = md, ns
        return out, lse


@dataclasses.dataclass
class SglFlashMLASchedMeta(FlashMLASchedMeta):
    """``sgl-flash-mla`` 1.0.0's scheduler object: its config also requires
    ``enable_batch_invariant``."""

    @dataclasses.dataclass
    class Config(FlashMLASchedMeta.Config):
        enable_batch_invariant: bool


class SglSchedMetaAPI(SchedMetaAPI):
    """``sgl-flash-mla`` 1.0.0's ``flash_mla_with_kvcache`` (its signature; its dense path):
    dense decoding only with ``use_legacy=True``, which needs the legacy extension
    (``legacy=False``: a wheel without it, ``has_legacy()`` False)."""

    meta_cls = SglFlashMLASchedMeta
    LEGACY_UNAVAILABLE = "this wheel was built with FLASH_MLA_BUILD_LEGACY=0"

    def __init__(self, num_sms: int, legacy: bool = True) -> None:
        super().__init__(num_sms)
        self.legacy = legacy

    def has_legacy(self) -> bool:
        return self.legacy

    def module(self) -> types.ModuleType:
        """A ``flash_mla`` module object (its interface module too) of this fake."""
        mod = types.ModuleType("flash_mla")
        mod.flash_mla_with_kvcache = self.flash_mla_with_kvcache  # type: ignore[attr-defined]
        mod.FlashMLASchedMeta = SglFlashMLASchedMeta  # type: ignore[attr-defined]
        mod.has_legacy = self.has_legacy  # type: ignore[attr-defined]
        mod.flash_mla_interface = mod  # type: ignore[attr-defined]
        mod._loader = types.SimpleNamespace(  # type: ignore[attr-defined]
            _LEGACY_UNAVAILABLE=None if self.legacy else self.LEGACY_UNAVAILABLE)
        return mod

    def flash_mla_with_kvcache(  # type: ignore[override]
        self, q: Tensor, k_cache: Tensor, block_table: Tensor | None,
        cache_seqlens: Tensor | None, head_dim_v: int, tile_scheduler_metadata: Any,
        num_splits: None = None, softmax_scale: float | None = None, causal: bool = False,
        is_fp8_kvcache: bool | None = None, indices: Tensor | None = None,
        attn_sink: Tensor | None = None, extra_k_cache: Tensor | None = None,
        extra_indices_in_kvcache: Tensor | None = None, topk_length: Tensor | None = None,
        extra_topk_length: Tensor | None = None, enable_batch_invariant: bool = False,
        use_legacy: bool = False, kv_format: str | None = None,
        descale_q: Tensor | None = None, descale_k: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        assert isinstance(tile_scheduler_metadata, SglFlashMLASchedMeta), \
            "tile_scheduler_metadata must be of type FlashMLASchedMeta"
        assert num_splits is None, "num_splits must be None"
        if use_legacy and not self.legacy:  # get_ops(use_legacy)
            raise RuntimeError("The legacy FlashMLA kernels (SM90, ...) are not available: "
                               f"{self.LEGACY_UNAVAILABLE}.")
        if is_fp8_kvcache is None:
            is_fp8_kvcache = indices is not None
        assert indices is None, "the fake runs the dense bf16 kernel"
        assert use_legacy, (
            "Sparse attention is required: `indices` must be provided. Dense MLA decoding was "
            "removed from the current kernels; pass use_legacy=True to reach the legacy one")
        assert kv_format is None, "kv_format does not apply to dense decoding"
        assert not is_fp8_kvcache and descale_q is None and descale_k is None
        assert all(t is None for t in (attn_sink, extra_k_cache, extra_indices_in_kvcache,
                                       topk_length, extra_topk_length))
        return self._dense(q, k_cache, block_table, cache_seqlens, head_dim_v,
                           tile_scheduler_metadata, num_splits, softmax_scale, causal,
                           {"enable_batch_invariant": enable_batch_invariant})

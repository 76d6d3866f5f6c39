"""CPU fakes of flash-attn's paged entry points that check what the real ones check.

Each fake takes the real signature and raises the real error (type and message) on the real
condition, as read from the sources: flash-attention 2.8.x ``flash_attn_with_kvcache`` /
``mha_fwd_kvcache`` (FA2), flash-attention's Hopper ``flash_attn_interface`` and ``mha_fwd`` /
``mha_fwd_get_scheduler_metadata`` (FA3; sgl-kernel ships the same interface), and vLLM's
``vllm_flash_attn.flash_attn_varlen_func``. The result is computed with the SDPA adapter from the
arguments alone, laid out as the real kernel lays it out: ``lse = +inf`` for a row with no keys,
and output rows no batch row covers are left as allocated (NaN here, garbage on a GPU).

Modelled FA3 details (the parts the adapter must get right):

* ``scheduler_metadata`` length: ``int(needs_semaphore) + round_up(b, 4) * vectors`` with
  ``vectors = 3 + causal`` (prepare, split and sort vectors, plus the head-swizzle vector of causal
  parts) and ``needs_semaphore = arch >= 90 or num_splits > 1``; a causal part with one query per
  row counts as non-causal unless ``64 < headdim <= 128`` with a page table (FA3's own rule).
  ``mha_fwd`` recomputes the length for its call and checks it (``CHECK_SHAPE``).
* splits: FA3 picks ``num_splits`` from batch, heads and the KV bound. The kernel's bound is
  ``page_table.shape[1] * page_size``; the planner's is its ``max_seqlen_k`` argument. The fake uses
  a simplified heuristic with the same inputs, writes each row's planned split count into the
  metadata and, unlike FA3 (which silently runs a mismatched plan), raises when the kernel's own
  plan differs from the metadata's.
* sliding windows: ``window_size=(left, right)`` with ``causal`` sets ``right = 0``; a ``left``
  at or past ``seqlen_k - 1`` (the planner's ``max_seqlen_k``, the kernel's page-table bound) is
  no window (``-1``). A window makes the part "local": its metadata has no sort vector and has
  the head-swizzle one (``2 + (not local) + (causal or local)`` vectors), and its keys are the
  ``left`` before each query and the query's own.
* softcap: ``softcap > 0`` caps the scaled scores (``softcap * tanh(s / softcap)``) before the
  mask; 0 is off.
* sinks: only vLLM's build takes them (``flash_attn_varlen_func(s_aux=)``); its FA3 path checks a
  Hopper GPU, at most 64 query heads, equal Q/V head sizes, bfloat16 and shape ``(num_heads,)``.
  Upstream FA3's ``flash_attn_with_kvcache`` has no such argument.
* K and V of different head sizes: ``mha_fwd`` takes ``head_size_v = v.size(-1)`` and, when it
  differs from q's, only ``head_size`` in (128, 192] with ``head_size_v`` in (96, 128], or
  ``head_size <= 64`` with ``head_size_v <= 512`` (fp16 / bf16 past 256), on Hopper alone; v must
  be ``(num_pages, page_size, num_heads_k, head_size_v)``; the output has ``head_size_v``.
  ``get_scheduler_metadata(headdim_v=)`` (default ``headdim``) enters FA3's tile choice, so a
  plan for other head sizes is a different plan: the fake tags its metadata with the planned
  ``(headdim, headdim_v)`` and, unlike FA3 (which runs it), refuses a call with other sizes.
* fp8: q, k and v must share one dtype, ``float8_e4m3fn`` being the only fp8 one (sm90 and up),
  with head dims that are multiples of 16. Only then are ``q_descale`` / ``k_descale`` /
  ``v_descale`` read: each float32 with sizes ``(batch_size, num_heads_k)`` and any strides, as
  ``mha_fwd`` checks them; they scale the softmax scale (q and k) and the output (v) per row and
  KV head. The output is bfloat16.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor

from attnpool import PagedView
from attnpool.adapters import sdpa

NUM_SM = 132
BLOCK_N = 128  # KV block of the fake split heuristic


def dims_tag(headdim: int, headdim_v: int) -> int:
    """The fake's tag of a plan's head sizes, kept in the metadata after the split counts."""
    return headdim * 1024 + headdim_v


def check(cond: bool, msg: str) -> None:
    """``TORCH_CHECK``: a RuntimeError with the source's message."""
    if not cond:
        raise RuntimeError(msg)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def effective_causal(causal: bool, max_seqlen_q: int, headdim: int, paged: bool) -> bool:
    """FA3: with one query per row, causal is non-causal except for ``64 < hdim <= 128`` paged."""
    if max_seqlen_q == 1 and ((headdim <= 64 or headdim > 128) or not paged):
        return False
    return causal


def split_heuristic(heads_kv: int, seqlen_k: int) -> int:
    """Simplified split cap (varlen: FA3 plans as if batch were 1): grows with the KV bound."""
    n_blocks = -(-seqlen_k // BLOCK_N)
    return max(1, min(n_blocks // 2, NUM_SM // heads_kv, 128))


def window_left(window_size: Any, seqlen_k: int) -> int:
    """FA3's clamp: a left window covering the whole KV bound is no window."""
    left = -1 if window_size is None else int(window_size[0])
    return -1 if left >= seqlen_k - 1 else left


def metadata_size(b: int, causal_eff: bool, splits: int, arch: int, local: bool = False) -> int:
    needs_semaphore = arch >= 90 or splits > 1
    vectors = 2 + int(not local) + int(causal_eff or local)
    return int(needs_semaphore) + round_up(b, 4) * vectors


def _row_splits(cache_seqlens: Tensor, cap: int) -> Tensor:
    n_blocks = torch.div(cache_seqlens.to(torch.int64) + BLOCK_N - 1, BLOCK_N, rounding_mode="floor")
    return n_blocks.clamp(min=1, max=cap).to(torch.int32)


def _attend(q: Tensor, k: Tensor, v: Tensor, *, cache_seqlens: Tensor, cu_seqlens_q: Tensor,
            page_table: Tensor, causal: bool, scale: float,
            descales: tuple[Tensor | None, Tensor | None, Tensor | None] = (None, None, None),
            out_dtype: torch.dtype | None = None, left: int = -1, softcap: float = 0.0,
            sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """out [total_q, H, D] (``out_dtype``, default q's; NaN where no row covers), lse [total_q, H]
    (+inf if empty).

    ``descales``: FA3's ``(q_descale, k_descale, v_descale)``, each ``[b, H_kv]`` or None (1).
    As in FA3's kernel, row ``b``'s KV head ``j`` scales the softmax scale by ``q_descale[b, j] *
    k_descale[b, j]`` and the output by ``v_descale[b, j]``; here the first factor is folded
    into the float32 queries and the second applied to the float32 output before the cast.
    """
    bs, total = page_table.shape[0], q.shape[0]
    cu = cu_seqlens_q.to(torch.int64)
    q_lens = (cu[1:] - cu[:-1]).tolist()
    view = PagedView(
        bs=bs, cache_seqlens=cache_seqlens, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=torch.zeros(bs + 1, dtype=torch.int32), page_table=page_table,
        kv_indptr=None, kv_indices=None, kv_last_page_len=None,
        max_seqlen_q=max([1, *q_lens]), max_seqlen_k=page_table.shape[1] * k.shape[1],
        page_size=k.shape[1], causal=causal or left >= 0, window_left=left)
    qf = q.float()
    qd, kd, vd = descales
    per_q = _per_query(cu, total, q.shape[1], k.shape[2])
    if qd is not None or kd is not None:
        f = torch.ones(bs, k.shape[2])
        f = f * qd.float() if qd is not None else f
        f = f * kd.float() if kd is not None else f
        qf = qf * per_q(f)[..., None]
    got = sdpa.paged_attention(view, qf, k.float(), v.float(), softmax_scale=scale,
                               softcap=softcap, sinks=None if sinks is None else sinks.float())
    o = got.out if vd is None else got.out * per_q(vd.float())[..., None]
    covered = torch.zeros(total, dtype=torch.bool)
    covered[: min(int(cu[-1]), total)] = True
    out = torch.where(covered[:, None, None], o, float("nan")).to(out_dtype or q.dtype)
    lse = torch.where(torch.isneginf(got.lse), float("inf"), got.lse)
    return out, torch.where(covered[:, None], lse, float("nan"))


def _per_query(cu: Tensor, total: int, heads: int, heads_kv: int) -> Any:
    """``f [b, H_kv] -> [total, H]``: each query position's row and each query head's KV head
    (positions no row covers take the last row's value; they are NaN in the output anyway)."""
    row = torch.searchsorted(cu[1:], torch.arange(total), right=True).clamp(max=cu.numel() - 2)
    head_kv = torch.arange(heads) // (heads // heads_kv)
    return lambda f: f[row][:, head_kv]


def _descale(name: str, t: Tensor | None, q: Tensor, batch_size: int,
             num_heads_k: int) -> Tensor | None:
    """FA3's checks of one descale argument: ``CHECK_DEVICE``, ``CHECK_SHAPE(x, batch_size,
    num_heads_k)`` (sizes only: any strides, stride 0 included, are read as given), then
    ``data_ptr<float>()``, which refuses any dtype but float32."""
    if t is None:
        return None
    check(t.device == q.device, f"{name} must be on CUDA")
    check(tuple(t.shape) == (batch_size, num_heads_k),
          f"{name} must have shape (batch_size, num_heads_k)")
    dtype_name = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double"}
    check(t.dtype == torch.float32,
          f"expected scalar type Float but found {dtype_name.get(t.dtype, str(t.dtype))}")
    return t


class FA3:
    """One FA3 build: ``flash_attn_with_kvcache`` and ``get_scheduler_metadata``.

    Records every call in ``calls`` (name, keyword arguments) for the tests.
    """

    def __init__(self, arch: int = 90) -> None:
        self.arch = arch
        self.calls: list[tuple[str, dict[str, Any]]] = []

    # ---- get_scheduler_metadata -----------------------------------------------------------------
    def get_scheduler_metadata(
        self, batch_size: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_q: int,
        num_heads_kv: int, headdim: int, cache_seqlens: Tensor, qkv_dtype: torch.dtype = torch.bfloat16,
        headdim_v: int | None = None, cu_seqlens_q: Tensor | None = None,
        cu_seqlens_k_new: Tensor | None = None, cache_leftpad: Tensor | None = None,
        page_size: int | None = None, max_seqlen_k_new: int = 0, causal: bool = False,
        window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0,
        has_softcap: bool = False, num_splits: int = 0, pack_gqa: bool | None = None,
        sm_margin: int = 0,
    ) -> Tensor:
        self.calls.append(("get_scheduler_metadata", dict(locals())))
        check(qkv_dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
              "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
        check(num_heads_q % num_heads_kv == 0,
              "Number of heads in key/value must divide number of heads in query")
        splits = num_splits if num_splits > 0 else split_heuristic(num_heads_kv, max_seqlen_k)
        left = window_left(window_size, max_seqlen_k)
        ceff = left < 0 and effective_causal(causal, max_seqlen_q, headdim, page_size is not None)
        md = torch.full((metadata_size(batch_size, ceff, splits, self.arch, left >= 0),), 77,
                        dtype=torch.int32, device=cache_seqlens.device)
        md[:batch_size] = _row_splits(cache_seqlens[:batch_size], splits)
        md[batch_size] = dims_tag(headdim, headdim if headdim_v is None else headdim_v)
        if self.arch >= 90 or splits > 1:
            md[-1] = 0  # the tile-count semaphore, zeroed by the planner
        return md

    # ---- flash_attn_with_kvcache ----------------------------------------------------------------
    def flash_attn_with_kvcache(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
        v: Tensor | None = None, qv: Tensor | None = None, rotary_cos: Tensor | None = None,
        rotary_sin: Tensor | None = None, cache_seqlens: Tensor | int | None = None,
        cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
        page_table: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
        cu_seqlens_k_new: Tensor | None = None, max_seqlen_q: int | None = None,
        rotary_seqlens: Tensor | None = None, q_descale: Tensor | None = None,
        k_descale: Tensor | None = None, v_descale: Tensor | None = None,
        softmax_scale: float | None = None, causal: bool = False,
        window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0, softcap: float = 0.0,
        rotary_interleaved: bool = True, scheduler_metadata: Tensor | None = None,
        num_splits: int = 0, pack_gqa: bool | None = None, sm_margin: int = 0,
        return_softmax_lse: bool = False,
    ) -> Any:
        self.calls.append(("flash_attn_with_kvcache", dict(locals())))
        assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
        assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        assert isinstance(cache_seqlens, Tensor) and page_table is not None  # the paths modelled
        out, lse = self.mha_fwd(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q,
                                seqused_k=cache_seqlens, max_seqlen_q=max_seqlen_q,
                                page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                                scheduler_metadata=scheduler_metadata, num_splits=num_splits,
                                q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                window_size=window_size, softcap=softcap)
        return (out, lse, torch.empty(0), torch.empty(0)) if return_softmax_lse else out

    def mha_fwd(self, q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens_q: Tensor | None,
                seqused_k: Tensor, max_seqlen_q: int | None, page_table: Tensor,
                softmax_scale: float, causal: bool, scheduler_metadata: Tensor | None,
                num_splits: int, q_descale: Tensor | None = None,
                k_descale: Tensor | None = None, v_descale: Tensor | None = None,
                window_size: Any = None, softcap: float = 0.0,
                s_aux: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The C++ entry point's checks (paged KV, varlen q), in its order; then the result."""
        q_type = q.dtype
        check(q_type in (torch.float16, torch.bfloat16, torch.float8_e4m3fn),
              "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
        check(k.dtype == q_type, "query and key must have the same dtype")
        check(v.dtype == q_type, "query and value must have the same dtype")
        if self.arch < 90:
            check(q_type in (torch.float16, torch.bfloat16),
                  "FlashAttention on Ampere/Ada cards only supports fp16 and bf16 data type")
        for t in (q, k, v):
            check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        check(page_table.dtype == torch.int32, "page_table must have dtype torch.int32")
        check(page_table.stride(-1) == 1, "page_table must have contiguous last dimension")
        assert cu_seqlens_q is not None  # varlen q: the only layout the adapter builds
        check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
        check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype torch.int32")
        check(max_seqlen_q is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided")
        assert max_seqlen_q is not None
        batch_size = cu_seqlens_q.shape[0] - 1
        num_heads, head_size = q.shape[-2], q.shape[-1]
        page_size, num_heads_k = k.shape[1], k.shape[-2]
        seqlen_k = page_table.shape[1] * page_size
        check(batch_size == page_table.shape[0], "batch_size must be equal to batch_size_k")
        check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
        check(num_heads % num_heads_k == 0,
              "Number of heads in key/value must divide number of heads in query")
        head_size_v = v.shape[-1]
        if head_size_v != head_size:
            check((128 < head_size <= 192 and 96 < head_size_v <= 128)
                  or (head_size <= 64 and head_size_v <= 512),
                  "If V headdim is different from Q/K dim, we only support Q/K headdim in "
                  "(128, 192] and V headdim in (96, 128], or (Q/K <= 64 and V <= 512).")
            check(self.arch == 90, "Only Hopper supports different V headdim")
            if head_size_v > 256:
                check(q_type in (torch.float16, torch.bfloat16),
                      "HeaddimV > 256 requires fp16 and bf16 data type")
        check(q.dim() == 3, "q must have shape (total_q, num_heads, head_size)")
        check(k.shape == (k.shape[0], page_size, num_heads_k, head_size),
              "k must have shape (num_pages, page_size, num_heads_k, head_size)")
        check(v.shape == (k.shape[0], page_size, num_heads_k, head_size_v),
              "v must have shape (num_pages, page_size, num_heads_k, head_size_v)")
        check(seqused_k.dtype == torch.int32, "seqused_k must have dtype int32")
        check(seqused_k.is_contiguous(), "seqused_k must be contiguous")
        check(tuple(seqused_k.shape) == (batch_size,), "seqused_k must have shape (batch_size)")
        if s_aux is not None:  # vLLM's build
            check(self.arch == 90, "s_aux is only supported on Hopper")
            check(num_heads <= 64, "s_aux supports at most 64 heads")
            check(head_size == v.shape[-1], "s_aux needs head_size == head_size_v")
            check(s_aux.dtype == torch.bfloat16, "s_aux must have dtype bfloat16")
            check(tuple(s_aux.shape) == (num_heads,), "s_aux must have shape (num_heads)")
            check(s_aux.is_contiguous(), "s_aux must be contiguous")
        alignment = 16 if q_type == torch.float8_e4m3fn else 8
        check(head_size % alignment == 0, f"head_size should be a multiple of {alignment}")
        check(v.shape[-1] % alignment == 0, f"head_size_v should be a multiple of {alignment}")
        left = window_left(window_size, seqlen_k)
        causal_eff = left < 0 and effective_causal(causal, max_seqlen_q, head_size, True)
        splits = num_splits if num_splits > 0 else split_heuristic(num_heads_k, seqlen_k)
        if scheduler_metadata is not None:
            size = metadata_size(batch_size, causal_eff, splits, self.arch, left >= 0)
            check(tuple(scheduler_metadata.shape) == (size,),
                  "scheduler_metadata must have shape (metadata_size)")
            check(scheduler_metadata.is_contiguous(), "scheduler_metadata must be contiguous")
            check(scheduler_metadata.dtype == torch.int32,
                  "scheduler_metadata must have dtype int32")
            want = _row_splits(seqused_k, splits)
            tag = int(scheduler_metadata[batch_size])
            if tag != dims_tag(head_size, head_size_v):
                raise RuntimeError(
                    f"fake FA3: scheduler_metadata was planned for (headdim, headdim_v) = "
                    f"{divmod(tag, 1024)}, this call has ({head_size}, {head_size_v}); FA3 would "
                    "run the mismatched plan")
            if not torch.equal(scheduler_metadata[:batch_size], want):
                raise RuntimeError(
                    "fake FA3: scheduler_metadata plans splits "
                    f"{scheduler_metadata[:batch_size].tolist()}, this call's plan is "
                    f"{want.tolist()} (seqlen_k={seqlen_k}); FA3 would run the mismatched plan")
        descales: tuple[Tensor | None, ...] = (None, None, None)
        if q_type == torch.float8_e4m3fn:  # FA3 reads the descales only for fp8 inputs
            descales = tuple(_descale(name, t, q, batch_size, num_heads_k) for name, t in
                             (("q_descale", q_descale), ("k_descale", k_descale),
                              ("v_descale", v_descale)))
        out_type = torch.bfloat16 if q_type == torch.float8_e4m3fn else q_type
        out, lse = _attend(q, k, v, cache_seqlens=seqused_k, cu_seqlens_q=cu_seqlens_q,
                           page_table=page_table, causal=causal, scale=softmax_scale,
                           descales=descales, out_dtype=out_type,  # type: ignore[arg-type]
                           left=left, softcap=softcap, sinks=s_aux)
        return out, lse.t().contiguous()  # varlen: softmax_lse [num_heads, total_q]

    # ---- vLLM's flash_attn_varlen_func ----------------------------------------------------------
    def flash_attn_varlen_func(
        self, q: Tensor, k: Tensor, v: Tensor, max_seqlen_q: int, cu_seqlens_q: Tensor,
        max_seqlen_k: int, cu_seqlens_k: Tensor | None = None, seqused_k: Tensor | None = None,
        q_v: Tensor | None = None, dropout_p: float = 0.0, softmax_scale: float | None = None,
        causal: bool = False, window_size: list[int] | None = None, softcap: float = 0.0,
        alibi_slopes: Tensor | None = None, deterministic: bool = False,
        return_attn_probs: bool = False, block_table: Tensor | None = None,
        return_softmax_lse: bool = False, out: Tensor | None = None,
        scheduler_metadata: Tensor | None = None, q_descale: Tensor | None = None,
        k_descale: Tensor | None = None, v_descale: Tensor | None = None, num_splits: int = 0,
        fa_version: int = 2, s_aux: Tensor | None = None, cp_world_size: int = 1,
        cp_rank: int = 0, cp_tot_seqused_k: Tensor | None = None,
    ) -> Any:
        self.calls.append(("flash_attn_varlen_func", dict(locals())))
        assert cu_seqlens_k is not None or seqused_k is not None, \
            "cu_seqlens_k or seqused_k must be provided"
        assert cu_seqlens_k is None or seqused_k is None, \
            "cu_seqlens_k and seqused_k cannot be provided at the same time"
        assert block_table is None or seqused_k is not None, \
            "seqused_k must be provided if block_table is provided"
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        if fa_version == 2:  # FA2's paged varlen path
            check(block_table is None or k.shape[1] % 256 == 0,
                  "Paged KV cache block size must be divisible by 256")
            raise NotImplementedError("fake: only fa_version=3 is modelled")
        check(fa_version == 3, f"Unsupported FA version: {fa_version}")
        assert seqused_k is not None and block_table is not None  # the paths modelled
        o, lse = self.mha_fwd(q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                              max_seqlen_q=max_seqlen_q, page_table=block_table,
                              softmax_scale=softmax_scale, causal=causal,
                              scheduler_metadata=scheduler_metadata, num_splits=num_splits,
                              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                              window_size=window_size, softcap=softcap, s_aux=s_aux)
        return (o, lse) if return_softmax_lse else o

    def module(self, name: str, varlen: bool = False) -> types.ModuleType:
        """A module object exposing this build the way ``name`` does."""
        mod = types.ModuleType(name)
        if varlen:
            mod.flash_attn_varlen_func = self.flash_attn_varlen_func  # type: ignore[attr-defined]
        else:
            mod.flash_attn_with_kvcache = self.flash_attn_with_kvcache  # type: ignore[attr-defined]
        mod.get_scheduler_metadata = self.get_scheduler_metadata  # type: ignore[attr-defined]
        return mod


class FA2:
    """flash-attn 2.8.x ``flash_attn_with_kvcache`` (paged path) and its C++ checks: among them
    ``CHECK_SHAPE`` of both caches with q's head size, so K and V head sizes must be equal."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def flash_attn_with_kvcache(
        self, q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
        v: Tensor | None = None, rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None,
        cache_seqlens: Tensor | int | None = None, cache_batch_idx: Tensor | None = None,
        cache_leftpad: Tensor | None = None, block_table: Tensor | None = None,
        softmax_scale: float | None = None, causal: bool = False,
        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        rotary_interleaved: bool = True, alibi_slopes: Tensor | None = None, num_splits: int = 0,
        return_softmax_lse: bool = False,
    ) -> Any:
        self.calls.append(dict(locals()))
        assert k_cache.stride(-1) == 1, "k_cache must have contiguous last dimension"
        assert v_cache.stride(-1) == 1, "v_cache must have contiguous last dimension"
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        check(q.dtype in (torch.float16, torch.bfloat16),
              "FlashAttention only support fp16 and bf16 data type")
        check(k_cache.dtype == q.dtype, "query and key must have the same dtype")
        check(v_cache.dtype == q.dtype, "query and value must have the same dtype")
        for t in (q, k_cache, v_cache):
            check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        assert block_table is not None and isinstance(cache_seqlens, Tensor)  # paths modelled
        check(cache_batch_idx is None, "Paged KVcache does not support cache_batch_idx")
        check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        batch_size, seqlen_q, num_heads, head_size = q.shape
        page_block_size, num_heads_k = k_cache.shape[1], k_cache.shape[2]
        check(page_block_size % 256 == 0, "Paged KV cache block size must be divisible by 256")
        check(batch_size > 0, "batch size must be positive")
        check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
        check(num_heads % num_heads_k == 0,
              "Number of heads in key/value must divide number of heads in query")
        check(tuple(block_table.shape) == (batch_size, block_table.shape[1]),
              "block_table must have shape (batch_size, max_num_blocks_per_seq)")
        check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
        check(tuple(k_cache.shape) == (k_cache.shape[0], page_block_size, num_heads_k, head_size),
              "kcache must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)")
        check(tuple(v_cache.shape) == (k_cache.shape[0], page_block_size, num_heads_k, head_size),
              "vcache must have shape (num_blocks, page_block_size, num_heads_k, head_size_og)")
        check(tuple(cache_seqlens.shape) == (batch_size,), "seqlens_k must have shape (batch_size)")
        cu = torch.arange(0, (batch_size + 1) * seqlen_q, seqlen_q, dtype=torch.int32)
        seqlen_k = block_table.shape[1] * page_block_size
        left = -1 if window_size[0] >= seqlen_k else window_size[0]  # FA2's clamp
        out, lse = _attend(q.reshape(-1, num_heads, head_size), k_cache, v_cache,
                           cache_seqlens=cache_seqlens, cu_seqlens_q=cu, page_table=block_table,
                           causal=causal, scale=softmax_scale, left=left, softcap=softcap)
        out = out.view(batch_size, seqlen_q, num_heads, -1)
        lse = lse.view(batch_size, seqlen_q, num_heads).transpose(1, 2).contiguous()
        return (out, lse) if return_softmax_lse else out

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("flash_attn")
        mod.flash_attn_with_kvcache = self.flash_attn_with_kvcache  # type: ignore[attr-defined]
        return mod


def assert_close(a: Tensor, b: Tensor, rows: int) -> None:
    """bf16 results of the fake vs the SDPA adapter on the same inputs (float32 inside both)."""
    torch.testing.assert_close(a[:rows].float(), b[:rows].float(), atol=1e-2, rtol=1e-2)

"""Logit softcapping and attention sinks through every adapter.

The SDPA adapter is checked exactly against a dense float64 oracle that computes both the way
transformers' eager attention does (Gemma 2's ``softcap * tanh(scores / softcap)`` after the
scale; gpt-oss's sink column appended to the scores, softmaxed and dropped): every paged phase
view, a tree verify view whose two passes merge before the sink is applied once, and the window
part. The flash-attn and FlashInfer adapters pass each setting as the library takes it and agree
with the SDPA adapter through fakes that apply it as the kernels do; builds without a sink
argument, and FA2, are refused with the missing argument named. Bad values are refused before
anything runs.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, InputError, Layout, LayoutError, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import flashinfer as fi
from attnpool.adapters import sdpa
from attnpool.adapters.variants import with_sinks

from tests.helpers.batches import shuffled_table, tree_mask
from tests.helpers.dense import dense_attention
from tests.helpers.fakes_fa3 import FA2, FA3, assert_close
from tests.helpers.fakes_flashinfer import BatchDecodeWithPagedKVCacheWrapper as Decode
from tests.helpers.fakes_flashinfer import BatchPrefillWithPagedKVCacheWrapper as Prefill

C, ROWS, ND, H, H_KV, D, PAGE = 48, 5, 3, 4, 2, 8, 4
CAP = 0.7  # small, so that tanh bends the random scores


def _pool(**kw: Any) -> BufferPool:
    cfg = PoolConfig(max_bs=4, max_context_len=C, page_size=PAGE, device="cpu",
                     layout=kw.pop("layout", Layout.BOTH), num_draft_tokens=ND, pad_page=0, **kw)
    return BufferPool(cfg, poison=True)


def _table(rng: random.Random) -> Tensor:
    return shuffled_table(rng, ROWS, C, PAGE)


def _cache(dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    pages = ROWS * (C // PAGE) + 1
    return (torch.randn(pages, PAGE, H_KV, D, generator=g).to(dtype) * 2,
            torch.randn(pages, PAGE, H_KV, D, generator=g).to(dtype))


def _sinks(dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=dtype)


def _batch(rng: random.Random) -> tuple[list[int], list[int]]:
    return [rng.randint(1, C - ND) for _ in range(3)], rng.sample(range(ROWS), 3)


@pytest.mark.parametrize("what", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("phase", ["decode", "verify", "extend"])
def test_sdpa_equals_eager_attention(phase: str, what: str) -> None:
    rng = random.Random(f"{phase}{what}")
    pool = _pool(max_extend_tokens=12)
    table = _table(rng)
    k, v = _cache()
    seq, rows = _batch(rng)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    kw: dict[str, Any] = {"seq_lens": t(seq), "req_pool_indices": t(rows), "req_to_token": table}
    if phase == "decode":
        view: Any = pool.decode.update_(4, **kw)
        qs = [(i, s - 1) for i, s in enumerate(seq)]
    elif phase == "verify":
        view = pool.verify.update_(4, **kw)
        qs = [(i, s + j) for i, s in enumerate(seq) for j in range(ND)]
    else:
        ext = [min(s, 4) for s in seq]
        view = pool.extend.update_(4, **kw, extend_lens=t(ext))
        qs = [(i, s - e + j) for i, (s, e) in enumerate(zip(seq, ext, strict=True))
              for j in range(e)]
    cap = CAP if what != "sinks" else 0.0
    sinks = _sinks() if what != "softcap" else None
    x = torch.randn(64, H, D, dtype=torch.float64)
    keys = [[int(table[rows[i], kk]) for kk in range(p + 1)] for i, p in qs]
    want, want_lse = dense_attention(x, k, v, keys, softcap=cap, sinks=sinks)
    got = sdpa.attention(view, x, k, v, softcap=cap, sinks=sinks)
    out = sdpa.attention_out(view, x, k, v, softcap=cap, sinks=sinks)
    n = len(qs)
    torch.testing.assert_close(got.out[:n], want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got.lse[:n].double(), want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[:n], want, rtol=1e-10, atol=1e-10)
    plain = sdpa.attention_out(view, x, k, v)
    assert not torch.allclose(plain[:n], want)  # the variant changes the result


def test_tree_passes_apply_the_sink_once() -> None:
    """A tree verify view's prefix and expand passes merge over the union of their keys; the
    sink joins that one softmax, not each pass's."""
    rng = random.Random(7)
    pool = _pool(topk=2)
    table = _table(rng)
    k, v = _cache()
    seq, rows = _batch(rng)
    mask = tree_mask(3, ND)
    mask[:, 2, 1] = False  # draft 2 hangs off draft 0
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    view = pool.verify.update_(4, seq_lens=t(seq), req_pool_indices=t(rows), req_to_token=table,
                               tree_mask=mask)
    x = torch.randn(4 * ND, H, D, dtype=torch.float64)
    keys = [[int(table[rows[i], kk]) for kk in range(s)]
            + [int(table[rows[i], s + a]) for a in range(ND) if mask[i, j, a]]
            for i, s in enumerate(seq) for j in range(ND)]
    sinks = _sinks()
    want, _ = dense_attention(x, k, v, keys, softcap=CAP, sinks=sinks)
    got = sdpa.attention(view, x, k, v, softcap=CAP, sinks=sinks)
    # (the merge weighs the passes by their float32 log-sum-exp, the adapters' convention)
    torch.testing.assert_close(got.out[: 3 * ND], want, rtol=1e-6, atol=1e-6)
    # the output alone is one pass over both parts' keys (sdpa.tree): the sink joins it once
    one = sdpa.attention_out(view, x, k, v, softcap=CAP, sinks=sinks)
    torch.testing.assert_close(one[: 3 * ND], want, rtol=1e-10, atol=1e-10)
    unsunk = sdpa.attention(view, x, k, v, softcap=CAP).out[: 3 * ND]
    twice = torch.stack([with_sinks(p.out, p.lse, sinks)[0] for p in (
        sdpa.paged_attention(view.prefix, x, k, v, softcap=CAP),
        sdpa.paged_attention(view.expand, x, k, v, softcap=CAP))])
    assert not torch.allclose(unsunk, want) and twice.shape[0] == 2


def test_window_part_with_softcap_and_sinks() -> None:
    rng = random.Random(8)
    pool = _pool(sliding_window=5)
    table = _table(rng)
    k, v = _cache()
    seq, rows = _batch(rng)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    view = pool.decode.update_(4, seq_lens=t(seq), req_pool_indices=t(rows), req_to_token=table)
    x = torch.randn(4, H, D, dtype=torch.float64)
    keys = [[int(table[rows[i], kk]) for kk in range(max(0, s - 5), s)] for i, s in enumerate(seq)]
    want, _ = dense_attention(x, k, v, keys, softcap=CAP, sinks=_sinks())
    got = sdpa.attention_out(view.window, x, k, v, softcap=CAP, sinks=_sinks())
    torch.testing.assert_close(got[:3], want, rtol=1e-10, atol=1e-10)


def test_sink_from_the_log_sum_exp_is_the_appended_column() -> None:
    """``out * sigmoid(lse - sink)`` with ``logaddexp(lse, sink)`` equals softmax over the
    scores with the sink appended, for finite rows and for a row with no keys."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(5, H, 7, generator=g, dtype=torch.float64)
    vals = torch.randn(5, 7, H, D, generator=g, dtype=torch.float64)
    sinks = _sinks(torch.float64)
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("thl,tlhd->thd", torch.softmax(s, -1), vals)
    got, got_lse = with_sinks(out, lse, sinks)
    full = torch.cat([s, sinks[None, :, None].expand(5, H, 1)], -1)
    want = torch.einsum("thl,tlhd->thd", torch.softmax(full, -1)[..., :-1], vals)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse.double(), torch.logsumexp(full, -1), rtol=1e-6, atol=1e-6)
    empty, empty_lse = with_sinks(torch.zeros(1, H, D), torch.full((1, H), float("inf")), sinks)
    assert torch.equal(empty, torch.zeros(1, H, D)) and torch.equal(empty_lse[0], sinks.float())


# ---- kernel adapters ----------------------------------------------------------------------------
def _verify_view(pool: BufferPool, rng: random.Random) -> Any:
    seq, rows = _batch(rng)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return pool.verify.update_(4, seq_lens=t(seq), req_pool_indices=t(rows),
                               req_to_token=_table(rng))


def test_flash_attn_softcap_and_s_aux() -> None:
    fake = FA3()
    vllm = fa.FlashKernel("vllm.vllm_flash_attn", fa.FlashAttnVersion.FA3, fa.CallStyle.VARLEN,
                          fake.flash_attn_varlen_func, fake.get_scheduler_metadata)
    pool = _pool(layout=Layout.FLASH_ATTN)
    view = _verify_view(pool, random.Random(1))
    k, v = _cache(torch.bfloat16)
    x = torch.randn(4 * ND, H, D).to(torch.bfloat16)
    sinks = _sinks(torch.bfloat16)
    got = fa.attention(view, x, k, v, kernel=vllm, softcap=CAP, sinks=sinks)
    call = fake.calls[-1][1]
    assert call["softcap"] == CAP and call["s_aux"] is sinks
    want = sdpa.attention(view, x.float(), k.float(), v.float(), softcap=CAP, sinks=sinks.float())
    assert_close(got.out, want.out, 9)
    assert "softcap" not in fa.fa3_kwargs(view.prefix, x, k, v)  # off: not passed at all
    with pytest.raises(InputError, match="bfloat16"):
        fa.attention(view, x, k, v, kernel=vllm, sinks=_sinks())  # float32: cast once at load


def test_flash_attn_builds_without_sinks_are_refused() -> None:
    fake = FA3()
    upstream = fa.FlashKernel("flash_attn_interface", fa.FlashAttnVersion.FA3,
                              fa.CallStyle.KVCACHE, fake.flash_attn_with_kvcache,
                              fake.get_scheduler_metadata)
    pool = _pool(layout=Layout.FLASH_ATTN)
    view = _verify_view(pool, random.Random(2))
    k, v = _cache(torch.bfloat16)
    x = torch.randn(4 * ND, H, D).to(torch.bfloat16)
    with pytest.raises(LayoutError, match="flash_attn_interface has no attention-sink argument"):
        fa.attention(view, x, k, v, kernel=upstream, sinks=_sinks(torch.bfloat16))
    got = fa.attention(view, x, k, v, kernel=upstream, softcap=CAP)
    assert fake.calls[-1][1]["softcap"] == CAP
    want = sdpa.attention(view, x.float(), k.float(), v.float(), softcap=CAP)
    assert_close(got.out, want.out, 9)
    with pytest.raises(LayoutError, match="flash-attn 2 has no attention-sink"):
        fa.attention(view, x, k, v, version=fa.FlashAttnVersion.FA2,
                     fn=FA2().flash_attn_with_kvcache, sinks=_sinks(torch.bfloat16))


def test_flashinfer_softcap_at_plan_and_sinks_on_a_sink_backend() -> None:
    pool = _pool(layout=Layout.FLASHINFER)
    rng = random.Random(3)
    seq, rows = _batch(rng)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    k, v = _cache(torch.bfloat16)
    for backend, ok in (("trtllm-gen", True), (None, False)):
        w = fi.GraphWrappers(torch.empty(256, dtype=torch.uint8), decode_cls=Decode,
                             prefill_cls=Prefill, backend=backend)
        cap = pool.decode.view(4)
        w.wrapper(cap)
        view = pool.decode.update_(4, seq_lens=t(seq), req_pool_indices=t(rows),
                                   req_to_token=_table(rng))
        wr = w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=torch.bfloat16,
                    softcap=CAP)
        assert wr._softcap == CAP
        x = torch.randn(4, H, D).to(torch.bfloat16)
        if not ok:
            with pytest.raises(LayoutError, match="cannot apply attention sinks"):
                w.run(view, x, k, v, sinks=_sinks())
            continue
        got = w.run(view, x, k, v, sinks=_sinks())
        want = sdpa.attention(view, x.float(), k.float(), v.float(), softcap=CAP, sinks=_sinks())
        assert_close(got.out, want.out, 3)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True, torch.tensor(1.0)])
def test_bad_softcap(bad: object) -> None:
    pool = _pool()
    view = pool.decode.view(2)
    k, v = _cache()
    with pytest.raises(InputError, match="softcap"):
        sdpa.attention(view, torch.zeros(2, H, D, dtype=torch.float64), k, v,
                       softcap=bad)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="softcap"):
        fa.fa3_kwargs(view, torch.zeros(2, H, D, dtype=torch.float64), k, v,
                      softcap=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad, msg", [
    (torch.zeros(3), r"shape \[4\]"),
    (torch.zeros(4, dtype=torch.int32), "floating point"),
    (torch.zeros(4, 2)[:, 0], "contiguous"),
    (torch.zeros(4, device="meta"), "on cpu"),
    ([0.0] * 4, "torch.Tensor"),
])
def test_bad_sinks(bad: object, msg: str) -> None:
    pool = _pool()
    view = pool.decode.view(2)
    k, v = _cache()
    with pytest.raises(InputError, match=msg):
        sdpa.attention(view, torch.zeros(2, H, D, dtype=torch.float64), k, v,
                       sinks=bad)  # type: ignore[arg-type]


def test_queries_without_keys_stay_zero_with_softcap_and_sinks() -> None:
    """FlashInfer-layout padded rows own no pages: their queries read no key, output 0, on the
    by-hand path that softcap and sinks take as on SDPA's own."""
    pool = _pool(layout=Layout.FLASHINFER)
    rng = random.Random(5)
    seq, rows = _batch(rng)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    view = pool.decode.update_(4, seq_lens=t(seq[:2]), req_pool_indices=t(rows[:2]),
                               req_to_token=_table(rng))
    k, v = _cache()
    x = torch.randn(4, H, D, dtype=torch.float64)
    for kw in ({}, {"softcap": CAP}, {"sinks": _sinks()}):
        out = sdpa.attention_out(view, x, k, v, **kw)
        assert torch.equal(out[2:], torch.zeros_like(out[2:])), kw

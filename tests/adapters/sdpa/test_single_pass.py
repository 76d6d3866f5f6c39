"""The SDPA adapter's single-pass path (attention_out, plan / run_plan) that the transformers
integration runs every layer: equal to dense attention and to the log-sum-exp path, and cheap.

* ``attention_out`` / ``run_plan`` match :func:`dense.dense_attention` (given each query's KV
  slots from ``req_to_token`` and the phase definition, never from the view) for decode, chain
  verify, draft extend and extend views, both layouts, GQA / MHA / MQA, poison-mode pools;
* one plan serves every layer: ``run_plan`` over two different caches equals a fresh
  ``paged_attention_out`` per cache exactly;
* a prefix-free prefill plan (SDPA's own causal mask) equals the masked plan;
* op counts: a decode layer issues no log-sum-exp, no ``repeat_interleave`` and no advanced
  indexing, and runs in a bounded number of aten ops.
"""

from __future__ import annotations

import random

import pytest
import torch

from attnpool import BufferPool, InputError, Layout, PagedView, PoolConfig, VerifyView
from attnpool.adapters.sdpa import attention, attention_out, paged_attention_out, plan, run_plan

from tests.helpers.batches import make_batch, tree_mask
from tests.helpers.dense import dense_attention
from tests.helpers.opcount import count

pytestmark = pytest.mark.usefixtures("one_thread")

C, ND, D = 96, 3, 8
ATOL, RTOL = 2e-5, 1e-4  # float32 adapter vs float64 oracle (see tests/adapters/sdpa/test_paged.py)
HEADS = [(4, 2), (2, 2), (6, 1)]


def _pool(page: int) -> BufferPool:
    cfg = PoolConfig(max_bs=5, max_context_len=C, page_size=page, device="cpu",
                     layout=Layout.BOTH, num_draft_tokens=ND, max_extend_tokens=5 * C, pad_page=1)
    return BufferPool(cfg, poison=True)


def _kv(table: torch.Tensor, page: int, h_kv: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = -(-(int(table.max()) + 1) // page) + 2
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages, page, h_kv, D, generator=g),
            torch.randn(pages, page, h_kv, D, generator=g))


def _rows(table: torch.Tensor, slot: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in table[slot, lo:hi]]


def _check(view: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           keys: list[list[int]], layouts: tuple[Layout, ...]) -> None:
    want, _ = dense_attention(q, k, v, keys)
    m = len(keys)
    for lay in layouts:
        got = attention_out(view, q, k, v, layout=lay)
        assert got.shape == q.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got[:m].double(), want, atol=ATOL, rtol=RTOL)
        lse_path = attention(view, q, k, v, layout=lay).out
        torch.testing.assert_close(got, lse_path, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("seed", range(2))
def test_single_pass_views_match_dense(page: int, heads: tuple[int, int], seed: int) -> None:
    rng = random.Random(seed)
    pool = _pool(page)
    h, h_kv = heads
    n, bs = 3, 5
    both = (Layout.FLASH_ATTN, Layout.FLASHINFER)
    # decode
    b = make_batch(pool.cfg, n, rng)
    t = b.req_to_token
    k, v = _kv(t, page, h_kv, seed)
    view = pool.decode.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens)
    q = torch.randn(bs, h, D)
    _check(view, q, k, v, [_rows(t, b.slots[i], 0, b.seq_lens[i]) for i in range(n)], both)
    # chain verify: N causal queries over seq_len + N
    b = make_batch(pool.cfg, n, rng, extra=ND, table=t)
    view_v = pool.verify.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens)
    q = torch.randn(bs * ND, h, D)
    keys = [_rows(t, b.slots[i], 0, b.seq_lens[i] + j + 1) for i in range(n) for j in range(ND)]
    _check(view_v, q, k, v, keys, both)
    # extend with a cached prefix: e new tokens after seq - e cached ones
    seq = [rng.randint(1, C) for _ in range(n)]
    ext = [rng.randint(1, s) for s in seq]
    sl = torch.tensor(seq)
    view_e = pool.extend.update_(n, seq_lens=sl, extend_lens=torch.tensor(ext),
                                 req_pool_indices=torch.tensor(b.slots), req_to_token=t,
                                 seq_lens_cpu=seq, extend_lens_cpu=ext)
    q = torch.randn(sum(ext), h, D)
    keys = [_rows(t, b.slots[i], 0, seq[i] - ext[i] + j + 1) for i in range(n)
            for j in range(ext[i])]
    _check(view_e, q, k, v, keys, both)
    # the same tokens as a prefix-free prefill (nothing cached): SDPA's causal mask
    view_p = pool.extend.update_(n, seq_lens=sl, extend_lens=sl,
                                 req_pool_indices=torch.tensor(b.slots), req_to_token=t,
                                 seq_lens_cpu=seq, extend_lens_cpu=seq)
    q = torch.randn(sum(seq), h, D)
    masked = plan(view_p, num_q=q.shape[0], num_heads=h, num_kv_heads=h_kv)
    free = plan(view_p, num_q=q.shape[0], num_heads=h, num_kv_heads=h_kv, prefix_free=True)
    assert free.allowed is None
    torch.testing.assert_close(run_plan(free, q, k, v), run_plan(masked, q, k, v), atol=ATOL,
                               rtol=RTOL)


def test_one_plan_serves_every_layer() -> None:
    rng = random.Random(7)
    pool = _pool(16)
    b = make_batch(pool.cfg, 4, rng)
    view = pool.decode.update_(5, **b.inputs(), seq_lens_cpu=b.seq_lens)
    q = torch.randn(4, 4, D)  # only the real rows' queries
    pl = plan(view, num_q=4, num_heads=4, num_kv_heads=2, dtype=torch.float32)
    for layer in range(2):
        k, v = _kv(b.req_to_token, 16, 2, layer)
        assert torch.equal(run_plan(pl, q, k, v), paged_attention_out(view, q, k, v))
    want = r"expected q \[4, 4, D\] and caches \[pages, P, 2, D\].*got q \(5, 4, 8\)"
    with pytest.raises(InputError, match=want):
        run_plan(pl, torch.randn(5, 4, D), k, v)
    with pytest.raises(InputError, match=r"built for torch\.float32"):
        run_plan(pl, q.double(), k.double(), v.double())
    with pytest.raises(InputError, match="prefix_free needs a causal multi-query view"):
        plan(view, num_q=4, num_heads=4, num_kv_heads=2, prefix_free=True)


def test_decode_layer_op_count() -> None:
    """What a decode layer costs on the host: no log-sum-exp, no K/V head copies, no advanced
    indexing (``index_select`` gathers), a bounded number of aten ops."""
    rng = random.Random(3)
    pool = _pool(16)
    b = make_batch(pool.cfg, 5, rng)
    view = pool.decode.update_(5, **b.inputs(), seq_lens_cpu=b.seq_lens)
    k, v = _kv(b.req_to_token, 16, 2, 0)
    q = torch.randn(5, 8, D)
    pl = plan(view, num_q=5, num_heads=8, num_kv_heads=2, dtype=torch.float32)
    layer = count(lambda: run_plan(pl, q, k, v))
    once = count(lambda: paged_attention_out(view, q, k, v))
    for c in (layer, once):
        names = " ".join(c.ops)
        for banned in ("logsumexp", "repeat_interleave", "aten.index.Tensor", "aten.exp"):
            assert banned not in names, (banned, dict(c.ops))
    assert layer.num_ops <= 18, dict(layer.ops)  # views included
    assert once.num_ops <= 40, dict(once.ops)


@pytest.mark.parametrize("phase", ["verify", "draft"])
@pytest.mark.parametrize("page", [1, 16])
def test_tree_is_one_pass(phase: str, page: int) -> None:
    """A tree verify and a tree draft step (prefix and expand parts) are one SDPA pass per layer
    (:mod:`attnpool.adapters.sdpa.tree`): the output of the two passes merged by log-sum-exp, with
    no log-sum-exp, merge or hand-computed softmax in the layer, from a plan built once."""
    rng = random.Random(page)
    steps, topk = 3, 2
    cfg = PoolConfig(max_bs=5, max_context_len=C, page_size=page, device="cpu",
                     layout=Layout.BOTH, num_draft_tokens=ND, topk=topk, spec_steps=steps,
                     pad_page=1)
    pool = BufferPool(cfg, poison=True)
    n, bs, h, h_kv = 3, 5, 4, 2
    b = make_batch(cfg, n, rng, extra=max(ND, steps * topk))
    k, v = _kv(b.req_to_token, page, h_kv, 0)
    view: object
    if phase == "verify":
        view = pool.verify.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens,
                                   tree_mask=tree_mask(n, ND, rng))
        rows = bs * ND
    else:
        tokens = k.shape[0] * page
        loc = torch.tensor([rng.randrange(page, tokens) for _ in range(n * steps * topk)],
                           dtype=torch.int64).view(n, steps, topk)
        view = pool.draft.update_(bs, **b.inputs(), seq_lens_cpu=b.seq_lens,
                                  out_cache_loc=loc).steps[1]
        rows = bs * topk
    q = torch.randn(rows, h, D)
    merged = attention(view, q, k, v).out
    pl = plan(view, num_q=rows, num_heads=h, num_kv_heads=h_kv, dtype=torch.float32)  # type: ignore[arg-type]
    torch.testing.assert_close(run_plan(pl, q, k, v), merged, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(attention_out(view, q, k, v), merged, atol=ATOL, rtol=RTOL)
    layer = count(lambda: run_plan(pl, q, k, v))
    names = " ".join(layer.ops)
    for banned in ("logsumexp", "aten.exp", "aten.bmm", "repeat_interleave"):
        assert banned not in names, (banned, dict(layer.ops))
    assert layer.num_ops <= 24, dict(layer.ops)
    with pytest.raises(InputError, match="prefix_free is for a causal prefill"):
        plan(view, num_q=rows, num_heads=h, num_kv_heads=h_kv, prefix_free=True)  # type: ignore[arg-type]


def test_plan_refuses_views_of_separate_attentions() -> None:
    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=C, page_size=1, device="cpu",
                                 num_draft_tokens=ND, spec_steps=2), poison=True)
    with pytest.raises(InputError, match="call it on each part"):
        plan(pool.draft.view(2), num_q=2, num_heads=2, num_kv_heads=2)  # type: ignore[arg-type]


def _part(lens: list[int], table: list[list[int]], queries: int, page: int, max_k: int
          ) -> PagedView:
    """A hand-built non-causal part (page-table layout): ``queries`` per row."""
    n = len(lens)
    seq = torch.tensor(lens, dtype=torch.int32)
    return PagedView(bs=n, cache_seqlens=seq,
                     cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32) * queries,
                     cu_seqlens_k=torch.cat((torch.zeros(1, dtype=torch.int32),
                                             seq.cumsum(0).to(torch.int32))),
                     page_table=torch.tensor(table, dtype=torch.int32), kv_indptr=None,
                     kv_indices=None, kv_last_page_len=None, max_seqlen_q=queries,
                     max_seqlen_k=max_k, page_size=page, causal=False)


def test_tree_lanes_without_keys_and_poison_ids() -> None:
    """A tree whose prefix or expand rows hold no keys (a draft step's prefix before its first
    full page) and whose unused page ids are poison: no poison id is used as an index, a query
    with no key at all gets output 0 (``keyed``), and the rest equal the two merged passes."""
    # request 0: no prefix key, its first query no expand key either; request 1: 6 keys
    pre = _part([0, 6], [[-7, 999999], [3, 5]], 2, 4, 8)
    exp = _part([0, 2, 1, 3], [[-1, -1, -1], [40, 41, -5], [42, 0, 0], [43, 44, 45]], 1, 1, 3)
    view = VerifyView(bs=2, prefix=pre, expand=exp)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(20, 4, 1, D, generator=g, dtype=torch.float64) for _ in range(2))
    q = torch.randn(4, 2, D, generator=g, dtype=torch.float64)
    pl = plan(view, num_q=4, num_heads=2, num_kv_heads=1, dtype=torch.float64)
    assert pl.keyed is not None and pl.keyed.view(-1).tolist() == [False, True, True, True]
    merged = attention(view, q, k, v).out
    for out in (run_plan(pl, q, k, v), attention_out(view, q, k, v)):
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        torch.testing.assert_close(out, merged, rtol=1e-12, atol=1e-12)

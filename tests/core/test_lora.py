"""LoRA batch buffers: loop-reference metadata, segmented matmul vs per-request matmuls, capture
with one adapter replayed with many, one copy per update, errors before any write."""

from __future__ import annotations

import random
import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpool import CapacityError, InputError, LayoutError, PoolError, ReadRegionError
from attnpool.lora import LoRABatchPool, LoRABatchView, LoRAConfig, lora_reference

from tests.helpers.opcount import OpRecorder


def cfg_(max_bs: int = 8, loras: int = 4, rank: int = 8, tokens: int = 3,
         out: tuple[int, ...] = ()) -> LoRAConfig:
    return LoRAConfig(max_bs=max_bs, max_loras_per_batch=loras, max_lora_rank=rank,
                      max_tokens_per_req=tokens, output_dims=out, device="cpu")


def loop_metadata(c: LoRAConfig, w: list[int], lens: list[int], ranks: list[int],
                  scal: list[float]) -> dict[str, list[float]]:
    """What every full-size buffer must hold, written as a plain loop."""
    n = len(w)
    seg = [lens[i] if i < n else 0 for i in range(c.max_bs)]
    indptr = [0]
    for x in seg:
        indptr.append(indptr[-1] + x)
    tok_adapter = [w[i] for i in range(n) for _ in range(lens[i])]
    perm = []
    for a in range(c.max_loras_per_batch):
        perm += [t for t, ta in enumerate(tok_adapter) if ta == a]
    perm += list(range(len(tok_adapter), c.max_tokens))
    pad = c.max_loras_per_batch - len(ranks)
    return {"seg_lens": seg, "seg_indptr": indptr,
            "weight_indices": [w[i] if i < n else 0 for i in range(c.max_bs)],
            "lora_ranks": ranks + [0] * pad, "scalings": scal + [0.0] * pad, "permutation": perm}


def loop_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: list[int], lens: list[int],
              ranks: list[int], scal: list[float]) -> torch.Tensor:
    """Per-request matmuls: request i's tokens times its adapter's A[:r], B[:, :r]."""
    y = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype)
    t = 0
    for i, wi in enumerate(w):
        r = ranks[wi]
        rows = x[t : t + lens[i]]
        y[t : t + lens[i]] = scal[wi] * (rows @ a[wi, :r].T) @ b[wi, :, :r].T
        t += lens[i]
    return y


def weights(c: LoRAConfig, ranks: list[int], din: int, dout: int, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A, B in float64 with NaN past each slot's rank (masking, not multiplying, must hide it)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(c.max_loras_per_batch, c.max_lora_rank, din, generator=g, dtype=torch.float64)
    b = torch.randn(c.max_loras_per_batch, dout, c.max_lora_rank, generator=g, dtype=torch.float64)
    for s in range(c.max_loras_per_batch):
        r = ranks[s] if s < len(ranks) else 0
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    return a, b


# ---- allocation, copies -----------------------------------------------------------------------
@pytest.mark.parametrize("poison", [False, True])
def test_one_allocation(poison: bool) -> None:
    rec = OpRecorder()
    with rec:
        pool = LoRABatchPool(cfg_(out=(16, 32)), poison=poison)
    factories = [op for op in rec.ops if re.match(r"aten\.(empty|zeros|ones|full|new_)", op)]
    assert factories == ["aten.empty.memory_format"], factories
    assert rec.storages <= {pool.storage.untyped_storage().data_ptr()}
    if not poison:
        assert not [op for op in rec.ops if "fill" in op or "zero" in op or "copy" in op]
    base = pool.storage.untyped_storage().data_ptr()
    for t in [*pool.buffers.values(), pool.output(8, 16), pool.output(8, 32)]:
        assert t.untyped_storage().data_ptr() == base
        assert (t.data_ptr() - pool.storage.data_ptr()) % 256 == 0
    assert pool.output(3, 32).shape == (9, 32)
    with pytest.raises(LayoutError, match="width 7"):
        pool.output(3, 7)


@pytest.mark.parametrize("staging", [False, True])
def test_update_is_one_copy_or_none(staging: bool) -> None:
    pool = LoRABatchPool(cfg_(), staging=staging)
    pool.view(6)  # views are built once per size and cached: a step creates no tensor at all
    rec = OpRecorder()
    with rec:
        v = pool.update_(6, [1, 3, 1], seg_lens=[2, 3, 1], lora_ranks=[8, 4, 0, 2],
                         scalings=[1.0, 0.5, 0.0, 2.0])
    # staging: the host image goes over in one copy; no staging (CPU): written in place, no op
    assert rec.ops == (["aten.copy_.default"] if staging else []), rec.ops
    assert v.seg_indptr.tolist() == [0, 2, 5, 6, 6, 6, 6]


# ---- metadata vs a loop -----------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_bs=st.integers(1, 10), loras=st.integers(1, 5), tokens=st.integers(1, 4),
       data=st.data(), staging=st.booleans())
def test_metadata_matches_loop(max_bs: int, loras: int, tokens: int, data: st.DataObject,
                               staging: bool) -> None:
    c = cfg_(max_bs=max_bs, loras=loras, tokens=tokens)
    pool = LoRABatchPool(c, poison=True, staging=staging)
    ranks = data.draw(st.lists(st.integers(0, c.max_lora_rank), max_size=loras))
    scal = data.draw(st.lists(st.floats(-4, 4, width=32), min_size=len(ranks),
                              max_size=len(ranks)))
    for _ in range(2):  # a second step with another batch overwrites the first completely
        bs = data.draw(st.integers(1, max_bs))
        w = data.draw(st.lists(st.integers(0, loras - 1), max_size=bs))
        lens = data.draw(st.lists(st.integers(0, tokens), min_size=len(w), max_size=len(w)))
        v = pool.update_(bs, w, seg_lens=lens, lora_ranks=ranks, scalings=scal)
        pool.check(v)
        want = loop_metadata(c, w, lens, ranks, scal)
        for name, t in pool.buffers.items():
            assert t.tolist() == want[name], name
        assert v.permutation.tolist() == want["permutation"][: bs * tokens]
        assert (v.max_len, v.max_rank, v.num_tokens) == (tokens, 8, bs * tokens)


def test_default_seg_lens_and_persistent_slot_table() -> None:
    c = cfg_(tokens=2)
    pool = LoRABatchPool(c)
    pool.update_(4, [0, 1], lora_ranks=[8, 2], scalings=[1.0, 0.25])
    v = pool.update_(4, [1, 1, 0])  # no slot table: the previous one stays
    assert v.seg_lens.tolist() == [2, 2, 2, 0]
    assert v.lora_ranks.tolist() == [8, 2, 0, 0] and v.scalings.tolist() == [1.0, 0.25, 0, 0]
    assert v.permutation.tolist() == [4, 5, 0, 1, 2, 3, 6, 7]


# ---- segmented matmul driven by the buffers ---------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(0, 8), pad=st.integers(0, 3),
       tokens=st.integers(1, 3))
def test_segmented_matmul_equals_per_request(seed: int, n: int, pad: int, tokens: int) -> None:
    c = cfg_(max_bs=10, loras=4, rank=8, tokens=tokens, out=(5,))
    rng = random.Random(seed)
    bs = max(1, min(10, n + pad))
    n = min(n, bs)
    ranks = [rng.randint(0, 8) for _ in range(4)]
    # the buffer holds float32 scalings: draw values float32 represents exactly
    scal = torch.tensor([rng.uniform(-2, 2) for _ in range(4)], dtype=torch.float32).tolist()
    w = [rng.randrange(4) for _ in range(n)]
    lens = [rng.randint(0, tokens) for _ in range(n)]
    pool = LoRABatchPool(c, poison=True)
    v = pool.update_(bs, w, seg_lens=lens, lora_ranks=ranks, scalings=scal)
    a, b = weights(c, ranks, 6, 5, seed)
    x = torch.randn(v.num_tokens, 6, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(seed))
    x[sum(lens) :] = float("nan")  # padded tokens hold garbage
    got = lora_reference(x, a, b, v)
    want = loop_lora(x, a, b, w, lens, ranks, scal)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_captured_with_one_adapter_replayed_with_many() -> None:
    """The view a graph captured (one adapter, full batch) serves a later padded multi-adapter
    batch: same tensors, same host bounds, and the result equals per-request matmuls."""
    c = cfg_(max_bs=8, loras=4, rank=8, tokens=2, out=(5,))
    pool = LoRABatchPool(c, poison=True)
    cap = pool.view(8)
    pool.check(cap)
    cap_state = (cap.max_len, cap.max_rank, cap.num_tokens,
                 [t.data_ptr() for t in (cap.seg_lens, cap.seg_indptr, cap.weight_indices,
                                         cap.lora_ranks, cap.scalings, cap.permutation)])
    pool.update_(8, [0] * 8, lora_ranks=[4], scalings=[1.0])  # capture-time batch: one adapter
    ranks, scal = [4, 8, 2, 6], [1.0, 0.5, -1.5, 2.0]
    w, lens = [2, 0, 3, 1, 2], [2, 1, 2, 0, 1]
    v = pool.update_(8, w, seg_lens=lens, lora_ranks=ranks, scalings=scal)
    assert v is cap
    assert (cap.max_len, cap.max_rank, cap.num_tokens,
            [t.data_ptr() for t in (cap.seg_lens, cap.seg_indptr, cap.weight_indices,
                                    cap.lora_ranks, cap.scalings, cap.permutation)]) == cap_state
    pool.check(cap)
    a, b = weights(c, ranks, 6, 5, 0)
    x = torch.randn(cap.num_tokens, 6, dtype=torch.float64)
    out = pool.output(8, 5)
    y = lora_reference(x.to(out.dtype), a.to(out.dtype), b.to(out.dtype), cap, out=out)
    assert y is out
    want = loop_lora(x, a, b, w, lens, ranks, scal)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


# ---- errors -----------------------------------------------------------------------------------
def _bad_calls(pool: LoRABatchPool) -> list[tuple[type[PoolError], str, Callable[[], object]]]:
    return [
        (CapacityError, "bs must", lambda: pool.update_(9, [0])),
        (CapacityError, "bs must", lambda: pool.update_(0, [])),
        (CapacityError, "more than bs", lambda: pool.update_(2, [0, 1, 2])),
        (CapacityError, "weight_indices\\[1\\]", lambda: pool.update_(4, [0, 4])),
        (CapacityError, "weight_indices\\[0\\]", lambda: pool.update_(4, [-1])),
        (InputError, "ints", lambda: pool.update_(4, [0.5])),
        (InputError, "1-D", lambda: pool.update_(4, [[0]])),
        (InputError, "host values", lambda: pool.update_(4, torch.zeros(1, device="meta"))),
        (InputError, "n=2", lambda: pool.update_(4, [0, 1], seg_lens=[1])),
        (CapacityError, "seg_lens\\[1\\]", lambda: pool.update_(4, [0, 1], seg_lens=[1, 4])),
        (CapacityError, "lora_ranks\\[0\\]", lambda: pool.update_(4, [0], lora_ranks=[9])),
        (CapacityError, "5 slots", lambda: pool.update_(4, [0], lora_ranks=[1] * 5)),
        (InputError, "finite", lambda: pool.update_(4, [0], scalings=[float("nan")])),
        (InputError, "finite", lambda: pool.update_(4, [0], lora_ranks=[2],
                                                    scalings=[float("inf")])),
        (InputError, "numbers", lambda: pool.update_(4, [0], scalings=["x"])),  # type: ignore
    ]


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("i", range(15))
def test_errors_leave_buffers_unchanged(i: int, staging: bool) -> None:
    pool = LoRABatchPool(cfg_(), poison=True, staging=staging)
    pool.update_(4, [1, 2], seg_lens=[3, 1], lora_ranks=[4, 8, 2], scalings=[1.0, 2.0, 3.0])
    before = pool.storage.clone()
    err, match, call = _bad_calls(pool)[i]
    with pytest.raises(err, match=match):
        call()
    assert torch.equal(pool.storage, before)
    v = pool.update_(4, [0])  # the slot table of the rejected call was not kept either
    assert v.lora_ranks.tolist() == [4, 8, 2, 0] and v.scalings.tolist() == [1.0, 2.0, 3.0, 0.0]


def test_config_errors() -> None:
    with pytest.raises(PoolError, match="max_loras_per_batch"):
        LoRAConfig(max_bs=4, max_loras_per_batch=0, max_lora_rank=8, device="cpu")
    with pytest.raises(PoolError, match="output_dims"):
        LoRAConfig(max_bs=4, max_loras_per_batch=2, max_lora_rank=8, output_dims=(8, 8),
                   device="cpu")
    with pytest.raises(PoolError, match="LoRAConfig"):
        LoRABatchPool(object())  # type: ignore[arg-type]


# ---- poison -----------------------------------------------------------------------------------
def test_poison_is_caught_and_rewritten() -> None:
    pool = LoRABatchPool(cfg_(), poison=True)
    v = pool.update_(5, [1, 0], seg_lens=[2, 3], lora_ranks=[2, 2], scalings=[1.0, 1.0])
    pool.check(v)
    pool.poison_()
    with pytest.raises(ReadRegionError):
        pool.check(v)
    cap = pool.view(5)  # rewrites the neutral state
    assert cap is v
    pool.check(cap)
    assert cap.seg_lens.tolist() == [0] * 5 and cap.weight_indices.tolist() == [0] * 5
    assert cap.permutation.tolist() == list(range(15))
    broken = LoRABatchView(2, v.seg_lens[:2], v.seg_indptr[:3], v.weight_indices[:2],
                           v.lora_ranks, v.scalings, v.permutation[:6].flip(0).clone() * 0, 6,
                           3, 8)
    with pytest.raises(ReadRegionError, match="permutation"):
        pool.check(broken)


# ---- CUDA (skipped without a GPU) -------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_pinned_staging_matches_cpu_over_many_steps() -> None:
    """Pinned, double-buffered staging: each step's device bytes equal a CPU pool's."""
    kw = {"max_bs": 32, "max_loras_per_batch": 4, "max_lora_rank": 16, "max_tokens_per_req": 2}
    gpu = LoRABatchPool(LoRAConfig(device="cuda", **kw), poison=True)  # type: ignore[arg-type]
    cpu = LoRABatchPool(LoRAConfig(device="cpu", **kw))  # type: ignore[arg-type]
    assert gpu.staging and all(img.is_pinned() for img in gpu._images)
    rng = random.Random(0)
    for step in range(6):
        bs = rng.randint(1, 32)
        w = [rng.randrange(4) for _ in range(rng.randint(0, bs))]
        lens = [rng.randint(0, 2) for _ in w]
        ranks = [rng.randint(0, 16) for _ in range(4)] if step % 2 == 0 else None
        gpu.update_(bs, w, lens, ranks, [1.0] * 4 if ranks else None)
        cpu.update_(bs, w, lens, ranks, [1.0] * 4 if ranks else None)
        torch.cuda.synchronize()
        for name, t in gpu.buffers.items():
            assert torch.equal(t.cpu(), cpu.buffers[name]), (step, name)


@pytest.mark.parametrize("staging", [False, True])
def test_token_budget_caps_tokens_not_segments(staging: bool) -> None:
    """``token_budget``: segments of up to ``max_tokens_per_req`` tokens each, at most the
    budget in all; the permutation (and a view's rows) are the budget, not ``max_bs`` times the
    segment bound; a batch over the budget is refused before any write."""
    c = LoRAConfig(max_bs=6, max_loras_per_batch=3, max_lora_rank=8, max_tokens_per_req=40,
                   token_budget=48, device="cpu")
    pool = LoRABatchPool(c, staging=staging)
    assert c.max_tokens == 48 and pool.buffers["permutation"].shape[0] == 48
    assert pool.view(6).num_tokens == 48 and pool.view(1).num_tokens == 40
    v = pool.update_(4, [2, 0, 1], [40, 3, 5], lora_ranks=[0, 8, 4], scalings=[0, 2.0, 1.0])
    pool.check(v)
    assert v.seg_indptr.tolist() == [0, 40, 43, 48, 48]
    before = pool.storage.view(torch.uint8).clone()
    with pytest.raises(CapacityError, match="sum to 49 tokens, more than the pool's "
                                            "max_tokens=48"):
        pool.update_(4, [2, 0, 1], [40, 4, 5])
    assert torch.equal(pool.storage.view(torch.uint8), before)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(PoolError):
            LoRAConfig(max_bs=2, max_loras_per_batch=1, max_lora_rank=1, token_budget=bad)


@pytest.mark.parametrize("staging", [False, True])
def test_host_view_is_the_last_update(staging: bool) -> None:
    """``host_view``: the last update's values on the host, the pool's own view without
    staging, the image that update sent with it (and no other update's)."""
    pool = LoRABatchPool(cfg_(), staging=staging)
    for w, lens in (([1, 2], [3, 1]), ([3, 0, 1], [2, 2, 3]), ([2], [1])):
        v = pool.update_(4, w, lens, lora_ranks=[0, 8, 4, 2], scalings=[0, 1, 2, 3])
        h = pool.host_view(4)
        assert h.seg_indptr.device.type == "cpu"
        for name in ("seg_lens", "seg_indptr", "weight_indices", "lora_ranks", "scalings",
                     "permutation"):
            assert torch.equal(getattr(h, name), getattr(v, name)), name
        same = h.seg_lens.data_ptr() == v.seg_lens.data_ptr()
        assert same == (not staging)

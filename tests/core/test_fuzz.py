"""Adversarial suite: bad inputs of every class, out-of-contract device values, random valid phase
sequences, KV stores and LoRA updates, on both update paths.

Properties:
* a bad input (type, dtype, shape, stride, device, range, aliasing, bool as an int) raises a
  ``PoolError`` and leaves **every byte** of the pool unchanged;
* an out-of-contract *device* value (which only a sync could see) never raises and leaves a valid
  read region (``pool.check`` passes): wrong metadata, never a stray index or a half-written view;
* random valid calls, in random phase order on one pool, equal the loop reference
  (tests/helpers/loopref.py), and the fused path equals the reference path byte for byte.

CI runs a short, derandomised version of each property. ``pytest -m fuzz`` runs the long version
(random seeds; ``ATTNPOOL_FUZZ_EXAMPLES`` sets examples per property, default 2000).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpool import (
    BufferPool,
    CapacityError,
    Impl,
    Layout,
    LoRABatchPool,
    LoRAConfig,
    PoolConfig,
    PoolError,
)
from attnpool.kv import KVCacheConfig, KVCachePool, KVLayout

from tests.helpers.fuzzcases import MAX_ENC, PHASES, C, make_pool, mutations, run, valid_call
from tests.update.test_fused_phases import assert_same

SHORT = 12
LONG = int(os.environ.get("ATTNPOOL_FUZZ_EXAMPLES", "2000"))
IMPLS = [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)]
LENGTH = [pytest.param(SHORT, id="short"), pytest.param(LONG, id="long", marks=pytest.mark.fuzz)]


def hypo(examples: int, fn: Callable[[int], None]) -> None:
    """Run ``fn(seed)`` over ``examples`` seeds: derandomised for the short run (CI)."""
    settings(max_examples=examples, deadline=None, database=None, derandomize=examples <= SHORT,
             suppress_health_check=list(HealthCheck))(given(seed=st.integers(0, 2**32 - 1))(fn))()


def image(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def same_bytes(before: list[torch.Tensor], *after: torch.Tensor) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


# ---- bad inputs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("examples", LENGTH)
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise_and_write_nothing(impl: Impl, examples: int) -> None:
    def case(seed: int) -> None:
        rng = random.Random(seed)
        pool = make_pool(rng, impl)
        phase = rng.choice(PHASES)
        if rng.random() < 0.5:  # the pool holds some phase's state first
            run(pool, valid_call(pool, rng.choice(PHASES), rng))
        call = valid_call(pool, phase, rng)
        what, bad = rng.choice(mutations(pool, call, rng))
        before = image(pool.arena.storage)
        with pytest.raises(PoolError) as info:
            run(pool, call, **bad)
        assert isinstance(info.value, ValueError)
        assert same_bytes(before, pool.arena.storage), f"{phase}: {what} wrote to the pool"

    hypo(examples, case)


# ---- the host route's bad inputs ---------------------------------------------------------------
def _host_pool() -> BufferPool:
    return BufferPool(PoolConfig(max_bs=6, max_context_len=C, page_size=4, device="cpu",
                                 layout=Layout.FLASH_ATTN, max_extend_tokens=24, pad_page=0,
                                 num_pages=4 * C, impl=Impl.REFERENCE), poison=True)


def _host_mutations(pool: BufferPool, kind: str, s: dict[str, Any]
                    ) -> list[tuple[str, dict[str, Any]]]:
    """Bad variants of a ``host_step`` call (``s``: bs, seq_lens, block_table[, extend_lens])."""
    lens, table, n = s["seq_lens"], s["block_table"], s["seq_lens"].shape[0]
    out: list[tuple[str, dict[str, Any]]] = [
        ("bs=True", {"bs": True}), ("bs float", {"bs": float(s["bs"])}), ("bs=0", {"bs": 0}),
        ("bs > max_bs", {"bs": 7}), ("bs past int64", {"bs": 2 ** 70}),
        ("float seq_lens", {"seq_lens": lens.float()}),
        ("2-D seq_lens", {"seq_lens": lens.view(1, n)}),
        ("a zero length", {"seq_lens": torch.cat([lens[:-1], lens.new_zeros(1)])}),
        ("a length past C", {"seq_lens": torch.cat([lens[:-1], lens.new_full((1,), C + 1)])}),
        ("seq_lens inside the arena", {"seq_lens": pool.decode.view(n).cache_seqlens}),
        ("float table", {"block_table": table.float()}),
        ("narrow table", {"block_table": table[:, :2]}),
        ("table of too few rows", {"block_table": table[: n - 1]}),
        ("sparse table", {"block_table": table.to_sparse()}),
        ("1-D table", {"block_table": table[0]}),
        ("list seq_lens", {"seq_lens": lens.tolist()}),
    ]
    if table.shape[0] >= 2:  # (one row: its column-major copy has contiguous rows too)
        out.append(("column-major table", {"block_table": table.t().contiguous().t()}))
    if n >= 2:
        out += [("n > bs", {"bs": n - 1}),
                ("strided seq_lens", {"seq_lens": torch.stack([lens, lens], 1).reshape(-1)[::2]})]
    if kind == "extend":
        ext = s["extend_lens"]
        out += [("extend past seq_lens", {"extend_lens": lens + 1}),
                ("a zero new-token count", {"extend_lens": torch.cat([ext[:-1], ext.new_zeros(1)])}),
                ("extend_lens of n - 1", {"extend_lens": ext[:-1]}),
                ("int64 extend_lens past T", {"extend_lens": torch.full((n,), 25),
                                              "seq_lens": torch.full((n,), 30)})]
    return out


@pytest.mark.parametrize("examples", LENGTH)
def test_the_host_routes_bad_inputs_raise_the_general_paths_error(examples: int) -> None:
    """``host_step`` (the C step where it takes a call) and ``update_`` (the general path) on
    one bad call each: the same error, and every byte of the pool as it was."""
    def case(seed: int) -> None:
        rng = random.Random(seed)
        pools = _host_pool(), _host_pool()
        kind = rng.choice(["decode", "extend"])
        n = rng.randint(1, 6)
        s: dict[str, Any] = {"bs": rng.randint(n, 6)}
        ext = [rng.randint(1, 3) for _ in range(n)]
        s["seq_lens"] = torch.tensor([rng.randint(e, C) for e in ext], dtype=torch.int32)
        s["block_table"] = torch.randint(1, 4 * C, (n + rng.randint(0, 3), C // 4 + 2),
                                         dtype=torch.int32)
        if kind == "extend":
            s["extend_lens"] = torch.tensor(ext, dtype=torch.int32)
        if rng.random() < 0.5:  # the pools hold a step first
            for pool in pools:
                pool.decode.host_step(n, s["seq_lens"], s["block_table"])
        what, bad = rng.choice(_host_mutations(pools[0], kind, s))
        k = {**s, **bad}
        if "seq_lens" in bad and bad["seq_lens"] is not s["seq_lens"] and what.endswith("arena"):
            k2 = {**k, "seq_lens": pools[1].decode.view(n).cache_seqlens}
        else:
            k2 = k
        befores = [image(p.arena.storage) for p in pools]
        errors = []
        for pool, kw in ((pools[0], k), (pools[1], k2)):
            phase = pool.decode if kind == "decode" else pool.extend
            with pytest.raises(PoolError) as info:
                if pool is pools[0]:
                    phase.host_step(kw["bs"], kw["seq_lens"], *(
                        [kw["extend_lens"]] if kind == "extend" else []), kw["block_table"])
                else:
                    extra = ({} if kind == "decode" else
                             {"extend_lens": kw["extend_lens"], "extend_lens_cpu": kw["extend_lens"]})
                    phase.update_(kw["bs"], seq_lens=kw["seq_lens"], block_table=kw["block_table"],
                                  seq_lens_cpu=kw["seq_lens"], **extra)
            errors.append(info.value)
        assert type(errors[0]) is type(errors[1]), what
        if not what.endswith("arena"):  # (the message names the pool's own addresses)
            assert str(errors[0]) == str(errors[1]), what
        for pool, before in zip(pools, befores, strict=True):
            assert same_bytes(before, pool.arena.storage), f"{kind}: {what} wrote to the pool"

    hypo(examples, case)


# ---- out-of-contract device values -----------------------------------------------------------------
WILD = [-(2**31), -5, -1, 0, C + 1, 16 * C, 2**31 - 1]


@pytest.mark.parametrize("examples", LENGTH)
@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_contract_device_values_leave_a_valid_view(impl: Impl, examples: int) -> None:
    def case(seed: int) -> None:
        rng = random.Random(seed)
        pool = make_pool(rng, impl)
        call = valid_call(pool, rng.choice(PHASES), rng, host=False)
        kw = dict(call.kwargs)
        n = kw["seq_lens"].shape[0]
        if n == 0:
            return
        dt = kw["seq_lens"].dtype
        targets = ["seq_lens", "req_pool_indices"] + [
            k for k in ("encoder_lens", "accept_lens") if k in kw]
        for name in rng.sample(targets, rng.randint(1, len(targets))):
            vals = kw[name].tolist()
            i = rng.randrange(n)
            vals[i] = rng.choice([*WILD, kw["req_to_token"].shape[0] + 3, MAX_ENC + 1])
            if dt == torch.int32:
                vals[i] = max(min(vals[i], 2**31 - 1), -(2**31))
            kw[name] = torch.tensor(vals, dtype=dt)
        view = getattr(pool, call.phase).update_(call.bs, **kw)
        pool.check(view)

    hypo(examples, case)


# ---- random valid sequences: oracle and reference == fused ----------------------------------------
@pytest.mark.parametrize("examples", LENGTH)
def test_valid_phase_sequences_equal_oracle_on_both_paths(examples: int) -> None:
    pytest.importorskip("triton")

    def case(seed: int) -> None:
        rng = random.Random(seed)
        ref = make_pool(rng, Impl.REFERENCE)
        tt = BufferPool(dataclasses.replace(ref.cfg, impl=Impl.TRITON), poison=True)
        for _ in range(rng.randint(1, 4)):
            phase = rng.choice(PHASES)
            if rng.random() < 0.2:  # a capture view in between: valid, and overwritten next
                ref.check(getattr(ref, phase).view(rng.randint(1, ref.cfg.max_bs)))
                continue
            call = valid_call(ref, phase, rng)
            va, vb = run(ref, call), run(tt, call)
            ref.check(va)
            tt.check(vb)
            call.oracle(va)
            assert_same(va, vb)

    hypo(examples, case)


# ---- KV cache stores -------------------------------------------------------------------------------
def _kv(rng: random.Random) -> KVCachePool:
    cfg = KVCacheConfig(num_pages=rng.choice([3, 6]), page_size=rng.choice([1, 4]), max_tokens=16,
                        num_layers=rng.choice([1, 2, 3]), num_kv_heads=rng.choice([1, 2]),
                        head_dim=rng.choice([4, 8]), dtype=torch.float32,
                        layout=rng.choice(list(KVLayout)), device=rng.choice(["cpu", "cpu:0"]))
    return KVCachePool(cfg, poison=True)


def _kv_call(kv: KVCachePool, rng: random.Random) -> dict[str, Any]:
    c = kv.cfg
    n = rng.randint(1, 8)
    real = rng.sample(range(c.page_size, c.num_slots), min(n, c.num_slots - c.page_size))
    slots = real + [-1] * (n - len(real))
    rng.shuffle(slots)
    return {"layer": rng.randrange(c.num_layers),
            "k": torch.randn(n, c.num_kv_heads, c.head_dim),
            "v": torch.randn(n, c.num_kv_heads, c.head_dim),
            "slot_mapping": torch.tensor(slots, dtype=rng.choice([torch.int32, torch.int64]))}


def _kv_bad(kv: KVCachePool, kw: dict[str, Any], rng: random.Random) -> list[dict[str, Any]]:
    k, slots = kw["k"], kw["slot_mapping"]
    return [
        {"layer": True}, {"layer": False}, {"layer": float(kw["layer"])}, {"layer": -1},
        {"layer": kv.cfg.num_layers}, {"k": k.double()}, {"k": k[:, :, :-1]},
        {"k": k.to("meta")}, {"k": k.transpose(1, 2).contiguous().transpose(1, 2)}
        if k.shape[1] > 1 and k.shape[2] > 1 else {"k": k[None]},
        {"v": kw["v"][:-1] if k.shape[0] > 1 else kw["v"][None]}, {"k": k.tolist()},
        {"slot_mapping": slots.float()}, {"slot_mapping": slots[None]},
        {"slot_mapping": torch.cat([slots, slots[:1]])}, {"slot_mapping": slots.to("meta")},
        {"k": kv.k_cache(0).reshape(-1, *k.shape[1:])[: k.shape[0]]},  # aliases the cache
        {"impl": "triton"},
    ]


@pytest.mark.parametrize("examples", LENGTH)
@pytest.mark.parametrize("impl", IMPLS)
def test_kv_stores(impl: Impl, examples: int) -> None:
    def case(seed: int) -> None:
        rng = random.Random(seed)
        kv = _kv(rng)
        kw = _kv_call(kv, rng)
        before = image(kv.storage)
        with pytest.raises(PoolError):
            kv.store_kv_(**{**kw, "impl": impl, **rng.choice(_kv_bad(kv, kw, rng))})
        assert same_bytes(before, kv.storage)
        # valid store, slot_mapping strided half the time: equals a per-token loop
        slots = kw["slot_mapping"]
        if rng.random() < 0.5:
            slots = slots.repeat_interleave(2)[::2]
        kv.store_kv_(kw["layer"], kw["k"], kw["v"], slots, impl=impl)
        kc, vc = kv.k_cache(kw["layer"]), kv.v_cache(kw["layer"])
        for t, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            page, off = divmod(s, kv.cfg.page_size)
            for cache, src in ((kc, kw["k"]), (vc, kw["v"])):
                row = cache[page, off] if kv.cfg.layout is KVLayout.NHD else cache[page, :, off]
                assert torch.equal(row, src[t])

    hypo(examples, case)


# ---- LoRA batch buffers ----------------------------------------------------------------------------
@pytest.mark.parametrize("examples", LENGTH)
def test_lora_bad_inputs_write_nothing(examples: int) -> None:
    def case(seed: int) -> None:
        rng = random.Random(seed)
        cfg = LoRAConfig(max_bs=4, max_loras_per_batch=3, max_lora_rank=8,
                         max_tokens_per_req=rng.choice([1, 4]))
        pool = LoRABatchPool(cfg, poison=rng.random() < 0.5)
        n = rng.randint(1, 4)
        w = [rng.randrange(3) for _ in range(n)]
        lens = [rng.randint(0, cfg.max_tokens_per_req) for _ in range(n)]
        bad: list[dict[str, Any]] = [
            {"bs": True}, {"bs": 0}, {"bs": 5}, {"bs": n - 1} if n > 1 else {"bs": 2.0},
            {"weight_indices": [*w[:-1], 3]}, {"weight_indices": [*w[:-1], -1]},
            {"weight_indices": [float(x) for x in w]}, {"weight_indices": [True] * n},
            {"weight_indices": torch.tensor(w).to("meta")},
            {"seg_lens": [*lens, 1]}, {"seg_lens": [*lens[:-1], cfg.max_tokens_per_req + 1]},
            {"seg_lens": [*lens[:-1], -1]}, {"seg_lens": ["x"] * n},
            {"lora_ranks": [9]}, {"lora_ranks": [1, 2, 3, 4]}, {"scalings": [float("nan")]},
            {"scalings": [1.0, 2.0, 3.0, 4.0]}, {"weight_indices": [[0]]},
        ]
        before = image(pool.storage)
        kw: dict[str, Any] = {"bs": 4, "weight_indices": w, "seg_lens": lens,
                              **rng.choice(bad)}
        with pytest.raises(PoolError):
            pool.update_(**kw)
        assert same_bytes(before, pool.storage)

    hypo(examples, case)


# ---- the breaks an earlier adversarial run found, one test each -----------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layer", [True, False, 1.0])
def test_kv_layer_must_be_a_real_int(impl: Impl, layer: object) -> None:
    """A bool layer was taken as index 1 (or a new dim): the fused store wrote out of bounds."""
    kv = KVCachePool(KVCacheConfig(num_pages=4, page_size=4, max_tokens=8, num_layers=2,
                                   num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu"))
    k = torch.randn(3, 2, 8)
    before = image(kv.storage)
    with pytest.raises(PoolError, match="layer must be an int"):
        kv.store_kv_(layer, k, k, torch.tensor([4, 5, 6]), impl=impl)  # type: ignore[arg-type]
    with pytest.raises(PoolError, match="layer must be an int"):
        kv.k_cache(layer)  # type: ignore[arg-type]
    assert same_bytes(before, kv.storage)


@pytest.mark.triton
def test_kv_fused_store_honours_slot_mapping_stride() -> None:
    """A strided slot_mapping was read as if contiguous by the fused store."""
    cfg = KVCacheConfig(num_pages=6, page_size=4, max_tokens=8, num_kv_heads=2, head_dim=8,
                        dtype=torch.float32, device="cpu")
    pools = [KVCachePool(cfg, poison=True) for _ in range(2)]
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([4, 99, 9, 99, 17, 99])[::2]
    assert slots.stride(0) == 2
    pools[0].store_kv_(0, k, v, slots, impl=Impl.REFERENCE)
    pools[1].store_kv_(0, k, v, slots, impl=Impl.TRITON)
    assert torch.equal(pools[0].storage, pools[1].storage)
    assert torch.equal(pools[1].gather(0, slots.contiguous())[0], k)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("value", [1024, -5, 16 * 64, 2**31 - 1])
def test_far_out_of_range_lengths_on_flashinfer_layout(impl: Impl, value: int) -> None:
    """Reference path, FlashInfer layout: a RuntimeError after cache_seqlens, cu_seqlens_k,
    page_table and kv_indptr were written. Now: no raise, and a valid read region."""
    cfg = PoolConfig(max_bs=4, max_context_len=64, page_size=4, layout=Layout.FLASHINFER,
                     device="cpu", impl=impl, num_draft_tokens=2, max_encoder_len=8)
    pool = BufferPool(cfg, poison=True)
    table = torch.zeros(2, 64, dtype=torch.int32)
    seq, rpi = torch.tensor([value, 8]), torch.tensor([0, 1])
    pool.check(pool.decode.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table))
    pool.check(pool.verify.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table))
    pool.check(pool.draft_extend.update_(4, seq_lens=seq, accept_lens=torch.tensor([value, 1]),
                                         req_pool_indices=rpi, req_to_token=table))
    pool.check(pool.encoder.update_(4, seq_lens=seq, encoder_lens=torch.tensor([value, 3]),
                                    req_pool_indices=rpi, req_to_token=table))


@pytest.mark.parametrize("impl", IMPLS)
def test_accept_lens_past_seq_lens_refused(impl: Impl) -> None:
    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=64, num_draft_tokens=4, device="cpu",
                                 impl=impl), poison=True)
    before = image(pool.arena.storage)
    with pytest.raises(CapacityError, match=r"accept_lens_cpu\[0\] must be <= seq_lens_cpu"):
        pool.draft_extend.update_(2, seq_lens=torch.tensor([1]), accept_lens=torch.tensor([3]),
                                  req_pool_indices=torch.tensor([0]),
                                  req_to_token=torch.zeros(1, 64, dtype=torch.int32), seq_lens_cpu=[1],
                                  accept_lens_cpu=[3])
    assert same_bytes(before, pool.arena.storage)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("host", [[30.5, 2], ["x", 2], [None, 2], [True, 2],
                                  torch.tensor([3.0, 2.0])])
def test_host_copies_must_hold_ints(impl: Impl, host: object) -> None:
    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=64, device="cpu", impl=impl))
    before = image(pool.arena.storage)
    with pytest.raises(PoolError, match="seq_lens_cpu must hold"):
        pool.decode.update_(2, seq_lens=torch.tensor([30, 2]), req_pool_indices=torch.tensor([0, 1]),
                            req_to_token=torch.zeros(2, 64, dtype=torch.int32), seq_lens_cpu=host)
    assert same_bytes(before, pool.arena.storage)


@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_aliasing_the_arena_refused(impl: Impl) -> None:
    """A view's own cache_seqlens passed back as another overlaid phase's seq_lens gave wrong
    metadata on the fused path (it is overwritten while read)."""
    pool = BufferPool(PoolConfig(max_bs=4, max_context_len=64, num_draft_tokens=2, device="cpu",
                                 impl=impl))
    table = torch.zeros(4, 64, dtype=torch.int32)
    dec = pool.decode.update_(4, seq_lens=torch.tensor([5, 6, 7, 8]), req_pool_indices=torch.arange(4),
                              req_to_token=table)
    before = image(pool.arena.storage)
    with pytest.raises(PoolError, match="must not alias the pool's own buffers"):
        pool.verify.update_(4, seq_lens=dec.cache_seqlens, req_pool_indices=torch.arange(4),
                            req_to_token=table)
    assert same_bytes(before, pool.arena.storage)


def test_kv_device_string_with_index() -> None:
    """KVCacheConfig(device="cpu:0") refused every CPU tensor ("must be on cpu:0, got cpu")."""
    kv = KVCachePool(KVCacheConfig(num_pages=3, page_size=2, max_tokens=4, num_kv_heads=1,
                                   head_dim=4, dtype=torch.float32, device="cpu:0"))
    k = torch.randn(2, 1, 4)
    kv.store_kv_(0, k, k, torch.tensor([2, 3]))
    assert torch.equal(kv.gather(0, torch.tensor([2, 3]))[0], k)

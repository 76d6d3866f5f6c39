"""Bound updates (``pool.<phase>.bind``): after the bound inputs change in place, a call writes
exactly the bytes ``update_`` writes for those values, on every phase and both update paths.

Each case binds a random in-contract call (tests/helpers/fuzzcases.py) on one pool, then draws new values
of the same shapes three times, writes them into the bound tensors in place, calls the bound
update and compares its view's read region with ``update_`` on a second, identically configured
pool given the same values. The fused path is also checked in capturable mode (``num_real``, the
inputs padded to ``bs`` rows, the real count changed in place), and for its cost: a call runs
its recorded launches and not one aten op.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Impl, InputError

from tests.helpers import fuzzcases as fc
from tests.helpers.batches import tree_mask
from tests.helpers.opcount import count
from tests.update.test_fused_phases import assert_same, padded

PHASES = fc.PHASES


def twin(seed: int, impl: Impl, **kw: Any) -> tuple[BufferPool, BufferPool]:
    return (fc.make_pool(random.Random(seed), impl, **kw),
            fc.make_pool(random.Random(seed), impl, **kw))


def fresh_values(call: fc.Call, pool: BufferPool, rng: random.Random, n: int
                 ) -> dict[str, Tensor]:
    """New in-contract values for every tensor input of ``call`` except the table: the first
    ``n`` rows are real (same shapes as the bound tensors)."""
    kw, cfg = call.kwargs, pool.cfg
    extra = {"decode": 0, "verify": fc.ND, "draft": fc.STEPS, "draft_extend": 0,
             "encoder": fc.MAX_ENC, "local": fc.ND}[call.phase]
    rows = kw["seq_lens"].shape[0]
    lens = [rng.choice([1, fc.C - extra, rng.randint(1, fc.C - extra)]) for _ in range(rows)]
    slots = rng.sample(range(kw["req_to_token"].shape[0]), rows)
    out = {"seq_lens": torch.tensor(lens), "req_pool_indices": torch.tensor(slots)}
    if "tree_mask" in kw:
        out["tree_mask"] = torch.cat([tree_mask(n, fc.ND, rng), kw["tree_mask"][n:].cpu()])
    if "out_cache_loc" in kw:
        top = (cfg.num_pages or 2) * cfg.page_size
        out["out_cache_loc"] = torch.randint(cfg.page_size, top, kw["out_cache_loc"].shape)
    if "accept_lens" in kw:
        out["accept_lens"] = torch.tensor([rng.randint(1, min(fc.ND, s)) for s in lens])
    if "encoder_lens" in kw:
        out["encoder_lens"] = torch.tensor([rng.randint(1, fc.MAX_ENC) for _ in range(rows)])
    return out


def capturable(call: fc.Call) -> tuple[dict[str, Any], int]:
    """The call's device inputs padded to ``bs`` rows plus ``num_real``; host copies dropped."""
    kw = {k: v for k, v in call.kwargs.items() if not k.endswith("_cpu")}
    n = kw["seq_lens"].shape[0]
    for k, v in list(kw.items()):
        if isinstance(v, Tensor) and k != "req_to_token":
            kw[k] = padded(v, call.bs, True if k == "tree_mask" else 7)
    kw["num_real"] = torch.tensor([n], dtype=torch.int32)
    return kw, n


# num_real (a capturable update) is a fused-path feature: the reference path binds plain calls
MODES = [(Impl.REFERENCE, False), pytest.param(Impl.TRITON, False, marks=pytest.mark.triton),
         pytest.param(Impl.TRITON, True, marks=pytest.mark.triton)]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(("impl", "device_n"), MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_bound_call_writes_what_update_writes(phase: str, impl: Impl, seed: int,
                                              device_n: bool) -> None:
    rng = random.Random(seed * 31 + PHASES.index(phase))
    bound_pool, oracle_pool = twin(seed, impl)
    call = fc.valid_call(bound_pool, phase, rng, host=False)
    if device_n:
        kw, n = capturable(call)
    else:
        kw, n = dict(call.kwargs), call.kwargs["seq_lens"].shape[0]
    u = getattr(bound_pool, phase).bind(call.bs, **kw)
    for _ in range(3):
        if device_n:  # a new real count too, inputs keep their bs rows
            n = rng.randint(0, call.bs)
            kw["num_real"].fill_(n)
        for k, v in fresh_values(call if not device_n else fc.Call(phase, call.bs, kw,
                                                                  call.oracle),
                                 bound_pool, rng, n).items():
            kw[k].copy_(v.to(kw[k].dtype))  # in place: the bound tensors keep their addresses
        got = u()
        assert got is u.view
        bound_pool.check(got)
        want = getattr(oracle_pool, phase).update_(call.bs, **kw)
        assert_same(want, got)


@pytest.mark.triton
@pytest.mark.parametrize("phase", PHASES)
def test_bound_fused_call_is_its_launches_only(phase: str) -> None:
    rng = random.Random(7)
    pool = fc.make_pool(rng, Impl.TRITON, topk=2)
    call = fc.valid_call(pool, phase, rng, host=False)
    u = getattr(pool, phase).bind(call.bs, **call.kwargs)
    want = 2 if phase == "encoder" or (phase in ("verify", "draft") and pool.cfg.topk > 1) else 1
    assert u.launches == want and not u.graphed
    c = count(u)
    assert (c.launches, c.num_ops) == (want, 0), c.ops


def test_bind_refuses_host_values() -> None:
    pool = fc.make_pool(random.Random(0), Impl.REFERENCE)
    call = fc.valid_call(pool, "decode", random.Random(0), host=True)
    before = pool.arena.storage.clone()
    with pytest.raises(InputError, match="seq_lens_cpu"):
        pool.decode.bind(call.bs, **call.kwargs)
    with pytest.raises(InputError, match="request_ids"):
        pool.decode.bind(call.bs, **{k: v for k, v in call.kwargs.items() if "cpu" not in k},
                         request_ids=list(range(len(call.kwargs["seq_lens"]))))
    assert torch.equal(before, pool.arena.storage)


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("phase", PHASES)
def test_bound_update_on_cuda_is_one_graph_replay(phase: str) -> None:
    """On CUDA a bound fused update is captured into a private graph: a call replays it, and the
    bytes equal update_'s after the inputs change in place."""
    rng = random.Random(PHASES.index(phase))
    cpu = fc.make_pool(rng, Impl.REFERENCE, topk=2)
    cfg = dataclasses.replace(cpu.cfg, device="cuda", impl=Impl.TRITON)
    bound_pool, oracle_pool = BufferPool(cfg, poison=True), BufferPool(cfg, poison=True)
    call = fc.valid_call(cpu, phase, rng, host=False)
    kw, n = capturable(call)
    kw = {k: v.cuda() if isinstance(v, Tensor) else v for k, v in kw.items()}
    u = getattr(bound_pool, phase).bind(call.bs, **kw)
    assert u.graphed and u.launches == 0
    for _ in range(3):
        n = rng.randint(0, call.bs)
        kw["num_real"].fill_(n)
        for k, v in fresh_values(fc.Call(phase, call.bs, kw, call.oracle), cpu, rng, n).items():
            kw[k].copy_(v.to(kw[k].dtype))
        got = u()
        torch.cuda.synchronize()
        want = getattr(oracle_pool, phase).update_(call.bs, **kw)
        assert_same(want, got)

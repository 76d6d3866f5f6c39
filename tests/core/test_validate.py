"""Validation mode (``BufferPool(cfg, validate=True)``): device values the fast path cannot see
are read back once and rejected before any write (0 bytes of the arena change); valid calls
write exactly what a pool without validation writes."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from attnpool import BufferPool, CapacityError, Impl, InputError, PoolConfig, PoolError

from tests.helpers import fuzzcases as fc
from tests.update.test_fused_phases import assert_same

IMPLS = [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)]


def pools(impl: Impl, seed: int, topk: int = 2) -> tuple[BufferPool, BufferPool]:
    plain = fc.make_pool(random.Random(seed), impl, topk=topk)
    checked = BufferPool(plain.cfg, poison=True, validate=True)
    return plain, checked


def call_for(pool: BufferPool, phase: str, seed: int, n: int = 3) -> fc.Call:
    rng = random.Random(seed)
    for _ in range(500):  # a call with at least n real rows, so every mutation has a row
        c = fc.valid_call(pool, phase, rng, host=True)
        if c.kwargs["seq_lens"].shape[0] >= n:
            return c
    raise AssertionError("no call with enough rows")


def refused(pool: BufferPool, call: fc.Call, err: type[PoolError], match: str, **override: Any
            ) -> None:
    before = pool.arena.storage.clone()
    with pytest.raises(err, match=match):
        fc.run(pool, call, **override)
    assert torch.equal(before, pool.arena.storage)  # uint8 storage: a byte compare


def with_row(t: torch.Tensor, i: int, value: int) -> torch.Tensor:
    t = t.clone()
    t[i] = value
    return t


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("phase", fc.PHASES)
def test_valid_calls_write_what_a_plain_pool_writes(impl: Impl, phase: str) -> None:
    plain, checked = pools(impl, 3)
    call = call_for(plain, phase, 11)
    assert_same(fc.run(plain, call), fc.run(checked, call))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("phase", fc.PHASES)
def test_lengths_out_of_range_and_rows_outside_the_table(impl: Impl, phase: str) -> None:
    _, pool = pools(impl, 4)
    call = call_for(pool, phase, 12)
    kw = {k: v for k, v in call.kwargs.items() if not k.endswith("_cpu")}  # device values only
    seq, rpi = kw["seq_lens"], kw["req_pool_indices"]
    rows = kw["req_to_token"].shape[0]
    c = fc.Call(phase, call.bs, kw, call.oracle)
    refused(pool, c, CapacityError, r"seq_lens\[1\] must be in \[1,", seq_lens=with_row(seq, 1, 0))
    refused(pool, c, CapacityError, r"seq_lens\[0\] must be in \[1,",
            seq_lens=with_row(seq, 0, fc.C + 1))
    refused(pool, c, CapacityError, rf"req_pool_indices\[2\] must be in \[0, {rows - 1}\]",
            req_pool_indices=with_row(rpi, 2, rows))
    refused(pool, c, CapacityError, r"req_pool_indices\[0\]",
            req_pool_indices=with_row(rpi, 0, -1))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("phase", fc.PHASES)
def test_host_copies_that_disagree(impl: Impl, phase: str) -> None:
    _, pool = pools(impl, 5)
    call = call_for(pool, phase, 13)
    host = list(call.kwargs["seq_lens_cpu"])
    host[1] = host[1] - 1 if host[1] > 1 else 2
    refused(pool, call, InputError, r"seq_lens_cpu disagrees with seq_lens on the device at row 1",
            seq_lens_cpu=host)


@pytest.mark.parametrize("impl", IMPLS)
def test_phase_specific_values(impl: Impl) -> None:
    _, pool = pools(impl, 6)
    ver = call_for(pool, "verify", 14)
    mask = ver.kwargs["tree_mask"].clone()
    mask[1, 2, 2] = False
    refused(pool, ver, InputError, r"tree_mask\[1\] must have an all-True diagonal",
            tree_mask=mask)
    de = call_for(pool, "draft_extend", 15)
    acc, seq = de.kwargs["accept_lens"], de.kwargs["seq_lens"]
    kw = {k: v for k, v in de.kwargs.items() if not k.endswith("_cpu")}
    de = fc.Call("draft_extend", de.bs, kw, de.oracle)
    refused(pool, de, CapacityError, r"accept_lens\[0\] must be in \[1, 4\]",
            accept_lens=with_row(acc, 0, fc.ND + 1))
    short = with_row(seq, 2, 1)
    refused(pool, de, CapacityError, r"accept_lens\[2\] must be <= seq_lens\[2\]=1",
            seq_lens=short, accept_lens=with_row(acc, 2, 2))
    enc = call_for(pool, "encoder", 16)
    kw = {k: v for k, v in enc.kwargs.items() if not k.endswith("_cpu")}
    enc = fc.Call("encoder", enc.bs, kw, enc.oracle)
    refused(pool, enc, CapacityError, r"encoder_lens\[0\] \+ seq_lens\[0\] must be <=",
            seq_lens=with_row(kw["seq_lens"], 0, fc.C - 1),
            encoder_lens=with_row(kw["encoder_lens"], 0, 2))


@pytest.mark.parametrize("impl", IMPLS)
def test_extend_totals(impl: Impl) -> None:
    cfg = PoolConfig(max_bs=4, max_context_len=64, page_size=4, device="cpu",
                     max_extend_tokens=16, impl=impl)
    pool = BufferPool(cfg, poison=True, validate=True)
    table = fc.make_table(cfg, 4, random.Random(0))
    base = {"seq_lens": torch.tensor([20, 30]), "extend_lens": torch.tensor([5, 6]),
            "req_pool_indices": torch.tensor([0, 1]), "req_to_token": table}
    call = fc.Call("extend", 3, base, lambda v: None)
    fc.run(pool, call)  # in contract
    refused(pool, call, CapacityError, r"sum\(extend_lens\) must be <= 16, got 17",
            extend_lens=torch.tensor([11, 6]))
    refused(pool, call, CapacityError, r"extend_lens\[1\] must be <= seq_lens\[1\]=5",
            seq_lens=torch.tensor([20, 5]))


@pytest.mark.triton
def test_capturable_updates_validate_only_the_real_rows() -> None:
    _, pool = pools(Impl.TRITON, 7, topk=1)
    call = call_for(pool, "decode", 17)
    n, bs = call.kwargs["seq_lens"].shape[0], call.bs
    pad = bs - n
    kw = {"seq_lens": torch.cat([call.kwargs["seq_lens"], torch.full((pad,), -9)]),
          "req_pool_indices": torch.cat([call.kwargs["req_pool_indices"],
                                         torch.full((pad,), 10**6)]),
          "req_to_token": call.kwargs["req_to_token"],
          "num_real": torch.tensor([n], dtype=torch.int32)}
    c = fc.Call("decode", bs, kw, call.oracle)
    fc.run(pool, c)  # garbage past the real count is never read, so never rejected
    refused(pool, c, CapacityError, r"seq_lens\[0\]", seq_lens=with_row(kw["seq_lens"], 0, 0))

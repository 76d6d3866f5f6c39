"""Stale views are caught: a view whose bytes another phase wrote since is refused by
``pool.check`` (``StaleViewError``), ``view.is_current`` says so, and ``pool.owner`` names the
phase whose write the bytes hold.

Overlaid phases (decode, verify, draft, draft extend, extend) share arena bytes, and the encoder
writes the decode phase's buffers for its decoder rows, so every ordered pair of them is checked,
through both ways a phase writes (``view`` and ``update_``).
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch

from attnpool import BufferPool, Impl, Layout, Phase, PoolConfig, StaleViewError

from tests.helpers import fuzzcases as fc

C, ND, STEPS, ENC, T = 128, 4, 3, 32, 64
WRITERS = ("decode", "verify", "draft", "draft_extend", "extend", "encoder")


def make_pool(topk: int = 2) -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=4, device="cpu",
                     layout=Layout.BOTH if topk > 1 else Layout.FLASH_ATTN, num_draft_tokens=ND,
                     topk=topk, spec_steps=STEPS, max_encoder_len=ENC, attention_chunk_size=16,
                     max_extend_tokens=T, impl=Impl.REFERENCE)
    return BufferPool(cfg, poison=True)


def write(pool: BufferPool, phase: str, how: str, rng: random.Random) -> Any:
    """Let ``phase`` write its bytes through ``view(bs)`` or an in-contract ``update_``."""
    if how == "view":
        return getattr(pool, phase).view(3)
    if phase == "extend":
        n = 2
        lens = [rng.randint(8, C) for _ in range(n)]
        ext = [rng.randint(1, min(s, T // n)) for s in lens]
        return pool.extend.update_(3, seq_lens=torch.tensor(lens), extend_lens=torch.tensor(ext),
                                   req_pool_indices=torch.tensor([0, 1]),
                                   req_to_token=fc.make_table(pool.cfg, 4, rng))
    assert (fc.C, fc.ND, fc.STEPS, fc.MAX_ENC) == (C, ND, STEPS, ENC)  # the calls fit this pool
    call = fc.valid_call(pool, phase, rng)
    return fc.run(pool, call)


@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(WRITERS, 2)))
@pytest.mark.parametrize("how", ["view", "update_"])
def test_another_phase_makes_a_view_stale(first: str, second: str, how: str) -> None:
    rng = random.Random(hash((first, second, how)) % 1000)
    pool = make_pool()
    a = write(pool, first, how, rng)
    pool.check(a)
    assert a.is_current and pool.owner(first) is Phase(first)
    b = write(pool, second, how, rng)
    assert not a.is_current
    with pytest.raises(StaleViewError, match=f"view of the {first} phase.*the {second} phase"):
        pool.check(a)
    assert pool.owner(first) is Phase(second)
    assert b.is_current
    pool.check(b)
    # the first phase writes again: its views (the same objects for the same shape) are current
    a2 = write(pool, first, "view", rng)
    assert a2.is_current and not b.is_current
    pool.check(a2)


def test_parts_carry_the_stamp_and_poison_makes_everything_stale() -> None:
    pool = make_pool()
    rng = random.Random(0)
    enc = write(pool, "encoder", "update_", rng)
    assert enc.decoder.is_current and enc.cross.is_current  # the decoder part is the encoder's
    pool.check(enc.decoder)
    loc = pool.local.view(2)
    ver = write(pool, "verify", "update_", rng)
    assert not enc.decoder.is_current and not enc.is_current
    assert loc.is_current  # the local phase's bytes are its own
    assert ver.prefix.is_current and ver.expand is not None and ver.expand.is_current
    pool.poison_()
    for v in (ver, ver.prefix, loc):
        assert not v.is_current
        with pytest.raises(StaleViewError, match="poisoned"):
            pool.check(v)
    assert pool.owner("verify") is None


def test_a_view_built_by_hand_counts_as_current() -> None:
    pool = make_pool(topk=1)
    v = pool.decode.view(2)
    import dataclasses

    own = dataclasses.replace(v, stamp=None)
    write(pool, "verify", "view", random.Random(1))
    assert own.is_current and not v.is_current


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
def test_local_views_know_their_shape_through_bound_calls(impl: Impl) -> None:
    """Decode- and verify-shaped local views share bytes: writing one shape (an update or a bound
    call) makes the other's views stale, and view() of the other shape rewrites its state."""
    rng = random.Random(0)
    pool = fc.make_pool(rng, impl)
    call = fc.valid_call(pool, "local", rng, host=False)
    kw = {k: v for k, v in call.kwargs.items() if k != "for_phase"}
    bound = pool.local.bind(call.bs, for_phase=Phase.DECODE, **kw)
    ver = pool.local.update_(call.bs, for_phase=Phase.VERIFY, **kw)
    assert ver.is_current and not bound.view.is_current
    bound()
    assert bound.view.is_current and not ver.is_current
    with pytest.raises(StaleViewError, match=r"shaped for verify.*decode shape"):
        pool.check(ver)
    again = pool.local.view(call.bs, Phase.VERIFY)
    assert again is ver and again.is_current
    pool.check(again)

"""Every phase's ``update_`` takes its inputs after ``bs`` by keyword only.

Phases take different extra inputs (``accept_lens``, ``encoder_lens``, ``tree_mask``, ...); with
positional inputs one phase's extra input could land where another phase takes
``req_pool_indices`` and still pass the shape checks. Keywords make the order irrelevant.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from attnpool import BufferPool, InputError, Layout, Phase, PoolConfig
from attnpool.phases.base import Shared

from tests.helpers.batches import make_batch

PHASES = ["decode", "verify", "draft", "draft_extend", "encoder", "local", "extend"]
N, BS, ND = 3, 4, 4


def _pool() -> BufferPool:
    cfg = PoolConfig(max_bs=6, max_context_len=256, page_size=16, device="cpu",
                     layout=Layout.BOTH, num_draft_tokens=ND, topk=2, spec_steps=3,
                     attention_chunk_size=32, max_encoder_len=64, max_extend_tokens=24)
    return BufferPool(cfg, poison=True)


def _inputs(pool: BufferPool, phase: str) -> dict[str, object]:
    """A valid keyword set for ``phase``, every optional input given too."""
    b = make_batch(pool.cfg, N, random.Random(7), extra=64)
    kw: dict[str, object] = {**b.inputs(), "seq_lens_cpu": b.seq_lens}
    ones = torch.ones(N, dtype=torch.int64)
    if phase == "verify":
        kw["tree_mask"] = torch.eye(ND, dtype=torch.bool).expand(N, ND, ND).contiguous()
    elif phase == "draft":
        kw["out_cache_loc"] = torch.randint(1, 1000, (N, 3, 2))
    elif phase == "draft_extend":
        kw.update(accept_lens=ones, accept_lens_cpu=[1] * N)
    elif phase == "encoder":
        kw.update(encoder_lens=ones * 5, encoder_lens_cpu=[5] * N)
    elif phase == "local":
        kw["for_phase"] = Phase.VERIFY
    elif phase == "extend":
        kw.update(extend_lens=ones, extend_lens_cpu=[1] * N)
    return kw


@pytest.mark.parametrize("phase", PHASES)
def test_every_input_after_bs_is_keyword_only(phase: str) -> None:
    params = list(inspect.signature(getattr(_pool(), phase).update_).parameters.values())
    assert params[0].name == "bs"
    assert params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert len(params) >= 3
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
    positional = [p.name for p in params[1:] if p.kind not in keyword]
    assert positional == []
    # the inputs every phase shares arrive as **shared, typed by base.Shared
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    required = {p.name for p in params[1:-1] if p.default is inspect.Parameter.empty}
    assert "seq_lens" in required
    # one of two request tables; a block table's rows may default to the batch order
    names = {p.name for p in params[:-1]} | set(Shared.__annotations__)
    assert {"req_pool_indices", "req_to_token", "block_table"} <= names
    assert not {"req_pool_indices", "req_to_token", "block_table"} & required


@pytest.mark.parametrize("phase", PHASES)
def test_positional_input_is_a_type_error_before_any_write(phase: str) -> None:
    pool = _pool()
    kw = _inputs(pool, phase)
    before = pool.arena.storage.clone()
    ph = getattr(pool, phase)
    for name in ("seq_lens", "req_pool_indices", "req_to_token"):
        rest = {k: v for k, v in kw.items() if k != name}
        with pytest.raises(TypeError, match="positional"):
            ph.update_(BS, kw[name], **rest)
    with pytest.raises(TypeError, match="positional"):
        ph.update_(BS, kw["seq_lens"], kw["req_pool_indices"], kw["req_to_token"])
    assert torch.equal(pool.arena.storage, before)


@pytest.mark.parametrize("phase", PHASES)
def test_keyword_order_does_not_matter(phase: str) -> None:
    """The same keywords in two orders refill the same bytes (``bs`` by keyword too)."""
    a, b = _pool(), _pool()
    kw = _inputs(a, phase)
    va = getattr(a, phase).update_(BS, **kw)
    vb = getattr(b, phase).update_(bs=BS, **dict(reversed(list(kw.items()))))
    a.check(va)
    b.check(vb)
    assert torch.equal(a.arena.storage, b.arena.storage)


@pytest.mark.parametrize("phase", PHASES)
def test_an_unknown_keyword_is_refused_before_any_write(phase: str) -> None:
    """``**shared`` takes only the shared inputs: a misspelt one is named, nothing changes."""
    pool = _pool()
    kw = _inputs(pool, phase)
    before = pool.arena.storage.clone()
    with pytest.raises(InputError, match=r"unexpected keyword\(s\) \['req_to_tokens'\]"):
        getattr(pool, phase).update_(BS, **kw, req_to_tokens=kw["req_to_token"])
    assert torch.equal(pool.arena.storage, before)

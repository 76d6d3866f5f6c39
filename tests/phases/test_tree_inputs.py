"""The tree phases' own fully shaped inputs (verify's ``tree_mask [n, N, N]``, the draft tree's
``out_cache_loc [n, S, K]``): each wrong shape, dtype or aliasing is refused with the expected
and the actual value named, before any byte of the pool changes, on both update paths."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from attnpool import BufferPool, Impl, InputError, Layout, PoolConfig

from tests.helpers.batches import make_batch, tree_mask

N, S, K = 3, 2, 2
PATHS = [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)]


def _pool(impl: Impl) -> BufferPool:
    cfg = PoolConfig(max_bs=8, max_context_len=256, page_size=16, device="cpu",
                     layout=Layout.BOTH, num_draft_tokens=N, topk=K, spec_steps=S, impl=impl)
    return BufferPool(cfg, poison=True)


Bad = Callable[[torch.Tensor], object]
MASKS: list[tuple[str, Bad, str]] = [
    ("rows", lambda m: m[:3], r"tree_mask must have 4 rows, got 3"),
    ("width", lambda m: m[:, :, :2].contiguous(), r"tree_mask must be \[4, 3, 3\], got \[4, 3, 2\]"),
    ("dims", lambda m: m[:, 0], r"tree_mask must have 3 dim\(s\), got shape \(4, 3\)"),
    ("dtype", lambda m: m.to(torch.int32),
     r"tree_mask must have dtype in \['torch.bool'\], got torch.int32"),
    ("type", lambda m: m.tolist(), r"tree_mask must be a torch.Tensor, got list"),
]
LOCS: list[tuple[str, Bad, str]] = [
    ("rows", lambda t: t[:2], r"out_cache_loc must have 4 rows, got 2"),
    ("steps", lambda t: t[:, :1].contiguous(), r"out_cache_loc must be \[4, 2, 2\], got \[4, 1, 2\]"),
    ("branches", lambda t: t.repeat(1, 1, 2), r"out_cache_loc must be \[4, 2, 2\], got \[4, 2, 4\]"),
    ("dtype", lambda t: t.float(), r"out_cache_loc must have dtype in .*, got torch.float32"),
]


def _refused(pool: BufferPool, call: Callable[[], object], match: str) -> None:
    before = pool.arena.storage.view(torch.uint8).clone()
    with pytest.raises(InputError, match=match):
        call()
    assert torch.equal(pool.arena.storage.view(torch.uint8), before)


#: (phase, its own input, the steps its lengths leave room for, a good value) per tree input
INPUTS: dict[str, tuple[str, str, int, Callable[[], torch.Tensor]]] = {
    "tree_mask": ("verify", "tree_mask", N, lambda: tree_mask(4, N, random.Random(1))),
    "out_cache_loc": ("draft", "out_cache_loc", S, lambda: torch.randint(16, 4096, (4, S, K))),
}
CASES = [("tree_mask", *c) for c in MASKS] + [("out_cache_loc", *c) for c in LOCS]


@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize(("name", "what", "bad", "match"), CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_bad_tree_input_is_refused_before_any_write(impl: Impl, name: str, what: str, bad: Bad,
                                                    match: str) -> None:
    pool = _pool(impl)
    phase_name, key, extra, good = INPUTS[name]
    phase = getattr(pool, phase_name)
    b = make_batch(pool.cfg, 4, random.Random(0), extra=extra)
    value = good()
    phase.update_(4, **{key: value}, **b.inputs())  # the good call is accepted
    _refused(pool, lambda: phase.update_(4, **{key: bad(value)}, **b.inputs()), match)


@pytest.mark.parametrize("impl", PATHS)
def test_a_pool_buffer_is_refused_as_tree_mask(impl: Impl) -> None:
    """An input inside the pool's storage is refused (the fused path would read it while
    writing the arena); here a bool view of the pool's own bytes."""
    pool = _pool(impl)
    b = make_batch(pool.cfg, 4, random.Random(0), extra=N)
    inside = pool.arena.storage.view(torch.uint8)[: 4 * N * N].view(torch.bool).view(4, N, N)
    _refused(pool, lambda: pool.verify.update_(4, tree_mask=inside, **b.inputs()),
             r"tree_mask must not alias the pool's own buffers .* got a tensor at arena offset 0")

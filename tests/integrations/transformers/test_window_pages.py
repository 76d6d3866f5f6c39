"""Sliding-window layers in their own pages: the generator frees the pages behind every future
window while requests run, reuses them for others, and still gives ``generate``'s tokens.

The allocator alone first (its reservation and freeing rules against a plain-Python oracle),
then PagedGenerator end to end with poisoned caches, so that a page read after it was freed
(and handed to another request, or left poisoned) would change the tokens.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from attnpool import CapacityError, InputError, LayoutError

transformers = pytest.importorskip("transformers")

from attnpool.integrations.transformers import PagedGenerator  # noqa: E402
from attnpool.integrations.transformers.window_paging import (  # noqa: E402
    WindowAllocation,
    WindowPageAllocator,
)

from tests.helpers import hf_tiny  # noqa: E402

W = 6


# ---- the allocator ---------------------------------------------------------------------------
def _visible_pages(first_query: int, end: int, w: int, p: int) -> set[int]:
    """Oracle: pages of positions a query at or after ``first_query`` can see, up to ``end``."""
    return {pos // p for pos in range(max(0, first_query - w + 1), end)}


@pytest.mark.parametrize("p", [1, 3, 4, 16])
@pytest.mark.parametrize("lookahead", [1, 5])
def test_advance_holds_exactly_the_visible_pages(p: int, lookahead: int) -> None:
    wa = WindowPageAllocator(200, p, W, lookahead)
    prompt, total = 23, 23 + 60
    a = wa.admit(0, prompt, total)
    assert a is not None and a.reserved == wa.reservation(prompt, total)
    assert wa.reservation(prompt, total) == max(-(-prompt // p), -(-(W - 1 + lookahead) // p) + 1)
    wa.advance(a, 0, prompt)
    assert set(a.pages) == _visible_pages(0, prompt, W, p)
    wa.settle(a, total)
    kv = prompt
    seen: set[int] = set()
    while kv + lookahead <= total:
        new = wa.advance(a, kv, kv + lookahead)
        assert set(a.pages) == _visible_pages(kv, kv + lookahead, W, p)
        assert a.held <= min(a.reserved, wa.span)
        assert all(j not in seen for j, _ in new)  # a page index is taken once
        seen |= {j for j, _ in new}
        for pos in range(max(0, kv - W + 1), kv + lookahead):  # every visible slot resolves
            assert wa.slot(a, pos) // p == a.pages[pos // p]
        kv += 1
    assert a.held <= wa.span
    ids = set(a.pages.values())
    assert 0 not in ids and len(ids) == a.held
    wa.release(a)
    assert wa.free_pages == wa.unreserved_pages == 199


def test_pages_are_reused_across_requests_and_never_shared() -> None:
    rng = random.Random(0)
    wa = WindowPageAllocator(24, 2, W, 1)
    live: dict[int, tuple[WindowAllocation, int, int]] = {}
    for step in range(400):
        if len(live) < 3 and rng.random() < 0.3:
            row = next(r for r in range(4) if r not in live)
            prompt = rng.randrange(1, 12)
            a = wa.admit(row, prompt, prompt + 20)
            if a is not None:
                wa.advance(a, 0, prompt)
                wa.advance(a, prompt, prompt)
                wa.settle(a, prompt + 20)
                live[row] = (a, prompt, prompt + 20)
        for row, (a, kv, total) in list(live.items()):
            if kv >= total - 1:
                wa.release(a)
                del live[row]
                continue
            wa.advance(a, kv, kv + 1)
            live[row] = (a, kv + 1, total)
        held = [set(a.pages.values()) for a, _, _ in live.values()]
        assert sum(map(len, held)) == len(set().union(*held)), step  # one owner per page
        assert 0 not in set().union(*held)
        assert wa.free_pages + sum(map(len, held)) == 23
    assert wa.unreserved_pages >= 0


def test_admission_waits_for_reserved_pages_and_bad_use_is_refused() -> None:
    wa = WindowPageAllocator(8, 2, W, 1)  # 7 usable pages, span 4
    a = wa.admit(0, 4, 30)
    assert a is not None and a.reserved == 4
    assert wa.admit(1, 8, 30) is None  # needs 4, 3 unpromised: waits, nothing taken
    assert wa.unreserved_pages == 3
    with pytest.raises(CapacityError, match="more than the 7 usable pages"):
        wa.check_fits(16, 30)
    wa.advance(a, 0, 4)
    with pytest.raises(CapacityError, match="no window page"):
        wa.slot(a, 9)
    with pytest.raises(CapacityError, match="reserved"):
        wa.advance(a, 0, 12)  # queries from 0 still see page 0: more than 4 pages at once
    wa.release(a)
    with pytest.raises(InputError, match="already released"):
        wa.release(a)
    with pytest.raises(InputError, match="window must be an int >= 1"):
        WindowPageAllocator(8, 2, 0)


# ---- the generator ---------------------------------------------------------------------------
def _mistral(layers: int = 2, window: int = W) -> Any:
    torch.manual_seed(3)
    cfg = transformers.MistralConfig(
        vocab_size=hf_tiny.VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.3, sliding_window=window,
        **hf_tiny.NO_EOS)
    return transformers.MistralForCausalLM(cfg).to(torch.float64).eval()


def _cohere2() -> Any:
    """Sliding and full layers in one model: three window layers, one full."""
    torch.manual_seed(4)
    cfg = transformers.Cohere2Config(
        vocab_size=hf_tiny.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.3, sliding_window=W, **hf_tiny.NO_EOS)
    return transformers.Cohere2ForCausalLM(cfg).to(torch.float64).eval()


def _poisoned(gen: PagedGenerator) -> PagedGenerator:
    gen.poison_()
    return gen


PS = hf_tiny.prompts((17, 3, 30, 9, 12), seed=7)
NEW = 40
MODELS = {"mistral": _mistral, "cohere2": _cohere2}


@pytest.fixture(scope="module", params=list(MODELS))
def served(request: pytest.FixtureRequest) -> tuple[str, Any, list[list[int]]]:
    model = MODELS[request.param]()
    return request.param, model, hf_tiny.greedy(model, PS, new=NEW)


@pytest.mark.parametrize(("page", "spec"), [(1, False), (4, False), (16, False), (1, True),
                                            (4, True)])
def test_window_pages_are_freed_and_tokens_stay_generates(
        served: tuple[str, Any, list[list[int]]], spec: bool, page: int) -> None:
    which, model, ref = served
    ps, new = PS, NEW
    n = 3 if spec else 0
    gen = _poisoned(PagedGenerator(model, max_bs=3, max_context_len=80, page_size=page,
                                   draft_model=model if spec else None, num_draft_tokens=n))
    assert gen.window_alloc is not None
    assert (gen.target.kv is None) == (which == "mistral")  # no full layer, no full cache
    assert gen.generate(ps, max_new_tokens=new) == ref
    st = gen.stats
    # between and during steps a request holds at most the window span (the prefill, which
    # holds whole prompts, is measured before it)
    assert 0 < st.window_pages_peak <= 3 * gen.window_alloc.span
    longest = -(-(30 + new - 1 + n) // page)
    if which == "cohere2":
        assert st.full_pages_peak >= longest  # the full layer keeps every page
    window_alloc = gen.window_alloc
    assert window_alloc.free_pages == window_alloc.unreserved_pages == window_alloc.num_pages - 1


def test_a_small_window_cache_makes_requests_wait_and_reuse_freed_pages() -> None:
    model = _mistral()
    ps = hf_tiny.prompts((20, 5, 14, 26, 8, 11), seed=8)
    new = 30
    gen = PagedGenerator(model, max_bs=4, max_context_len=64, page_size=2, num_window_pages=14)
    _poisoned(gen)
    taken: list[int] = []
    advance = gen.window_alloc.advance  # type: ignore[union-attr]

    def watch(a: WindowAllocation, first: int, end: int) -> list[tuple[int, int]]:
        new_pages = advance(a, first, end)
        taken.extend(page for _, page in new_pages)
        return new_pages

    gen.window_alloc.advance = watch  # type: ignore[union-attr,method-assign]
    assert gen.generate(ps, max_new_tokens=new) == hf_tiny.greedy(model, ps, new=new)
    assert len(taken) > 13 * 3  # 13 usable pages served many more page takes: freed, reused
    assert max(gen.stats.batch_sizes) < 4  # window pages, not max_bs, limited the batch


def test_held_pages_after_a_long_generation_are_bounded_by_the_window() -> None:
    model = _mistral(layers=1, window=16)
    new = 300
    gen = PagedGenerator(model, max_bs=1, max_context_len=320, page_size=4)
    gen.generate([[5, 6, 7]], max_new_tokens=new)
    assert gen.window_alloc is not None
    assert gen.stats.window_pages_peak == gen.window_alloc.span == -(-(16 - 1 + 1) // 4) + 1
    assert gen.stats.full_pages_peak == 0  # no full layer: no full page was ever taken


def test_a_layer_called_against_its_configured_cache_is_refused() -> None:
    model = _cohere2()
    gen = PagedGenerator(model, max_bs=1, max_context_len=32, page_size=4)
    layer = model.model.layers[3].self_attn  # the full layer
    layer.sliding_window = W
    with pytest.raises(LayoutError, match="layer 3: called with sliding_window=6"):
        gen.generate([[1, 2, 3]], max_new_tokens=2)
    assert gen.window_alloc is not None and gen.window_alloc.free_pages == gen.window_alloc.num_pages - 1

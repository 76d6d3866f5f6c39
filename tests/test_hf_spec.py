"""Speculative decoding through pool.draft, pool.verify and pool.draft_extend: the target's greedy
tokens exactly, whatever the draft proposes.

Two drafts bracket the acceptance logic: the target itself (every proposal is the target's own
greedy token, so everything is accepted and each round commits N + 1 tokens) and a different
random model (nearly everything rejected: each round commits the target's one token). Both must
reproduce ``model.generate`` token for token, with the pool and both caches poisoned first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnpool.integrations.transformers import PagedGenerator

import hf_tiny

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: a second intra-op thread only waits for a busy core (CI shares them)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target() -> Any:
    return hf_tiny.llama()


@pytest.fixture(scope="module")
def ref(target: Any) -> list[list[int]]:
    return hf_tiny.greedy(target, hf_tiny.prompts())


def _run(target: Any, draft: Any, n: int, page_size: int = 16) -> PagedGenerator:
    gen = PagedGenerator(target, max_bs=4, max_context_len=hf_tiny.CONTEXT, page_size=page_size,
                         draft_model=draft, num_draft_tokens=n)
    gen.pool.poison_()
    gen.target.kv.poison_()
    assert gen.draft is not None
    gen.draft.kv.poison_()
    return gen


@pytest.mark.parametrize(("n", "page_size"), [(3, 16), (1, 4)])
def test_draft_is_target_accepts_everything(target: Any, ref: list[list[int]], n: int,
                                            page_size: int) -> None:
    gen = _run(target, target, n, page_size)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW) == ref
    st = gen.stats
    print(f"draft = target, N={n}: acceptance {st.acceptance_rate:.3f}")
    assert st.acceptance_rate == 1.0
    # N + 1 tokens per round: far fewer target steps than tokens (prefill gives the first)
    assert st.decode_steps <= len(ref) * -(-(hf_tiny.NEW - 1) // (n + 1))
    assert gen.alloc.live() == ()


def test_random_draft_is_mostly_rejected(target: Any, ref: list[list[int]]) -> None:
    gen = _run(target, hf_tiny.draft_llama(), 3)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW) == ref
    st = gen.stats
    print(f"random draft, N=3: acceptance {st.acceptance_rate:.3f}")
    assert st.proposed > 0 and st.acceptance_rate < 0.2
    assert st.decode_steps >= hf_tiny.NEW - 1  # about one token per round


def test_speculative_with_eos_and_short_outputs(target: Any, ref: list[list[int]]) -> None:
    """Accepted runs that pass max_new_tokens or an end token are cut exactly there."""
    eos = ref[2][7]
    want = hf_tiny.greedy(target, hf_tiny.prompts(), new=9, eos=eos)
    gen = _run(target, target, 4)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=9, eos_token_id=eos) == want

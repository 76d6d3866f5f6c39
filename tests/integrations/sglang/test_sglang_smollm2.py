"""SmolLM2-135M-Instruct (the GGUF dequantized into the float32 folder the vLLM example writes)
through SGLang: attnpool's backend gives ``torch_native``'s greedy tokens on chat prompts, one
and four requests, and the text reads as an answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from tests.integrations.sglang.test_sglang_tokens import _check, run_pair

QUESTIONS = ("What is the capital of France?", "Name three primary colours.",
             "Write one sentence about the sea.", "What is 12 times 12?")


def test_smollm2_tokens_identical_and_text(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from attnpool.tools import fetch
    from attnpool.tools.vllm_folder import float32_folder

    if fetch.cached("smollm2") is None:
        fetch.fetch("smollm2", quiet=True)
    folder = float32_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    ids = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False)) for q in QUESTIONS]
    (tmp_path / "prompts.json").write_text(json.dumps(ids))
    native, ours, _, _ = run_pair(folder, "defaults", tmp_path, "--prompts",
                                  str(tmp_path / "prompts.json"), "--max-new", "16")
    _check("smollm2", native, ours)
    assert "Paris" in tok.decode(ours["defaults"]["batch"][0])

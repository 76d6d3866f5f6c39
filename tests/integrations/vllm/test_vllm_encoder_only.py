"""Encoder-only models (``runner="pooling"``, ``LLM.embed``) through attnpool's ``pool.extend``
and vLLM's CPU kernel attending non-causally: the embeddings of vLLM's own backend, exactly
(the same kernel reads the same values), for a tiny random BERT and a tiny random RoBERTa, in
batches of requests of different lengths; corrupting one refilled page id changes them.

vLLM does not chunk encoder prompts: a prompt longer than ``max_num_batched_tokens`` is never
scheduled (natively too), so every request here fits one step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch

from tests.helpers import vllm_engine as ve

LENGTHS = (5, 40, 200, 1, 77, 130)


def _save(name: str, root: Path) -> Path:
    """A tiny random encoder (``bert`` or ``roberta``) with a small WordPiece tokenizer (vLLM's
    pooling runner needs one)."""
    import transformers as tf

    path = root / name
    if (path / "config.json").exists():
        return path
    common: dict[str, Any] = {"vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "intermediate_size": 256,
                              "initializer_range": 0.3}
    torch.manual_seed(0)
    model = (tf.BertModel(tf.BertConfig(**common, max_position_embeddings=512))
             if name == "bert" else
             tf.RobertaModel(tf.RobertaConfig(**common, max_position_embeddings=514,
                                              pad_token_id=1)))
    model.save_pretrained(path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(507)]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tf.BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    return path


def _embed(model: Path, attnpool: bool) -> torch.Tensor:
    from vllm import LLM

    with ve.attnpool_backend(attnpool):
        llm = LLM(model=str(model), runner="pooling", **ve.engine_args(
            max_num_batched_tokens=512, max_model_len=512, enable_prefix_caching=False,
            enable_chunked_prefill=False, skip_tokenizer_init=False))
        try:
            outs = llm.embed([{"prompt_token_ids": [5 + (7 * i + n) % 500 for i in range(n)]}
                              for n in LENGTHS], use_tqdm=False)
        finally:
            del llm
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-encoders")


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_embeddings_equal_native(root: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from attnpool.integrations.vllm.encoder_only import EncoderOnlySteps

    steps: list[int] = []
    fill = EncoderOnlySteps.fill

    def counted(self: EncoderOnlySteps, **kw: Any) -> Any:
        steps.append(kw["num_reqs"])
        return fill(self, **kw)

    monkeypatch.setattr(EncoderOnlySteps, "fill", counted)
    model = _save(name, root)
    native = _embed(model, False)
    ours = _embed(model, True)
    assert steps and max(steps) > 1, steps  # attnpool's refill ran, several requests a step
    assert torch.equal(ours, native), (ours - native).abs().max()


def test_corrupting_the_pool_changes_the_embeddings(root: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from attnpool.integrations.vllm.encoder_only import EncoderOnlySteps

    fill = EncoderOnlySteps.fill

    def corrupted(self: EncoderOnlySteps, **kw: Any) -> Any:
        md = fill(self, **kw)
        table = md.view.page_table
        if table is not None and table.shape[0] > 1:
            table[1, 0] = table[0, 0]  # row 1 reads row 0's first block: the pool's table
        return md

    model = _save("bert", root)
    native = _embed(model, False)
    monkeypatch.setattr(EncoderOnlySteps, "fill", corrupted)
    assert not torch.equal(_embed(model, True), native)

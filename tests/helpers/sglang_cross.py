"""Tiny random encoder-decoder models (mllama, whisper) and their greedy tokens from SGLang's CPU
engine, one backend per process.

Run as a script in the SGLang environment (``.venv-sglang``), one process per backend::

    python -m tests.helpers.sglang_cross --model DIR --kind mllama --backend attnpool \\
        --out tokens.json [--corrupt]

The models are built here from configs (random weights, ``float32``) with what SGLang's
processors need, made locally: nothing is downloaded.

- **mllama** (Llama 3.2 Vision): a vision tower of 28-pixel tiles of 14-pixel patches (5
  tokens a tile with its class token), 2 tiles an image (``max_num_tiles``: every image is
  padded to 2 tiles, so an image is 10 encoder tokens whatever its aspect ratio), a 4-layer
  text model whose layers 1 and 3 are cross-attention layers, their tanh gates opened (1.0:
  transformers initialises them to 0, which would hide the images); a word-level fast tokenizer with
  Llama 3's special tokens (``<|image|>``, ``<|begin_of_text|>``...), an image processor
  config. The requests differ in their number of images (1, 2, 3: 10, 20, 30 encoder tokens)
  and prompt lengths.
- **whisper**: ``d_model`` 64, 2 encoder and 2 decoder layers, ``init_std`` 0.3, a byte-level
  tokenizer with Whisper's special tokens, the default feature extractor (30 s windows).
  Whisper's encoder length is fixed by the model: every request has 1500 encoder tokens
  (``max_source_positions``; SGLang pads each audio to the window) and the same 4-token decoder
  prompt (SGLang's whisper processor builds it and ignores the text). What varies: the audio
  (tones of different pitch and length), so the cross keys, and the new tokens per request
  (``max_new_tokens``), so requests leave the batch at different steps and the decode batches
  mix decoder lengths.

Each run writes ``{"tokens": [...], "again": [...], "encoder_lens": [...]}`` (one list per
request, greedy, two rounds: :func:`run`); with ``--corrupt`` the same engine then runs the
requests a third time with attnpool's encoder view corrupted (the file named by
``ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE`` holds ``encoder``:
``tests/helpers/sglang_cpu/sitecustomize.py``) and adds ``"corrupt"``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tests.helpers import sglang_engine as se
from tests.helpers import whisper_tiny

#: mllama: images per request (10 encoder tokens each) and prompt words
MLLAMA_IMAGES = (1, 2, 3, 1)
MLLAMA_WORDS = (3, 9, 5, 14)
#: whisper: each request's tone (Hz, seconds) and new tokens
WHISPER_TONES = ((220.0, 1.0), (440.0, 3.0), (880.0, 2.0), (330.0, 0.5))
WHISPER_NEW = (12, 7, 16, 10)
#: the decoder prompt SGLang's whisper processor builds: start, language, task, no timestamps
WHISPER_PROMPT = 4
MLLAMA_NEW = 12
#: mllama's mixed round, in batch order: (request, with its images); the text-only requests
#: (their prompt's words and one more, new to the radix cache) sit between image requests
MIXED = ((0, True), (2, False), (1, True), (3, False))
ENGINE: dict[str, Any] = {"device": "cpu", "disable_cuda_graph": True, "dtype": "float32",
                          "random_seed": 0, "log_level": "warning", "mem_fraction_static": 0.5,
                          "max_total_tokens": 8192}
#: Llama 3's special tokens the mllama processor and SGLang look up
#: per model, on top of :data:`ENGINE`: whisper's prefill may not be chunked (SGLang takes a
#: request's encoder tokens in one piece, and 4 requests of 1504 tokens pass its CPU default)
KIND_ENGINE: dict[str, dict[str, Any]] = {"mllama": {}, "whisper": {"chunked_prefill_size": -1}}
_LLAMA_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|image|>", "<|python_tag|>",
                  "<|eot_id|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                  "<|end_header_id|>")


def _word_tokenizer(path: Path, words: int) -> Any:
    """A word-level fast tokenizer: ``w0 .. w{words-1}`` split on spaces, and Llama 3's
    special tokens."""
    import tokenizers as tk
    import transformers as tf

    vocab = {s: i for i, s in enumerate(("<unk>", *_LLAMA_SPECIAL))}
    vocab.update({f"w{i}": len(vocab) + i for i in range(words)})
    model = tk.models.WordLevel(vocab, unk_token="<unk>")
    t = tk.Tokenizer(model)
    t.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    t.add_special_tokens([tk.AddedToken(s, special=True) for s in _LLAMA_SPECIAL])
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>",
                                     bos_token="<|begin_of_text|>",
                                     eos_token="<|end_of_text|>",
                                     pad_token="<|finetune_right_pad_id|>")
    tok.save_pretrained(path)
    return tok


def save_mllama(root: Path) -> Path:
    """The tiny mllama of the module doc, saved under ``root`` (once)."""
    import torch
    import transformers as tf

    path = root / "mllama"
    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True)
    tok = _word_tokenizer(path, 200)
    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 64, "image_size": 28,
              "patch_size": 14, "max_num_tiles": 2, "intermediate_layers_indices": [0],
              "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
              "vision_output_dim": 64, "initializer_range": 0.3}
    text = {"vocab_size": len(tok), "hidden_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
            "cross_attention_layers": [1, 3], "max_position_embeddings": 1024,
            "initializer_range": 0.3, "rope_scaling": None,
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}
    cfg = tf.MllamaConfig(vision_config=vision, text_config=text,
                          image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    torch.manual_seed(0)
    model = tf.MllamaForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():  # (transformers starts the cross layers' tanh gates at 0: closed)
        for name, param in model.named_parameters():
            if name.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate")):
                param.fill_(1.0)
    model.save_pretrained(path)
    images = tf.MllamaImageProcessor(size={"height": 28, "width": 28}, max_image_tiles=2)
    tf.MllamaProcessor(image_processor=images, tokenizer=tok).save_pretrained(path)
    return path


def save_whisper(root: Path) -> Path:
    """The tiny whisper of the module doc, saved under ``root`` (once)."""
    return whisper_tiny.save_whisper(root / "whisper", d_model=64, heads=2, ffn=128)


def _mllama_requests(model: Path) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """Prompts, image files and sampling parameters of the mllama requests (images of
    different sizes and aspect ratios, saved next to the model)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    prompts, images = [], []
    for i, (n, words) in enumerate(zip(MLLAMA_IMAGES, MLLAMA_WORDS, strict=True)):
        files = []
        for j in range(n):
            w, h = (28 + 14 * ((i + j) % 3), 28 + 20 * ((i * j) % 2))
            f = model / f"image_{i}_{j}.png"
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(f)
            files.append(str(f))
        text = " ".join(f"w{int(x)}" for x in rng.integers(0, 200, words))
        prompts.append("<|image|>" * n + "<|begin_of_text|>" + text)
        images.append(files)
    params = [{"temperature": 0.0, "max_new_tokens": MLLAMA_NEW, "ignore_eos": True}
              for _ in prompts]
    return prompts, images, params


def _whisper_requests(model: Path) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """Prompts (ignored by SGLang's whisper processor), tone files and sampling parameters."""
    import numpy as np
    import soundfile as sf

    files = []
    for i, (hz, seconds) in enumerate(WHISPER_TONES):
        t = np.arange(int(16000 * seconds)) / 16000
        f = model / f"tone_{i}.wav"
        sf.write(f, (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32), 16000)
        files.append(str(f))
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in WHISPER_NEW]
    return [""] * len(files), files, params


def _served() -> tuple[int, ...] | None:
    """The pool's refill counts so far (attnpool's engine with the report on), else None."""
    from attnpool.integrations.sglang.served import REPORT, Served

    path = os.environ.get(REPORT)
    return Served.read_all(path) if path else None


def run(model: Path, kind: str, backend: str, corrupt: bool) -> dict[str, Any]:
    """The requests' greedy tokens, twice (``tokens``, ``again``: mllama's second round finds
    its prompts, encoder tokens included, in the radix cache; SGLang keeps whisper's off), and
    the encoder lengths SGLang counted (``encoder_lens``: its prompt tokens less the decoder
    prompt's); for mllama then a round of text-only requests (``text``: no encoder input, the
    model skips its cross layers), with the pool's refill counts before and after it
    (``served_before_text``, ``served_after_text``), and a round mixing image and text-only
    requests in one batch (``mixed``: :data:`MIXED`; ``served_after_mixed``) and its text-only
    requests again in a batch of their own (``mixed_text_alone``); with ``corrupt``
    a last round with attnpool's encoder view corrupted (see the module doc)."""
    import sglang

    if kind == "mllama":
        prompts, media, params = _mllama_requests(model)
        data: dict[str, Any] = {"image_data": media}
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model))
        decoder = [len(tok(p, add_special_tokens=False).input_ids) for p in prompts]
    else:
        prompts, audio, params = _whisper_requests(model)
        data = {"audio_data": audio}
        decoder = [WHISPER_PROMPT] * len(prompts)
    engine = sglang.Engine(model_path=str(model), attention_backend=backend,
                           **(ENGINE | KIND_ENGINE[kind]))
    flag = os.environ.get("ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE")
    out: dict[str, Any] = {}
    try:
        def generate() -> list[list[int]]:
            got = engine.generate(prompt=prompts, sampling_params=params, **data)
            out["encoder_lens"] = [g["meta_info"]["prompt_tokens"] - d
                                   for g, d in zip(got, decoder, strict=True)]
            return [g["output_ids"] for g in got]

        out["tokens"] = generate()
        out["again"] = generate()
        if kind == "mllama":
            out["served_before_text"] = _served()
            text = [p.split("<|begin_of_text|>")[1] for p in prompts[:2]]
            got = engine.generate(prompt=[f"<|begin_of_text|>{t}" for t in text],
                                  sampling_params=params[:2])
            out["text"] = [g["output_ids"] for g in got]
            out["served_after_text"] = _served()
            words = [p.split("<|begin_of_text|>")[1] for p in prompts]
            mixed = [prompts[i] if image else f"<|begin_of_text|>{words[i]} w7"
                     for i, image in MIXED]
            got = engine.generate(prompt=mixed, sampling_params=params[:len(mixed)],
                                  image_data=[media[i] if image else None
                                              for i, image in MIXED])
            out["mixed"] = [g["output_ids"] for g in got]
            out["served_after_mixed"] = _served()
            alone = [m for m, (_, image) in zip(mixed, MIXED, strict=True) if not image]
            got = engine.generate(prompt=alone, sampling_params=params[:len(alone)])
            out["mixed_text_alone"] = [g["output_ids"] for g in got]
        if corrupt:
            if not flag:
                raise SystemExit("--corrupt needs ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE set")
            Path(flag).write_text("encoder")
            try:
                out["corrupt"] = generate()
            finally:
                Path(flag).unlink()
    finally:
        engine.shutdown()
    return out


def env(**extra: str) -> dict[str, str]:
    """An engine process's environment (:func:`tests.helpers.sglang_engine.env`), with SGLang's
    mllama mask of mixed prefills corrected (``tests/helpers/sglang_cpu/mllama_mask.py``: the
    mixed round is no reference without it, on any backend)."""
    return se.env(ATTNPOOL_SGLANG_MLLAMA_MASK="1", **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--kind", choices=("mllama", "whisper"), required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    got = run(a.model, a.kind, a.backend, a.corrupt)
    a.out.write_text(json.dumps(got | {"backend": a.backend, "kind": a.kind}))


if __name__ == "__main__":
    main()

"""A tiny random whisper saved as a model folder, for the engines' cross-attention tests (vLLM's
and SGLang's): a byte-level tokenizer with Whisper's special tokens, the default feature
extractor (30 s windows) and random weights (``init_std`` 0.3, else greedy tokens repeat), all
made locally: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

#: Whisper's special tokens the engines' processors look up
SPECIAL = ["<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
           "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>"]


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE (GPT-2's mapping of bytes to symbols)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(rest)}
    return [table[b] for b in range(256)]


def save_whisper(path: Path, *, d_model: int, heads: int, ffn: int,
                 encoder_tokens: int = 1500) -> Path:
    """The tiny whisper (2 encoder and 2 decoder layers of ``d_model`` with ``heads`` heads and
    ``ffn``-wide MLPs, ``encoder_tokens`` = ``max_source_positions``) saved at ``path`` with its
    processor, once: a folder that already holds one is returned as it is."""
    import torch
    import transformers as tf

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True)
    (path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(byte_symbols())}))
    (path / "merges.txt").write_text("#version: 0.2\n")
    end = "<|endoftext|>"
    tok = tf.WhisperTokenizer(str(path / "vocab.json"), str(path / "merges.txt"),
                              unk_token=end, bos_token=end, eos_token=end, pad_token=end)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    start, eos = tok.convert_tokens_to_ids("<|startoftranscript|>"), tok.convert_tokens_to_ids(end)
    cfg = tf.WhisperConfig(vocab_size=len(tok), num_mel_bins=80, d_model=d_model,
                           encoder_layers=2, decoder_layers=2, encoder_attention_heads=heads,
                           decoder_attention_heads=heads, encoder_ffn_dim=ffn,
                           decoder_ffn_dim=ffn, max_source_positions=encoder_tokens,
                           max_target_positions=448, init_std=0.3,
                           decoder_start_token_id=start, eos_token_id=eos, pad_token_id=eos,
                           bos_token_id=eos, begin_suppress_tokens=None, suppress_tokens=None,
                           forced_decoder_ids=None)
    torch.manual_seed(0)
    model = tf.WhisperForConditionalGeneration(cfg).to(torch.float32)
    model.generation_config.forced_decoder_ids = None
    model.save_pretrained(path)
    tf.WhisperProcessor(feature_extractor=tf.WhisperFeatureExtractor(feature_size=80),
                        tokenizer=tok).save_pretrained(path)
    return path

"""A float32 transformers folder of a GGUF checkpoint, for vLLM's CPU build.

vLLM reads GGUF files only through a plugin that needs CUDA; on a CPU it loads transformers
folders. This writes one from a checkpoint :mod:`attnpool.tools.checkpoint` can load (the
fetched SmolLM2-135M-Instruct GGUF): transformers dequantizes the tensors to float32, the GGUF
quantizer and its ``quantization_config`` are dropped (``save_pretrained`` refuses a model still
marked quantized; the weights are plain float32 now), and the tokenizer is saved beside them.
Written once, next to the GGUF file; later calls return the folder.
"""

from __future__ import annotations

import pathlib

import torch

from . import checkpoint


def float32_folder(arg: str = "smollm2", out: pathlib.Path | None = None) -> pathlib.Path:
    """The folder (``out``, default ``<gguf name>-float32`` beside the GGUF) of ``arg``."""
    folder, gguf, _ = checkpoint.resolve(arg)
    if gguf is None:
        return folder
    dest = out or folder / (pathlib.Path(gguf).stem + "-float32")
    if (dest / "config.json").is_file():
        return dest
    loaded = checkpoint.load(arg, torch.device("cpu"), torch.float32)
    model = loaded.model
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    checkpoint.note(f"writing {dest} ...")
    model.save_pretrained(dest)
    if loaded.tokenizer is not None:
        loaded.tokenizer.save_pretrained(dest)
    return dest

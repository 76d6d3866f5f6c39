"""Test fix: SGLang's mllama text-row mask in a prefill that mixes image and text-only requests.

mllama zeroes a cross-attention layer's output (attention and MLP) on the rows of a request
without an image (``full_text_row_masked_out_mask``). SGLang 0.5.23 builds that mask for an
extend batch (``MllamaForConditionalGeneration.get_full_text_row_masked_out_mask``,
``models/mllama.py`` lines 953-975) by walking the requests with ``seq_lens`` as each request's
row count and advancing by ``encoder_lens``: in a batch with both kinds of requests it masks the
wrong rows, and which rows depends on how the scheduler happened to batch the requests (two runs
of the same engine on the same prompts gave different tokens for a text-only request). Tokens of
such a batch are then no reference for any attention backend.

:func:`fix` replaces the method in every engine process of the cross-attention tests (native
and attnpool alike, ``ATTNPOOL_SGLANG_MLLAMA_MASK=1``) with the mask the model means: request
``i``'s ``extend_seq_lens[i]`` rows, in order, masked when its ``encoder_lens[i]`` is 0. Decode
batches keep SGLang's own (``encoder_lens != 0``, one row per request: right already). Not part
of attnpool: a batch of one kind of request gets the same mask either way.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any


def fix(module: ModuleType) -> None:
    """Replace ``module.MllamaForConditionalGeneration``'s mask with the corrected one."""
    cls = module.MllamaForConditionalGeneration
    own = cls.get_full_text_row_masked_out_mask

    def mask(self: Any, forward_batch: Any) -> Any:
        import torch

        fb = forward_batch
        if fb.forward_mode.is_decode():
            return own(self, fb)
        rows = [int(x) for x in fb.extend_seq_lens.tolist()]
        keep = [enc != 0 for enc in fb.encoder_lens_cpu]
        out = torch.repeat_interleave(torch.tensor(keep, dtype=torch.bool),
                                      torch.tensor(rows), output_size=sum(rows))
        return out.to(fb.seq_lens.device).reshape(-1, 1)

    cls.get_full_text_row_masked_out_mask = mask

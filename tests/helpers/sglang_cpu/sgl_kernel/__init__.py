"""A pure-torch stand-in for the CPU ops of SGLang's ``sgl_kernel`` that SGLang's CPU engine
calls (SGLang's CPU build of that package is not on the package index, and the index's wheel
loads only with CUDA). Put this folder's parent first on ``PYTHONPATH`` of an SGLang process,
for SGLang's native backend and attnpool's alike, so both run the same ops.

- :func:`assign_req_to_token_pool_cpu`: the one op a decoder-only model calls;
- the ops of SGLang's speculative decoding on a CPU (:mod:`._spec`, and
  :mod:`.speculative` for NGRAM's tree);
- ``torch.ops.sgl_kernel.extend_attention_cpu`` / ``decode_attention_cpu``, the attention of
  SGLang's ``intel_amx`` backend (:mod:`._attention`, registered on import; ``intel_amx``
  runs on a CPU without AMX only under the platform override of ``../sitecustomize.py``).

Any other op raises when called, naming it, so a run that needs more of the package fails
loudly instead of computing something else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _attention  # noqa: F401  (registers the torch ops)
from ._spec import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request ``i`` in order, the next ``end_offset[i] - start_offset[i]`` entries of
    ``out_cache_loc`` (packed by request) go to ``req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]]``."""
    del pool_len  # (the table's width: the slices below are bounded by it already)
    at = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(),
                       strict=True):
        req_to_token[r, s:e] = out_cache_loc[at:at + e - s].to(req_to_token.dtype)
        at += e - s


def __getattr__(name: str) -> Callable[..., Any]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"sgl_kernel.{name} is not provided by the CPU stand-in "
                                  "(tests/helpers/sglang_cpu): this run needs more of SGLang's "
                                  "CPU kernels than it provides")

    return missing

"""Paged attention over any :class:`attnpool.PagedView` with PyTorch SDPA (CPU and CUDA): the
library's CPU backend and the oracle the kernel adapters are checked against.

* :mod:`.checks`: the argument checks every adapter shares (:func:`check_qkv`, the softmax
  scale, the layout a pass reads),
* :mod:`.paged`: the adapter (:func:`attention`, :func:`paged_attention`, their ``_out`` forms,
  and :func:`plan` / :func:`run_plan` for a forward over many layers),
* :mod:`.planning`: the layer-independent half of a pass (:class:`~.planning.Plan`: where each
  row's keys and queries are),
* :mod:`.gather`: the copy of each layer's key lanes out of the paged cache (or, on a CPU, the
  cache itself seen as the block SDPA takes), and :func:`cache_as_pages` (how every adapter
  reads a cache in pages of another size),
* :mod:`.tree`: a tree verify or draft step as one pass (its prefix and expand keys under one
  mask) for the output-only entry points,
* :mod:`.lean`: a decode layer whose keys are read in place, with nothing between it and SDPA
  (what a bound forward's later layers take).
"""

from __future__ import annotations

from ..merge import Attn, merge_by_lse, passes, run_passes
from .checks import check_qkv, pick_layout, softmax_scale_of
from .gather import cache_as_pages
from .paged import (
    AttnOptions,
    attention,
    attention_out,
    paged_attention,
    paged_attention_out,
    plan,
    run_plan,
)

__all__ = [
    "Attn", "AttnOptions", "attention", "attention_out", "cache_as_pages", "check_qkv",
    "merge_by_lse", "paged_attention", "paged_attention_out", "passes", "pick_layout", "plan",
    "run_passes", "run_plan", "softmax_scale_of",
]

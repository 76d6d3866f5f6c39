"""FlashInfer for an engine's forward: every part of a step planned once, before the layers run.

FlashInfer's wrappers take at ``plan`` time what the other adapters take per call: the
softmax scale, the soft cap, the window, the heads and the dtypes; and ``plan`` reads the CSR
page lists on the host (a device sync, and host work that must stay out of a captured graph).
An engine integration therefore plans every paged part of the step's view once, in its
metadata step (vLLM's ``build``, SGLang's ``init_forward_metadata``), and each layer's call
only runs the planned wrapper (:class:`attnpool.adapters.binding.Run`).

:class:`StepPlans` keeps two sets of wrappers on one float workspace (they never run at the
same time: one forward's layers run in order on one stream):

- graph wrappers, one per part and batch size, for the sizes the engine captures in CUDA
  graphs (:meth:`StepPlans.capture_size`): built on the pool's own CSR buffers, so that a graph
  captured with one reads the pool's refill on every replay;
- eager wrappers, one per part and wrapper kind for every other step (mixed prefill + decode
  batches, decode batches of a size no graph was captured for): FlashInfer sizes them per plan,
  so their number does not grow with the batch sizes an engine sees.

What every layer of a step must share is fixed by :class:`LayerFacts`; a layer whose scale or
soft cap differs is refused when it runs (a plan made for other values would compute other
scores), never computed with the planned ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import Layout
from ..errors import InputError, LayoutError
from ..views import PagedView
from .backends import Backend
from .flashinfer import GraphWrappers

#: FlashInfer's float workspace per integration instance (vLLM's own FlashInfer backend takes
#: 128 MiB too): its split-KV partial results for the largest step
WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True, slots=True)
class LayerFacts:
    """What FlashInfer fixes at plan time, the same for every layer a step's plans serve.

    Fields:
        num_heads, num_kv_heads: query and KV heads of a layer on this rank.
        head_dim: the head size of queries, keys and values.
        dtype: the queries' dtype (and the cache's: fp8 caches are not planned here).
        scale: the softmax scale every layer passes.
        softcap: the logits soft cap (0: none).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale: float
    softcap: float = 0.0


def parts(view: PagedView) -> tuple[PagedView, ...]:
    """The paged parts a step's layers read: the view itself, and its sliding-window part when
    the pool has one."""
    window = getattr(view, "window", None)
    return (view,) if window is None else (view, window)


class StepPlans:
    """The FlashInfer wrappers of one integration instance (see the module docstring)."""

    def __init__(self, facts: LayerFacts, device: torch.device, *,
                 workspace_bytes: int = WORKSPACE_BYTES, decode_cls: type | None = None,
                 prefill_cls: type | None = None) -> None:
        if workspace_bytes < 1 or workspace_bytes % 16:
            raise InputError(f"workspace_bytes must be a positive multiple of 16, got "
                             f"{workspace_bytes}")
        self.facts = facts
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)  # ok: once
        self.graph = GraphWrappers(workspace, zero_workspace=False, decode_cls=decode_cls,
                                   prefill_cls=prefill_cls)
        self.eager = GraphWrappers(workspace, zero_workspace=False, graph=False,
                                   decode_cls=decode_cls, prefill_cls=prefill_cls)
        self._sizes: set[int] = set()

    def capture_size(self, bs: int) -> None:
        """Mark ``bs`` as a batch size the engine captures: its decode steps plan graph
        wrappers of that size (created at the capture's own metadata step, outside the
        graph)."""
        self._sizes.add(bs)

    def prepare(self, view: PagedView) -> GraphWrappers:
        """Plan the wrapper of every part of ``view`` (refilled for this step) and return the
        set that holds them, for :class:`attnpool.adapters.binding.Run`. Host-side: call after
        the pool's update, before the forward (outside any graph)."""
        f = self.facts
        wrappers = self.graph if view.max_seqlen_q == 1 and view.bs in self._sizes \
            else self.eager
        for part in parts(view):
            wrappers.wrapper(part)
            wrappers.plan(part, num_qo_heads=f.num_heads, num_kv_heads=f.num_kv_heads,
                          head_dim=f.head_dim, q_dtype=f.dtype, sm_scale=f.scale,
                          softcap=f.softcap)
        return wrappers

    def check(self, scale: float | None, softcap: float) -> None:
        """A layer's call asks for the planned scale and soft cap.

        Raises:
            LayoutError: it does not (FlashInfer would compute with the planned ones).
        """
        f = self.facts
        if (scale is not None and float(scale) != f.scale) or float(softcap) != f.softcap:
            raise LayoutError(f"FlashInfer's plan fixed scale={f.scale} and softcap={f.softcap} "
                              f"for every layer of the step; this layer asks for scale={scale}, "
                              f"softcap={softcap}: use flash-attn or SDPA for such a model")


def plans_for(backend: Backend, facts: LayerFacts | None,
              device: torch.device) -> tuple[StepPlans | None, Layout]:
    """An integration's FlashInfer plans and its pool's page-table layout for ``backend``:
    FlashInfer's CSR lists and the plans when it attends (``facts`` required), else no plans
    and the page table every other adapter reads.

    Raises:
        LayoutError: FlashInfer without ``facts``.
    """
    if backend is not Backend.FLASHINFER:
        return None, Layout.FLASH_ATTN
    if facts is None:
        raise LayoutError("FlashInfer's plans need the layers' shared facts (facts=)")
    return StepPlans(facts, device), Layout.FLASHINFER


def run(wrappers: GraphWrappers, part: object, q: Tensor, k: Tensor, v: Tensor,
        sinks: Tensor | None) -> Tensor:
    """One layer's attention over a planned part (tree views: both passes, merged)."""
    return wrappers.attention(part, q, k, v, sinks=sinks).out

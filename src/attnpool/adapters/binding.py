"""The adapter call every engine integration binds once per forward and calls per layer.

An engine's attention layer (transformers' attention function, vLLM's backend) stores
the step's K/V and then attends over the paged cache through one callable, :class:`Run`, bound to
the step's view by :func:`bind`: it picks the view's part for the layer (full, sliding-window,
chunked local), computes SDPA's gather plan once per forward and part instead of once per layer,
and calls the chosen adapter (SDPA on any device, flash-attn FA3 / FA4 / FA2 on CUDA, and
FlashInfer's wrappers on CUDA where the integration planned the step's parts beforehand:
:mod:`.flashinfer_step`). Which backend runs is chosen before, through :func:`choose`; a binding
only checks that it is one it drives (:data:`DRIVEN`, :data:`PLANNED`).

Nothing here knows an engine: this module is plain torch plus the adapters.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, LayoutError
from ..views import DraftExtendView, DraftStepView, ExtendView, LocalView, PagedView, VerifyView
from .backends import Backend, Need, select
from .flashinfer import GraphWrappers
from .flashinfer_step import StepPlans
from .flashinfer_step import run as flashinfer_run
from .sdpa.lean import lean_out, lean_ready
from .sdpa.paged import attention_out, plan, run_plan
from .sdpa.planning import Plan
from .sdpa.tree import tree_parts

#: The backends a :class:`Run` calls per layer, in :data:`attnpool.adapters.backends.AUTO_ORDER`.
#: FlashInfer's wrappers need a plan per step and part, which a bound forward does not make: it
#: is not among them.
DRIVEN = (Backend.FA3, Backend.FA4, Backend.FA2, Backend.SDPA)

#: The backends a :class:`Run` calls only over wrappers the integration planned for the step
#: (:class:`.flashinfer_step.StepPlans`).
PLANNED = (Backend.FLASHINFER,)


def driven(device: str, planned: bool = False) -> tuple[Backend, ...]:
    """The backends a :class:`Run` drives on ``device``, fastest first: :data:`DRIVEN` on
    CUDA, SDPA elsewhere (the CPU's backend). ``planned``: the integration plans FlashInfer's
    wrappers per step, and FlashInfer goes first on CUDA: its decode wrapper splits long
    contexts over the GPU (at few rows and long contexts it is 2-8x faster than flash-attn 4
    on an H100, 10-15% slower at 32 rows and more) and its host time per call is about half
    flash-attn 4's (BENCHMARKS.md, "Decode attention per step through the adapters")."""
    if device != "cuda":
        return (Backend.SDPA,)
    return PLANNED + DRIVEN if planned else DRIVEN


def choose(need: Need, forced: str, who: str, variable: str, planned: bool = False) -> Backend:
    """The backend an engine integration binds for layers of ``need``: the first of
    :func:`driven` (``planned``: FlashInfer among them) that is installed and serves ``need``,
    or the one ``forced`` names (an integration's environment variable ``variable``, lower
    case; empty: none), for the messages of ``who``.

    Raises:
        LayoutError: ``forced`` names no driven backend, the one it names cannot run here, or
            none can (every reason named).
    """
    drivable = driven(need.device, planned)
    backend = Backend.AUTO
    if forced:
        names = [b.value for b in drivable]
        if forced not in names:
            raise LayoutError(f"{variable} must name one of {names} on {need.device}, got "
                              f"{forced!r}")
        backend = Backend(forced)
    return select(need, backend, drivable, who)


class Run:
    """The adapter call of one forward, for every layer: ``run(q, k_cache, v_cache, scale,
    window=False, softcap=0.0, sinks=None) -> out``.

    ``window`` picks the view's sliding-window part (the layers the model runs with a sliding
    window), ``local`` the forward's chunked-local-attention view (``pool.local`` updated for
    the same step; chunked layers), else the full part. SDPA: each part's gather
    plan (token slots, masks, query lanes) is computed once per forward, the first time a layer
    reads that part, instead of once per layer (a tree verify or draft step is one pass over
    its prefix and expand lanes: :mod:`.sdpa.tree`); when the full part's plan reads the cache in
    place with one query per row (a CPU decode step of equal rows), later layers go straight
    to :func:`.sdpa.lean.lean_out` (the same SDPA call, without the general path's steps).
    flash-attn reads the view's tensors directly, so there is nothing to prepare (FA2 only runs
    parts with one query count for every row; prefill and draft extend parts go through SDPA).
    FlashInfer runs the wrappers the integration planned for every part of the view before the
    forward (``planned``, with the scale and soft cap every layer must share:
    :meth:`.flashinfer_step.StepPlans.check`).
    """

    __slots__ = ("_args", "_lean", "_plans", "backend", "local", "planned", "view")

    def __init__(self, backend: Backend, view: object, num_q: int, num_heads: int,
                 num_kv_heads: int, dtype: torch.dtype, prefix_free: bool,
                 local: LocalView | None = None,
                 planned: tuple[GraphWrappers, StepPlans] | None = None) -> None:
        self.backend, self.view, self.local = backend, view, local
        self._args = (num_q, num_heads, num_kv_heads, dtype, prefix_free)
        self._plans: dict[int, Plan] = {}
        self._lean: Plan | None = None  # the full part's plan, when lean_out serves its layers
        self.planned = planned

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, scale: float | None, *,
                 window: bool = False, softcap: float = 0.0, sinks: Tensor | None = None,
                 local: bool = False) -> Tensor:
        lean = self._lean
        if lean is not None and not (window or local or softcap or sinks is not None):
            # a decode layer reading the cache in place: SDPA with nothing around it
            out = lean_out(lean, q, k, v, scale)
            if out is not None:
                return out
        view = self.view
        if local:
            if self.local is None:
                raise LayoutError("a chunked attention layer needs the step's pool.local view "
                                  "(the forward was bound without one)")
            view = self.local
        elif window:
            view = getattr(view, "window", None)
            if view is None:
                raise LayoutError("a sliding-window layer needs a pool with sliding_window "
                                  "(the view has no window part)")
        if self.planned is not None:
            wrappers, plans = self.planned
            plans.check(scale, softcap)
            return flashinfer_run(wrappers, view, q, k, v, sinks)
        part = _single_pass(view)
        backend = self.backend
        if backend is Backend.FA2 and (isinstance(part, (ExtendView, DraftExtendView)) or (
                isinstance(part, LocalView) and not part.rows_per_request)):
            backend = Backend.SDPA  # FA2 takes the same query count for every row: not these
        if backend is Backend.SDPA:
            key = 2 if local else int(window)
            pl = self._plans.get(key)
            if pl is None:
                target: PagedView | VerifyView | DraftStepView
                if part is not None:
                    target = part
                elif isinstance(view, (VerifyView, DraftStepView)) and tree_parts(view):
                    target = view  # a tree: one pass over its prefix and expand lanes
                else:  # a hand-built tree, causal or windowed prefix: two passes, merged
                    return attention_out(view, q, k, v, softmax_scale=scale,
                                         softcap=softcap, sinks=sinks)
                num_q, heads, kv_heads, dtype, prefix_free = self._args
                pl = self._plans[key] = plan(
                    target, num_q=num_q, num_heads=heads, num_kv_heads=kv_heads, dtype=dtype,
                    prefix_free=prefix_free and not local and part is not None)
                if key == 0 and lean_ready(pl):
                    self._lean = pl
            return run_plan(pl, q, k, v, softmax_scale=scale, softcap=softcap, sinks=sinks)
        from . import flash_attn as fa  # lazy: CUDA-only kernels

        ver = fa.FlashAttnVersion[backend.name]
        return fa.attention(view, q, k, v, version=ver, softmax_scale=scale, softcap=softcap,
                            sinks=sinks).out


def _single_pass(view: object) -> PagedView | None:
    """The one paged part of a single-pass view (chain verify and draft steps included)."""
    if isinstance(view, PagedView):
        return view
    if isinstance(view, (VerifyView, DraftStepView)) and view.expand is None:
        return view.prefix
    return None


def bind(backend: Backend, view: object, num_q: int, num_heads: int, num_kv_heads: int,
         dtype: torch.dtype, prefix_free: bool = False, local: LocalView | None = None,
         plans: StepPlans | None = None) -> Run:
    """:class:`Run` for every layer of one forward over ``view`` (``backend`` resolved).
    ``prefix_free``: the view is a prefill with nothing cached (see
    :func:`attnpool.adapters.sdpa.plan`); a model with softcapping or sinks must not pass it
    (those need the plan's mask). FlashInfer: ``plans`` plans every part of ``view`` here, once
    for the step (host-side: outside any graph capture)."""
    if backend in PLANNED:
        if plans is None or not isinstance(view, PagedView) or local is not None:
            raise LayoutError("FlashInfer runs over parts planned for the step: bind a "
                              "decode or extend view with the integration's StepPlans "
                              "(no chunked-local view)")
        return Run(backend, view, num_q, num_heads, num_kv_heads, dtype, prefix_free, local,
                   (plans.prepare(view), plans))
    if backend not in DRIVEN:
        raise InputError(f"resolve the backend first, got {backend}")
    return Run(backend, view, num_q, num_heads, num_kv_heads, dtype, prefix_free, local)

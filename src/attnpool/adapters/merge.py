"""What every adapter returns and how a view's passes combine: :class:`Attn`, the log-sum-exp
merge of two passes over disjoint keys, and the one place that says which passes a view has
(:func:`passes`), so every adapter accepts, and refuses, the same views.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import InputError
from ..views import DraftStepView, PagedView, VerifyView
from .variants import with_sinks


class Attn(NamedTuple):
    """Attention result: ``out [total_q, H, D]`` (q's dtype), ``lse [total_q, H]`` float32
    (float64 from the SDPA adapter given float64 queries, so a float64 reference stays float64
    through a tree's merge)."""

    out: Tensor
    lse: Tensor



def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Attn:
    """Combine two attention passes over disjoint key sets of the same queries.

    With ``lse = log(exp(lse1) + exp(lse2))`` the result is
    ``o1 * exp(lse1 - lse) + o2 * exp(lse2 - lse)``, exactly softmax attention over the union of the
    keys. A pass with no keys contributes nothing; if both are empty the output is 0 with
    ``lse = -inf``. An empty row's log-sum-exp is ``-inf`` here and in FlashInfer, but flash-attn
    (FA2 and FA3, unsplit) reports ``+inf`` for it: ``+inf`` is read as "no keys" too, so a tree
    pass whose expand or prefix part has an empty row merges to the other part, not to NaN.

    Args:
        o1, o2: ``[T, H, D]`` outputs. lse1, lse2: ``[T, H]`` natural-log log-sum-exp.
    """
    if o1.shape != o2.shape or lse1.shape != lse2.shape or tuple(o1.shape[:2]) != tuple(lse1.shape):
        raise InputError(f"merge_by_lse needs o [T, H, D] and lse [T, H] of equal shapes, got "
                         f"{tuple(o1.shape)}, {tuple(lse1.shape)}, {tuple(o2.shape)}, "
                         f"{tuple(lse2.shape)}")
    neg_inf = float("-inf")
    # float32 at least; float64 passes (the SDPA adapter's float64 reference) merge in float64
    lt = torch.promote_types(torch.promote_types(lse1.dtype, lse2.dtype), torch.float32)
    a = torch.where(torch.isposinf(lse1), neg_inf, lse1.to(lt))
    b = torch.where(torch.isposinf(lse2), neg_inf, lse2.to(lt))
    lse = torch.logaddexp(a, b)
    ref = torch.where(torch.isneginf(lse), 0.0, lse)  # keeps exp() finite when both are empty
    w1 = torch.exp(a - ref)[..., None]
    w2 = torch.exp(b - ref)[..., None]
    ot = torch.promote_types(o1.dtype, lt)
    out = (o1.to(ot) * w1 + o2.to(ot) * w2).to(o1.dtype)
    return Attn(out, lse)


def passes(view: object) -> tuple[PagedView, PagedView | None]:
    """The paged passes of one attention over ``view``: ``(view, None)``, or a verify / draft
    step's ``(prefix, expand)`` (expand None unless a tree). Every adapter's ``attention`` reads
    its view through this, so all of them accept, and refuse, the same views."""
    if isinstance(view, PagedView):
        return view, None
    if isinstance(view, (VerifyView, DraftStepView)):
        return view.prefix, view.expand
    raise InputError(f"attention expects a PagedView, VerifyView or DraftStepView, got "
                     f"{type(view).__name__}; call it on each part of other views "
                     "(EncoderView.cross / .decoder, DraftView.steps[d])")


def run_passes(view: object, run: Callable[[PagedView, bool, Tensor | None], Attn],
               sinks: Tensor | None = None) -> Attn:
    """``run(part, first, sinks)`` on each of :func:`passes` of ``view``, a tree's two passes
    merged by :func:`merge_by_lse`. ``first`` is True for the first pass only: what a kernel
    plans per part (FA3's scheduler metadata) belongs to that one.

    ``sinks`` (already checked) are applied once per query row: a single pass gets them (the
    kernel may take them itself); two passes run without them and the merged rows get them
    from the merged log-sum-exp (:func:`~attnpool.adapters.variants.with_sinks`)."""
    first, second = passes(view)
    if second is None:
        return run(first, True, sinks)
    a = run(first, True, None)
    b = run(second, False, None)
    merged = merge_by_lse(a.out, a.lse, b.out, b.lse)
    if sinks is None:
        return merged
    out, lse = with_sinks(merged.out, merged.lse, sinks)
    return Attn(out, lse.float())

"""The lean decode layer (``sdpa.lean``): SDPA with nothing around it, keys read in place.

It must give exactly what ``run_plan`` gives for the same plan (the same SDPA call over the same
tensors), serve only plans it can (one query per row, keys in place), decline anything else it is
handed (so the general path checks it and names the problem), and be what a bound forward's
later decode layers take.
"""

from __future__ import annotations

import pytest
import torch

from attnpool import InputError, Layout
from attnpool.adapters import binding
from attnpool.adapters.backends import Backend
from attnpool.adapters.sdpa import lean, planning, run_plan
from attnpool.views import ExtendView

from tests.adapters.sdpa.test_gather import H_KV, PAGE, D, H, plan_of, pool, run_view

pytestmark = pytest.mark.usefixtures("one_thread")


def packed_q(n: int, transposed: bool) -> torch.Tensor:
    """``[n, H, D]`` queries, as transformers hands them (a transposed view) or contiguous."""
    if transposed:
        return torch.randn(1, H, n, D)[0].transpose(0, 1)
    return torch.randn(n, H, D)


@pytest.mark.parametrize(("lens", "firsts"), [((9, 9, 9), (1, 4, 7)), ((7,), (5,)),
                                              ((6, 6), (3, 3))])
@pytest.mark.parametrize("transposed", [False, True])
def test_lean_layer_is_run_plan_exactly(lens: tuple[int, ...], firsts: tuple[int, ...],
                                        transposed: bool) -> None:
    kv, pl = pool(), plan_of(run_view(lens, firsts))
    assert lean.lean_ready(pl)
    q = packed_q(len(lens), transposed)
    for layer in range(3):
        got = lean.lean_out(pl, q, kv.k_cache(layer), kv.v_cache(layer), 0.3)
        assert got is not None
        assert torch.equal(got, run_plan(pl, q, kv.k_cache(layer), kv.v_cache(layer),
                                         softmax_scale=0.3))


def test_plans_it_does_not_serve() -> None:
    assert not lean.lean_ready(plan_of(run_view((9, 5, 9), (1, 4, 7))))  # keys copied
    n, lens = 2, (9, 9)
    table = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    ext = ExtendView(n, torch.tensor(lens, dtype=torch.int32),
                     torch.tensor([0, 2, 4], dtype=torch.int32),
                     torch.tensor([0, 9, 18], dtype=torch.int32), table, None, None, None, 2, 9,
                     PAGE, True, positions=torch.zeros(4, dtype=torch.int32))
    pl = planning.build(ext, Layout.FLASH_ATTN, 4, H, H_KV, clamp=True, dtype=torch.float32)
    assert pl.gather.run is not None and not lean.lean_ready(pl)  # two queries per row


@pytest.mark.parametrize("case", ["heads", "rows", "dtype", "short_cache", "strided_cache",
                                  "mask_dtype"])
def test_anything_else_is_declined(case: str) -> None:
    kv, pl = pool(), plan_of(run_view((9, 9), (1, 4)))
    q, k, v = packed_q(2, False), kv.k_cache(0), kv.v_cache(0)
    if case == "heads":
        q = torch.randn(2, H + 1, D)
    elif case == "rows":
        q = torch.randn(3, H, D)
    elif case == "dtype":
        q = q.double()
    elif case == "short_cache":
        k, v = k[:5], v[:5]
    elif case == "strided_cache":  # pages whose token rows are not one run (vLLM's CPU layout)
        k = torch.randn(12, 2 * PAGE, H_KV, D)[:, :PAGE]
        v = torch.randn(12, 2 * PAGE, H_KV, D)[:, :PAGE]
    else:
        q = q.half()
        k, v = k.half(), v.half()
    assert lean.lean_out(pl, q, k, v, None) is None


def test_bound_forward_takes_it_after_the_first_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    kv, v = pool(), run_view((9, 9, 9), (1, 4, 7))
    calls: list[bool] = []
    orig = lean.lean_out

    def rec(*a: object, **k: object) -> torch.Tensor | None:
        out = orig(*a, **k)  # type: ignore[arg-type]
        calls.append(out is not None)
        return out

    monkeypatch.setattr(binding, "lean_out", rec)
    run = binding.bind(Backend.SDPA, v, 3, H, H_KV, torch.float32)
    q = packed_q(3, True)
    outs = [run(q, kv.k_cache(i), kv.v_cache(i), 0.25) for i in range(3)]
    assert calls == [True, True]  # the first layer plans (the general path), the others are lean
    pl = plan_of(v)
    for i, o in enumerate(outs):
        assert torch.equal(o, run_plan(pl, q, kv.k_cache(i), kv.v_cache(i), softmax_scale=0.25))
    run(q, kv.k_cache(0), kv.v_cache(0), 0.25, softcap=5.0)  # softcap: the explicit path
    assert calls == [True, True]
    with pytest.raises(InputError, match=r"query heads|must match the plan"):
        run(torch.randn(3, H + 2, D), kv.k_cache(0), kv.v_cache(0), 0.25)
    assert calls == [True, True, False]  # declined, then the general path named the problem

"""The CPU decode path over vLLM's cache blocks (no vLLM needed): a decode step refilled from
vLLM's batch, attention straight from the blocks (keys left transposed) equals dense attention
per row in float64, with NaN in every lane no row owns, rows ending inside and on a block
boundary, a sliding window, softcapping and sinks."""

from __future__ import annotations

import math

import pytest
import torch

from attnpool import InputError
from attnpool.adapters.backends import Backend
from attnpool.integrations.vllm.cache import cpu_views, store_
from attnpool.integrations.vllm.decode_cpu import attend, plan_blocks
from attnpool.integrations.vllm.step import EngineSizes, StepFiller

from tests.helpers.dense import dense_attention

H, H_KV, D, P = 6, 2, 32, 16
F64 = torch.float64


def _step(window: int | None, seq_lens: list[int]) -> tuple[object, torch.Tensor, list[list[int]]]:
    """A decode step of ``len(seq_lens)`` rows: (metadata, cache, each row's key slots)."""
    sizes = EngineSizes(max_num_seqs=6, max_num_batched_tokens=48, max_model_len=160,
                        block_size=P, sliding_window=window, num_blocks=64,
                        device=torch.device("cpu"))
    f = StepFiller(sizes, Backend.SDPA, H, H_KV, F64)
    n = len(seq_lens)
    table = torch.zeros(8, 10, dtype=torch.int32)
    free = list(range(1, 64))
    torch.manual_seed(len(seq_lens))
    free = [free[i] for i in torch.randperm(len(free)).tolist()]  # scattered blocks
    for r, length in enumerate(seq_lens):
        pages = math.ceil(length / P)
        table[r, :pages] = torch.tensor(free[:pages], dtype=torch.int32)
        free = free[pages:]
    slots = [int(table[r, (s - 1) // P]) * P + (s - 1) % P for r, s in enumerate(seq_lens)]
    md = f.fill(num_reqs=n, num_actual_tokens=n, max_query_len=1,
                query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
                slot_mapping=torch.tensor(slots, dtype=torch.int64))
    kv = torch.full((64, H_KV, P, 2 * D), float("nan"), dtype=F64)  # no row owns these lanes
    kv[0] = 0  # vLLM's null block
    k, v = cpu_views(kv)
    keys = []
    for r, length in enumerate(seq_lens):
        row = [int(table[r, pos // P]) * P + pos % P for pos in range(length)]
        for s in row:
            k[s // P, s % P] = torch.randn(H_KV, D, dtype=F64)
            v[s // P, s % P] = torch.randn(H_KV, D, dtype=F64)
        lo = 0 if window is None else max(0, length - window)
        keys.append(row[lo:])
    # this step's token goes in through the step's own store indices
    store_(k, v, torch.randn(n, H_KV, D, dtype=F64), torch.randn(n, H_KV, D, dtype=F64),
           md.blocks, md.offsets)
    return md, kv, keys


@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_from_blocks_matches_dense_attention(window: int | None, variant: str) -> None:
    md, kv, keys = _step(window, [1, 16, 17, 40, 70, 95])
    view = md.view  # type: ignore[attr-defined]
    part = view.window if window is not None else view
    assert part is not None
    softcap = 7.0 if variant == "softcap" else 0.0
    sinks = torch.linspace(-1.0, 1.5, H, dtype=torch.float32) if variant == "sinks" else None
    q = torch.randn(6, H, D, dtype=F64)
    plan = md.block_plan(part, H_KV)  # type: ignore[attr-defined]
    assert md.block_plan(part, H_KV) is plan  # once per step and part  # type: ignore[attr-defined]
    out = attend(plan, q, kv, D ** -0.5, softcap, sinks)
    k, v = cpu_views(kv)
    want, _ = dense_attention(q, k, v, keys, D ** -0.5, softcap=softcap,
                              sinks=None if sinks is None else sinks.double())
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_plan_reads_the_pool_view_not_vllm_tensors() -> None:
    """The plan comes from the refilled pool buffers: a shortened ``cache_seqlens`` changes the
    result (the path reads the pool, so corrupting it shows)."""
    md, kv, _ = _step(None, [30, 41])
    view = md.view  # type: ignore[attr-defined]
    q = torch.randn(2, H, D, dtype=F64)
    good = attend(plan_blocks(view, 2, H_KV), q, kv, D ** -0.5)
    view.cache_seqlens[1] -= 1
    bad = attend(plan_blocks(view, 2, H_KV), q, kv, D ** -0.5)
    assert torch.equal(good[0], bad[0]) and not torch.allclose(good[1], bad[1])


def test_refusals() -> None:
    md, kv, _ = _step(None, [5])
    plan = plan_blocks(md.view, 1, H_KV)  # type: ignore[attr-defined]
    with pytest.raises(InputError, match="expected q"):
        attend(plan, torch.zeros(2, H, D, dtype=F64), kv, 1.0)
    with pytest.raises(InputError, match="KV heads"):
        attend(plan_blocks(md.view, 1, 3), torch.zeros(1, H, D, dtype=F64), kv, 1.0)  # type: ignore[attr-defined]

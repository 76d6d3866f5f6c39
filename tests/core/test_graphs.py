"""GraphRunner: eager fallback on CPU; capture + replay on CUDA (cuda marker)."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import BufferPool, InputError, Layout, Phase, PoolConfig
from attnpool.graphs import GraphRunner, default_capture_sizes

from tests.helpers.batches import make_batch, make_table


def _meta_forward(view: Any, x: torch.Tensor) -> torch.Tensor:
    """A forward whose output depends on the metadata a kernel reads (lengths, first page)."""
    rows = view.bs
    lens = view.cache_seqlens[:rows].to(x.dtype)
    first = view.page_table[:rows, 0].to(x.dtype)
    return x * lens[:, None] + first[:, None]


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(160)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(160)[-1] == 160
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(3) == [1, 2, 3]


def test_eager_runner_on_cpu_matches_direct() -> None:
    cfg = PoolConfig(max_bs=8, max_context_len=128, page_size=16, device="cpu")
    pool = BufferPool(cfg, poison=True)
    runner = GraphRunner(pool, Phase.DECODE, _meta_forward, torch.empty(1, 4))
    assert not runner.use_graphs
    rng = random.Random(0)
    table = make_table(cfg, 16, rng)
    for n in (1, 3, 8):
        b = make_batch(cfg, n, rng, table=table)
        seq, rpi, tab = b.tensors()
        x = torch.randn(n, 4)
        out = runner.run(x, seq_lens=seq, req_pool_indices=rpi, req_to_token=tab)
        view = BufferPool(cfg).decode.update_(n, seq_lens=seq, req_pool_indices=rpi, req_to_token=tab)
        assert torch.equal(out, _meta_forward(view, x))


def test_runner_rejects_bad_input() -> None:
    cfg = PoolConfig(max_bs=4, max_context_len=64, device="cpu")
    runner = GraphRunner(BufferPool(cfg), Phase.DECODE, _meta_forward, torch.empty(1, 4))
    seq = torch.tensor([3, 4])
    with pytest.raises(InputError, match="x must be"):
        runner.run(torch.randn(3, 4), seq_lens=seq, req_pool_indices=seq,
                   req_to_token=torch.zeros(8, 64, dtype=torch.int32))
    with pytest.raises(InputError, match="at least one"):
        runner.run(torch.randn(0, 4), seq_lens=seq[:0], req_pool_indices=seq[:0],
                   req_to_token=torch.zeros(8, 64, dtype=torch.int32))


def replays_match_eager(dev: torch.device, steps: int, memory: Callable[[], int]) -> None:
    """A stream of random decode batches through the runner equals the forward over a separate
    reference pool, ``memory()`` is the same after the stream as before it, and no arena pointer
    moves. Everything the stream keeps (the reference pool included) exists before the baseline
    is read; per-step tensors are freed each step."""
    cfg = PoolConfig(max_bs=32, max_context_len=4096, page_size=16, device=dev,
                     layout=Layout.BOTH)
    pool = BufferPool(cfg, poison=True)
    runner = GraphRunner(pool, Phase.DECODE, _meta_forward, torch.empty(1, 8, device=dev))
    assert runner.use_graphs == (dev.type == "cuda")
    if runner.use_graphs:
        assert set(runner._graphs) == set(runner.capture_sizes)
    ptrs = {k: v.data_ptr() for k, v in pool.arena.buffers().items()}
    rng = random.Random(0)
    table = make_table(cfg, 64, rng).to(dev)
    ref_pool = BufferPool(cfg)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    gc.collect()  # cycles left by the setup's first calls would be freed mid-stream otherwise
    mem0 = memory()
    for step in range(steps):
        n = rng.randint(1, 32)
        b = make_batch(cfg, n, rng, table=table.cpu())
        seq, rpi, tab = b.tensors(dev)
        x = torch.randn(n, 8, device=dev)
        out = runner.run(x, seq_lens=seq, req_pool_indices=rpi, req_to_token=tab)
        want = _meta_forward(ref_pool.decode.update_(n, seq_lens=seq, req_pool_indices=rpi,
                                                     req_to_token=tab), x)
        assert torch.equal(out, want), step
        del seq, rpi, tab, x, out, want
    if dev.type == "cuda":
        torch.cuda.synchronize()
    gc.collect()  # only what is still referenced counts
    assert memory() == mem0
    assert {k: v.data_ptr() for k, v in pool.arena.buffers().items()} == ptrs


def live_pool_bytes() -> int:
    """CPU stand-in for ``memory_allocated``: bytes of every live pool's arena."""
    gc.collect()
    return sum(o.nbytes for o in gc.get_objects() if type(o) is BufferPool)


def test_replays_match_eager_and_memory_is_flat_cpu() -> None:
    replays_match_eager(torch.device("cpu"), 20, live_pool_bytes)


@pytest.mark.cuda
def test_cuda_graph_replays_match_eager() -> None:
    replays_match_eager(torch.device("cuda"), 1000, torch.cuda.memory_allocated)

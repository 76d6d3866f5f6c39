"""Mixed prefill + decode batches replayed from ONE captured extend graph with static bounds.

vLLM v1 and SGLang with chunked prefill run decode rows and prefill chunks in one forward, one
``pool.extend`` update (docs/design.md, Extend: "Mixed batches"). The capture state of
``pool.extend.view(bs)`` has ``max_seqlen_q = T`` (``max_extend_tokens``), ``max_seqlen_k =
max_context_len`` and ``cu_seqlens_q = [0, T, T, ...]``; an ``update_`` without host copies keeps
exactly those host bounds (it returns the same view object), and a padded batch always ends at
``cu_seqlens_q[bs] = T``. So one graph captured on the capture view serves every mixed batch of
at most ``bs`` requests and ``T`` tokens: this test captures flash-attn 4 on that view once and
replays a stream of random mixed batches (decode rows, prefill chunks with a cached prefix, whole
prompts), each refilled into the SAME pool in place, and compares the real query rows with the
SDPA adapter over a separate reference pool refilled with the same batch at the same ``bs``.

On CUDA (``flash_attn.cute`` importable): a real ``torch.cuda.CUDAGraph``, ``ATTNPOOL_GRAPH_STEPS``
replays (at most and by default 200), flat ``memory_allocated()`` across replays and arena
pointers that never move. On CPU the same logic runs against the FA4 fake
(``tests/helpers/fakes_fa4.py``, which asserts what the real interface asserts) with the graph
simulated (replay re-runs the captured call on the captured view and static query buffer), so CI
exercises the test's logic.
"""

from __future__ import annotations

import functools
import gc
import os
import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Impl, Layout, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import sdpa

from tests.helpers.batches import make_table
from tests.helpers.fakes_fa4 import FA4
from tests.helpers.graph_replay import capture, mixed_batch

H, H_KV, PAGE = 4, 2, 16
BF16 = torch.bfloat16
ROWS = 24  # req_to_token rows (requests the engine holds); each step samples distinct ones
#: replays per CUDA case: ATTNPOOL_GRAPH_STEPS caps it (compute-sanitizer runs set it low)
CUDA_STEPS = min(200, int(os.environ.get("ATTNPOOL_GRAPH_STEPS", "200")))
CPU_STEPS = 4
TOL = 2e-2  # bf16 inputs, float32 accumulation in both: a few bf16 ulps


@dataclass(frozen=True)
class Dims:
    """Sizes of one run: head dim, T = max_extend_tokens, max_context_len, max_bs."""

    d: int
    t: int
    c: int
    max_bs: int


#: the GPU run's sizes (FA4's Hopper kernels take head dim 128)
CUDA_DIMS = Dims(d=128, t=256, c=1024, max_bs=8)
#: smaller on CPU, where the fake computes every call in float32: the same logic in seconds
CPU_DIMS = Dims(d=64, t=96, c=256, max_bs=4)
#: (name, bs offset from max_bs, every step full): a padded bs (n <= bs, the first padded row
#: takes the slack up to T) and bs = max_bs with n == bs (no padded row, cu_seqlens_q[bs] < T)
SHAPES = [("padded", 1, False), ("full", 0, True)]


def make_pool(dims: Dims, dev: torch.device, impl: Impl) -> BufferPool:
    cfg = PoolConfig(max_bs=dims.max_bs, max_context_len=dims.c, page_size=PAGE, device=dev,
                     layout=Layout.FLASH_ATTN, pad_page=0, impl=impl,
                     max_extend_tokens=dims.t)
    return BufferPool(cfg, poison=True)


def kv_cache(table: Tensor, d: int, dev: torch.device) -> tuple[Tensor, Tensor]:
    """``k, v [pages, PAGE, H_KV, d]`` bf16, random everywhere (the pad page 0 included: finite)."""
    pages = int(table.max()) // PAGE + 2
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(pages, PAGE, H_KV, d, generator=g).to(dev, BF16)  # type: ignore[return-value]
                 for _ in range(2))


def extend_stream(dev: torch.device, dims: Dims, impl: Impl, bs: int, full: bool, steps: int,
                  kernel: fa.FlashKernel, seed: int) -> None:
    """Capture FA4 once on ``pool.extend.view(bs)``, then replay ``steps`` random mixed batches
    refilled in place; each step's real rows must match SDPA over a reference pool."""
    rng = random.Random(seed)
    pool = make_pool(dims, dev, impl)
    ref = make_pool(dims, dev, Impl.REFERENCE)
    table = make_table(pool.cfg, ROWS, rng).to(dev)
    k, v = kv_cache(table, dims.d, dev)
    q = torch.zeros(dims.t, H, dims.d, dtype=BF16, device=dev)  # the graph's static input
    cap = pool.extend.view(bs)
    assert (cap.max_seqlen_q, cap.max_seqlen_k) == (dims.t, dims.c)
    assert cap.cu_seqlens_q.tolist() == [0] + [dims.t] * bs

    def forward() -> Tensor:
        return fa.attention(cap, q, k, v, version=fa.FlashAttnVersion.FA4, kernel=kernel).out

    replay, out = capture(forward, dev)
    assert out.shape == (dims.t, H, dims.d)
    ptrs = {key: t.data_ptr() for key, t in pool.arena.buffers().items()}
    mems: list[int] = []  # bytes allocated after each step (the first may warm caches up)
    for step in range(steps):
        n = bs if full else rng.choice([1, bs, rng.randint(1, bs)])
        seq, ext = mixed_batch(n, dims.t, dims.c, rng)
        rpi = rng.sample(range(ROWS), n)
        kw = {"seq_lens": torch.tensor(seq, device=dev),
              "extend_lens": torch.tensor(ext, dtype=torch.int32, device=dev),
              "req_pool_indices": torch.tensor(rpi, device=dev), "req_to_token": table}
        # no seq_lens_cpu / extend_lens_cpu: the bounds stay the capture's, the view is the same
        view = pool.extend.update_(bs, **kw)
        assert view is cap, "an update without host copies must hand back the captured view"
        rows = sum(ext)
        q[rows:].zero_()
        q[:rows].copy_(torch.randn(rows, H, dims.d, device=dev).to(BF16))
        replay()
        want_view = ref.extend.update_(bs, **kw)
        want = sdpa.attention(want_view, q.float(), k.float(), v.float()).out[:rows]
        torch.testing.assert_close(out[:rows].float(), want, rtol=TOL, atol=TOL,
                                   msg=functools.partial("step {}: {}".format, step))
        del kw, view, want_view, want
        if dev.type == "cuda":  # (the allocator counts on the host: no sync needed)
            if step < 2:  # what a first call left in reference cycles is not live memory
                gc.collect()
            mems.append(torch.cuda.memory_allocated())
    if dev.type == "cuda" and steps >= 2:
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == mems[1], f"replays must not grow memory: {mems}"
    assert {key: t.data_ptr() for key, t in pool.arena.buffers().items()} == ptrs


@pytest.mark.parametrize(("shape", "less", "full"), SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.AUTO], ids=["reference", "auto"])
def test_extend_graph_fa4_cpu(fake_fa4: FA4, impl: Impl, shape: str, less: int,
                              full: bool) -> None:
    """The CUDA test's logic on CPU (AUTO is the reference path here): every FA4 call gets the
    capture's static bounds and the pool's own metadata memory."""
    dims = CPU_DIMS
    kernel = fa.load_fa4()
    extend_stream(torch.device("cpu"), dims, impl, dims.max_bs - less, full, CPU_STEPS, kernel,
                  seed=len(shape))
    assert len(fake_fa4.calls) == 3 + CPU_STEPS  # warm-ups, capture, one per replay
    first = fake_fa4.calls[0]
    for call in fake_fa4.calls:
        assert call["max_seqlen_q"] == dims.t and call["causal"] is True
        for name in ("cu_seqlens_q", "seqused_k", "page_table"):
            assert call[name].data_ptr() == first[name].data_ptr(), name


def _fa4_or_skip() -> fa.FlashKernel:
    try:
        return fa.load_fa4()
    except ImportError as e:
        pytest.skip(f"flash_attn.cute does not load: {e}")


@pytest.mark.cuda
@pytest.mark.parametrize(("shape", "less", "full"), SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.AUTO], ids=["reference", "auto"])
def test_extend_graph_fa4_cuda(impl: Impl, shape: str, less: int, full: bool) -> None:
    kernel = _fa4_or_skip()
    dims = CUDA_DIMS
    extend_stream(torch.device("cuda"), dims, impl, dims.max_bs - less, full, CUDA_STEPS, kernel,
                  seed=len(shape))

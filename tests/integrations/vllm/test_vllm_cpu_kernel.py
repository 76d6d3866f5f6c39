"""vLLM's CPU attention kernel fed from a refilled pool equals attnpool's SDPA adapter.

The kernel (``attnpool.integrations.vllm.cpu_kernel``) reads the pool's ``cu_seqlens_q``,
``cache_seqlens`` and ``page_table`` and a cache in the layout attnpool's store writes; the
adapter reads the same view and cache through its own gather. Both are float32 here, so they
agree to rounding (another summation order), for decode and mixed steps, with and without a
window, softcap and sinks. A corrupted pool length changes the kernel's output (it reads the
pool, not a copy).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops  # noqa: F401  (loads vLLM's CPU ops)

from attnpool.adapters.backends import Backend
from attnpool.adapters.binding import bind
from attnpool.integrations.vllm.cache import cpu_views
from attnpool.integrations.vllm.cpu_kernel import STORE_ISA, CPUKernel
from attnpool.integrations.vllm.step import EngineSizes, StepFiller

H, HK, D, P, BLOCKS = 4, 2, 64, 32, 24


def _step(window: int | None, q_lens: list[int], lens: list[int]
          ) -> tuple[StepFiller, CPUKernel, object, torch.Tensor]:
    sizes = EngineSizes(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512,
                        block_size=P, sliding_window=window, num_blocks=BLOCKS,
                        device=torch.device("cpu"))
    filler = StepFiller(sizes, Backend.SDPA, H, HK, torch.float32)
    kernel = CPUKernel(H, HK, D, torch.float32, window, STORE_ISA, True)
    filler.kernel = kernel
    g = torch.Generator().manual_seed(len(lens))
    n = len(lens)
    # 16 columns (max_model_len / P); the rows' 4 live blocks are distinct
    table = torch.randint(1, BLOCKS, (n, 16), generator=g, dtype=torch.int32)
    table[:, :4] = (torch.randperm(BLOCKS - 1, generator=g)[: n * 4] + 1).view(n, 4)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    md = filler.fill(num_reqs=n, num_actual_tokens=t, max_query_len=max(q_lens),
                     query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32),
                     block_table=table, slot_mapping=torch.zeros(t, dtype=torch.int64))
    cache = torch.randn(BLOCKS, HK, P, 2 * D, generator=g)
    return filler, kernel, md, cache


@pytest.mark.parametrize(("q_lens", "lens"), [([1, 1, 1], [5, 40, 97]),
                                              ([1, 7, 3], [33, 64, 100])])
@pytest.mark.parametrize(("window", "softcap", "sinks"), [(None, 0.0, False), (16, 0.0, False),
                                                          (None, 20.0, True)])
def test_kernel_equals_the_sdpa_adapter(q_lens: list[int], lens: list[int], window: int | None,
                                        softcap: float, sinks: bool) -> None:
    _, kernel, md, cache = _step(window, q_lens, lens)
    t = sum(q_lens)
    q = torch.randn(t, H, D, generator=torch.Generator().manual_seed(7))
    s = torch.randn(H, generator=torch.Generator().manual_seed(8)) if sinks else None
    assert md.kernel is not None
    out = torch.full((t, H, D), float("nan"))
    kernel.attend(md.kernel, q, cache, out, 0.125, window, softcap, s)
    k, v = cpu_views(cache)
    assert md.run is None  # (vLLM's kernel attends: no adapter call bound per step)
    run = bind(Backend.SDPA, md.view, t, H, HK, torch.float32)
    want = run(q, k, v, 0.125, window=window is not None, softcap=softcap, sinks=s)
    torch.testing.assert_close(out, want.view(t, H, D), rtol=1e-5, atol=1e-5)


def test_kernel_reads_the_pools_lengths() -> None:
    _, kernel, md, cache = _step(None, [1, 1], [50, 70])
    q = torch.randn(2, H, D, generator=torch.Generator().manual_seed(3))
    assert md.kernel is not None
    a, b = torch.empty(2, H, D), torch.empty(2, H, D)
    kernel.attend(md.kernel, q, cache, a, 0.125, None, 0.0, None)
    md.view.cache_seqlens[1] -= 5  # the pool's buffer, which the kernel step holds
    kernel.attend(md.kernel, q, cache, b, 0.125, None, 0.0, None)
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1], b[1])


def test_kernel_store_writes_attnpools_bytes() -> None:
    """vLLM's store op (the kernel path's) and attnpool's store write the same cache bytes;
    vLLM's skips slot -1 (attnpool's sends it to the null block 0, which nothing reads)."""
    from attnpool.integrations.vllm.cache import slot_index_, store_

    kernel = CPUKernel(H, HK, D, torch.float32, None, STORE_ISA, True)
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm((BLOCKS - 1) * P, generator=g)[:40] + P  # never block 0
    key, value = torch.randn(40, HK, D, generator=g), torch.randn(40, HK, D, generator=g)
    ours, theirs = torch.zeros(BLOCKS, HK, P, 2 * D), torch.zeros(BLOCKS, HK, P, 2 * D)
    blocks, offsets = torch.empty(40, dtype=torch.int64), torch.empty(40, dtype=torch.int64)
    slot_index_(slots, P, blocks, offsets)
    store_(*cpu_views(ours), key, value, blocks, offsets)
    kernel.store(key, value, theirs, slots)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    padded = slots.clone()
    padded[::3] = -1
    again = torch.zeros_like(theirs)
    kernel.store(key, value, again, padded)
    assert not again[0].any()
    keep = padded >= 0
    want = torch.zeros_like(theirs)
    kernel.store(key[keep], value[keep], want, padded[keep])
    assert torch.equal(again.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(again.view(torch.uint8), theirs.view(torch.uint8))

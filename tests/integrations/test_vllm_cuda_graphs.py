"""The vLLM backend's refill (:class:`attnpool.integrations.vllm.step.StepFiller`) under CUDA
graphs, without vLLM: vLLM-shaped batches in vLLM's CUDA cache layout, read by flash-attn 4
through the per-layer call the backend binds, replayed from captured graphs.

vLLM's CUDA runner pads a batch it replays to the captured size: requests past the real ones
get no query (``query_start_loc`` repeated), length 0 and the null block in the block table,
and tokens past the real ones go to slot -1. On CUDA the filler passes no host copy, so a
refill keeps the view's static bounds (``max_seqlen_q = T``, ``max_seqlen_k = C``) and hands back
the very view a graph captured: every mixed batch of at most ``bs`` requests and ``T`` tokens
replays from ONE extend graph, and uniform decode batches from one decode graph per size. The
backend declares ``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE`` today; the extend stream
is what a declaration of ``ALWAYS`` for flash-attn would rely on (vLLM's ``FULL`` keys pad a
mixed batch to ``min(num_tokens, max_num_seqs)`` requests, as here). Each replay's real rows
are compared with the SDPA adapter over a second filler refilled eagerly from the same batch
(float32 over the bf16 cache).

On CUDA (``flash_attn.cute`` importable): real graphs, ``ATTNPOOL_GRAPH_STEPS`` replays (at
most and by default 200) per graph. On CPU the same logic runs against the FA4 fake with the
graph simulated (``tests.helpers.graph_replay.capture``), the filler in its CUDA mode (no host
copies). FlashInfer is not in it: the backend does not drive FlashInfer's wrappers.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from attnpool.adapters import flash_attn as fa
from attnpool.adapters.backends import Backend
from attnpool.integrations.vllm.cache import cuda_views
from attnpool.integrations.vllm.step import EngineSizes, StepFiller

from tests.helpers.fakes_fa4 import FA4
from tests.helpers.graph_replay import capture, mixed_batch

H, H_KV, P = 4, 2, 16
BF16 = torch.bfloat16
CUDA_STEPS = min(200, int(os.environ.get("ATTNPOOL_GRAPH_STEPS", "200")))
CPU_STEPS = 4
TOL = 2e-2


@dataclass(frozen=True)
class Dims:
    """head dim, T = max_num_batched_tokens, C = max_model_len, max_num_seqs, cache blocks."""

    d: int
    t: int
    c: int
    max_bs: int
    blocks: int


CUDA_DIMS = Dims(d=128, t=256, c=1024, max_bs=8, blocks=8 * 64 + 1)
CPU_DIMS = Dims(d=64, t=96, c=256, max_bs=4, blocks=4 * 16 + 1)


def _filler(dims: Dims, dev: torch.device) -> StepFiller:
    sizes = EngineSizes(max_num_seqs=dims.max_bs, max_num_batched_tokens=dims.t,
                        max_model_len=dims.c, block_size=P, sliding_window=None,
                        num_blocks=dims.blocks, device=dev)
    f = StepFiller(sizes, Backend.FA4, H, H_KV, BF16)
    f.host = False  # CUDA's mode on any device: no host copies, static bounds
    return f


@dataclass
class Batch:
    """One padded step as vLLM's CUDA runner hands it to ``build`` (rows past ``n``: padding)."""

    n: int
    seq: list[int]
    ext: list[int]
    kw: dict[str, object]


def vllm_batch(seq: list[int], ext: list[int], bs: int, dims: Dims, dev: torch.device,
               rng: random.Random) -> Batch:
    """``CommonAttentionMetadata``'s fields for requests ``seq`` / ``ext`` padded to ``bs``
    requests and ``T`` tokens: distinct random blocks per request (block 0 is vLLM's null
    block), the padded requests' queries empty and lengths 0, padded tokens at slot -1."""
    n, width = len(seq), dims.c // P
    blocks = rng.sample(range(1, dims.blocks), sum(-(-s // P) for s in seq))
    table = torch.zeros(bs, width, dtype=torch.int32)
    qsl, slots, at = [0], [], 0
    for i, (s, e) in enumerate(zip(seq, ext, strict=True)):
        pages = -(-s // P)
        table[i, :pages] = torch.tensor(blocks[at:at + pages])
        at += pages
        qsl.append(qsl[-1] + e)
        slots += [int(table[i, pos // P]) * P + pos % P for pos in range(s - e, s)]
    qsl += [qsl[-1]] * (bs - n)
    kw = {"num_reqs": bs, "num_actual_tokens": dims.t, "max_query_len": max(ext),
          "query_start_loc": torch.tensor(qsl, dtype=torch.int32, device=dev),
          "seq_lens": torch.tensor(seq + [0] * (bs - n), dtype=torch.int32, device=dev),
          "block_table": table.to(dev),
          "slot_mapping": torch.tensor(slots + [-1] * (dims.t - len(slots)), device=dev)}
    return Batch(n, seq, ext, kw)


def _caches(dims: Dims, dev: torch.device) -> tuple[Tensor, Tensor]:
    """vLLM's FlashAttention cache of one layer, ``[2, blocks, P, H_kv, D]``, random, split
    into its two NHD views (no copy)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, dims.blocks, P, H_KV, dims.d, generator=g).to(dev, BF16)
    return cuda_views(kv)


def stream(dev: torch.device, dims: Dims, decode: bool, bs: int, steps: int, seed: int) -> int:
    """Capture the bound call once on the first batch's view, replay ``steps`` random batches
    refilled into the same filler; returns the kernel calls made."""
    rng = random.Random(seed)
    f, ref = _filler(dims, dev), _filler(dims, dev)
    ref.backend, ref.dtype = Backend.SDPA, torch.float32  # (its plans' masks: float32 queries)
    k, v = _caches(dims, dev)
    q = torch.zeros(dims.t, H, dims.d, dtype=BF16, device=dev)  # the graph's static input

    def draw() -> Batch:
        while True:
            n = rng.choice([1, bs, rng.randint(1, bs)])
            if decode:
                seq, ext = [rng.randint(1, dims.c) for _ in range(n)], [1] * n
            else:
                seq, ext = mixed_batch(n, dims.t, dims.c, rng)
            if decode or max(ext) > 1:  # (an all-decode batch replays a decode graph)
                return vllm_batch(seq, ext, bs, dims, dev, rng)

    md = f.fill(**draw().kw)  # type: ignore[arg-type]
    view, run = md.view, md.run
    assert run is not None and (view.max_seqlen_k, view.bs) == (dims.c, bs)
    replay, out = capture(lambda: run(q, k, v, dims.d ** -0.5), dev)
    for step in range(steps):
        b = draw()
        again = f.fill(**b.kw)  # type: ignore[arg-type]
        assert again.view is view, "a refill without host copies hands back the captured view"
        rows = sum(b.ext)
        q.zero_()
        q[:rows].copy_(torch.randn(rows, H, dims.d, device=dev).to(BF16))
        replay()
        want_md = ref.fill(**b.kw)  # type: ignore[arg-type]
        assert want_md.run is not None
        want = want_md.run(q.float(), k.float(), v.float(), dims.d ** -0.5)[:rows]
        torch.testing.assert_close(out[:rows].float(), want, rtol=TOL, atol=TOL,
                                   msg=functools.partial("step {}: {}".format, step))
    return steps


@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_vllm_graphs_fa4_cpu(fake_fa4: FA4, decode: bool) -> None:
    """The CUDA test's logic on CPU: every FA4 call reads the captured view's own tensors with
    its static bounds, whatever the batch."""
    dims = CPU_DIMS
    stream(torch.device("cpu"), dims, decode, dims.max_bs, CPU_STEPS, seed=int(decode))
    first = fake_fa4.calls[0]
    assert len(fake_fa4.calls) == 3 + CPU_STEPS  # warm-ups, capture, one per replay
    for call in fake_fa4.calls:
        assert call["max_seqlen_q"] == (1 if decode else dims.t)
        for name in ("cu_seqlens_q", "seqused_k", "page_table"):
            if call.get(name) is not None:
                assert call[name].data_ptr() == first[name].data_ptr(), name


@pytest.mark.cuda
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_vllm_graphs_fa4_cuda(decode: bool) -> None:
    try:
        fa.load_fa4()
    except ImportError as e:
        pytest.skip(f"flash_attn.cute does not load: {e}")
    dims = CUDA_DIMS
    for bs in (dims.max_bs, 3) if decode else (dims.max_bs,):
        stream(torch.device("cuda"), dims, decode, bs, CUDA_STEPS, seed=bs)

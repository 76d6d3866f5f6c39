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

FlashInfer: decode batches of a captured size replay one graph per size through the graph
wrapper the builder plans on the pool's CSR buffers before each replay (the size marked as
vLLM's ``build_for_cudagraph_capture`` marks it); mixed batches run eagerly (as vLLM runs them
under ``UNIFORM_SINGLE_TOKEN_DECODE``) through one eager prefill wrapper, whatever their size.

On CUDA (``flash_attn.cute`` / ``flashinfer`` importable): real graphs, ``ATTNPOOL_GRAPH_STEPS``
replays (at most and by default 200) per graph. On CPU the same logic runs against the fakes
(``fakes_fa4.py``, ``fakes_flashinfer.py``) with the graph simulated
(``tests.helpers.graph_replay.capture``), the filler in its CUDA mode (no host copies).
"""

from __future__ import annotations

import functools
import os
import random
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from attnpool.adapters import flash_attn as fa
from attnpool.adapters.backends import Backend
from attnpool.adapters.flashinfer_step import LayerFacts
from attnpool.integrations.vllm.cache import cuda_views
from attnpool.integrations.vllm.step import EngineSizes, StepFiller, mixed_graphs

from tests.helpers import fakes_flashinfer
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


def _filler(dims: Dims, dev: torch.device, kernel: Backend = Backend.FA4) -> StepFiller:
    sizes = EngineSizes(max_num_seqs=dims.max_bs, max_num_batched_tokens=dims.t,
                        max_model_len=dims.c, block_size=P, sliding_window=None,
                        num_blocks=dims.blocks, device=dev)
    facts = LayerFacts(H, H_KV, dims.d, BF16, dims.d ** -0.5) \
        if kernel is Backend.FLASHINFER else None
    f = StepFiller(sizes, kernel, H, H_KV, BF16, facts=facts)
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


def stream(dev: torch.device, dims: Dims, decode: bool, bs: int, steps: int, seed: int,
           kernel: Backend = Backend.FA4, one_phase: bool = False) -> int:
    """Capture the bound call once on the first batch's view, replay ``steps`` random batches
    refilled into the same filler; returns the kernel calls made. FlashInfer's mixed batches
    are not captured: each step's bound call runs eagerly. ``one_phase``: vLLM's FULL graph
    mode, one extend graph for decode and mixed batches alike (``StepFiller.one_phase``)."""
    rng = random.Random(seed)
    # the SDPA reference on ATTNPOOL_REFERENCE_DEVICE when set (the initcheck step puts it on
    # the CPU: with static bounds SDPA's dense gather computes over page-table columns past a
    # row's pages, masked afterwards, which initcheck reports as reads of unwritten memory)
    ref_dev = torch.device(os.environ.get("ATTNPOOL_REFERENCE_DEVICE", dev.type))
    f, ref = _filler(dims, dev, kernel), _filler(dims, ref_dev)
    f.one_phase = one_phase
    graphed = decode or kernel is not Backend.FLASHINFER
    if f.plans is not None and decode:
        f.plans.capture_size(bs)  # as the builder's build_for_cudagraph_capture marks it
    ref.backend, ref.dtype = Backend.SDPA, torch.float32  # (its plans' masks: float32 queries)
    k, v = _caches(dims, dev)
    q = torch.zeros(dims.t, H, dims.d, dtype=BF16, device=dev)  # the graph's static input

    def draw() -> Batch:
        while True:
            n = rng.choice([1, bs, rng.randint(1, bs)])
            if decode or (one_phase and rng.random() < 0.4):
                seq, ext = [rng.randint(1, dims.c) for _ in range(n)], [1] * n
            else:
                seq, ext = mixed_batch(n, dims.t, dims.c, rng)
            if decode or one_phase or max(ext) > 1:  # (else: an all-decode batch, a decode graph)
                return vllm_batch(seq, ext, bs, dims, dev, rng)

    md = f.fill(**draw().kw)  # type: ignore[arg-type]
    view, run = md.view, md.run
    assert run is not None and (view.max_seqlen_k, view.bs) == (dims.c, bs)
    if graphed:
        replay, out = capture(lambda: run(q, k, v, dims.d ** -0.5), dev)
    for step in range(steps):
        b = draw()
        again = f.fill(**b.kw)  # type: ignore[arg-type]
        assert again.view is view, "a refill without host copies hands back the captured view"
        rows = sum(b.ext)
        q.zero_()
        q[:rows].copy_(torch.randn(rows, H, dims.d, device=dev).to(BF16))
        if graphed:
            replay()
        else:
            assert again.run is not None
            out = again.run(q, k, v, dims.d ** -0.5)
        want_md = ref.fill(**{key: x.to(ref_dev) if isinstance(x, Tensor) else x
                              for key, x in b.kw.items()})  # type: ignore[arg-type]
        assert want_md.run is not None
        want = want_md.run(q.float().to(ref_dev), k.float().to(ref_dev), v.float().to(ref_dev),
                           dims.d ** -0.5)[:rows]
        torch.testing.assert_close(out[:rows].float().to(ref_dev), want, rtol=TOL, atol=TOL,
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
@pytest.mark.parametrize("decode", [False, True, None], ids=["extend", "decode", "one-phase"])
def test_vllm_graphs_fa4_cuda(decode: bool | None) -> None:
    """``None``: vLLM's FULL mode, decode and mixed batches from one extend graph."""
    try:
        fa.load_fa4()
    except ImportError as e:
        pytest.skip(f"flash_attn.cute does not load: {e}")
    dims = CUDA_DIMS
    for bs in (dims.max_bs, 3) if decode else (dims.max_bs,):
        stream(torch.device("cuda"), dims, bool(decode), bs, CUDA_STEPS, seed=bs,
               one_phase=decode is None)


def test_vllm_one_graph_for_decode_and_mixed_cpu(fake_fa4: FA4) -> None:
    """vLLM's FULL graph mode with flash-attn: decode batches and mixed ones padded to the same
    size are all extend refills of the one captured view, so one graph replays them all with
    its static bounds."""
    dims = CPU_DIMS
    stream(torch.device("cpu"), dims, False, dims.max_bs, 3 * CPU_STEPS, seed=5, one_phase=True)
    first = fake_fa4.calls[0]
    assert all(c["max_seqlen_q"] == dims.t for c in fake_fa4.calls)
    for call in fake_fa4.calls:
        assert call["page_table"].data_ptr() == first["page_table"].data_ptr()


def test_mixed_graphs_only_for_flash_attn_on_cuda() -> None:
    """``AttentionCGSupport.ALWAYS`` is declared for groups that attend with FA3 / FA4 on CUDA
    alone: FlashInfer plans on the host, FA2 falls back to SDPA for mixed parts, SDPA plans on
    the host, and nothing is captured on a CPU."""
    assert mixed_graphs({Backend.FA4}, "cuda") and mixed_graphs({Backend.FA3, Backend.FA4}, "cuda")
    for backends in ({Backend.FLASHINFER}, {Backend.FA2}, {Backend.SDPA}, {Backend.FA4,
                     Backend.SDPA}, set()):
        assert not mixed_graphs(backends, "cuda"), backends
    assert not mixed_graphs({Backend.FA4}, "cpu")


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fakes_flashinfer.module())


@pytest.mark.usefixtures("fake_flashinfer")
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_vllm_flashinfer_cpu(decode: bool) -> None:
    """The CUDA test's logic on CPU through FlashInfer's fakes: decode steps of the captured
    size reuse one graph wrapper planned on the pool's own CSR buffers, mixed steps one eager
    prefill wrapper for every batch size."""
    dims = CPU_DIMS
    bs = dims.max_bs
    f = _filler(dims, torch.device("cpu"), Backend.FLASHINFER)
    assert f.plans is not None
    stream(torch.device("cpu"), dims, decode, bs, CPU_STEPS, seed=7 + decode,
           kernel=Backend.FLASHINFER)


@pytest.mark.usefixtures("fake_flashinfer")
def test_vllm_flashinfer_wrappers_per_step_kind() -> None:
    """Which wrapper each step plans: a captured size's decode steps its graph wrapper (built on
    the pool's CSR buffers, the same object every step), every other step an eager wrapper,
    one per kind whatever the batch size; the layers share the plan."""
    dims, dev = CPU_DIMS, torch.device("cpu")
    f = _filler(dims, dev, Backend.FLASHINFER)
    assert f.plans is not None
    f.plans.capture_size(4)
    rng = random.Random(3)
    seen = []
    for n, bs, decode in [(4, 4, True), (2, 2, True), (3, 3, True), (4, 4, True), (2, 4, False),
                          (1, 1, False), (4, 4, False)]:
        seq, ext = ([rng.randint(1, dims.c) for _ in range(n)], [1] * n) if decode \
            else mixed_batch(n, dims.t, dims.c, rng)
        md = f.fill(**vllm_batch(seq, ext, bs, dims, dev, rng).kw)  # type: ignore[arg-type]
        assert md.run is not None and md.run.planned is not None
        wrappers = md.run.planned[0]
        seen.append((wrappers is f.plans.graph, id(wrappers.wrapper(md.view))))
    graph_ids = {w for g, w in seen if g}
    assert [g for g, _ in seen] == [True, False, False, True, False, False, False]
    assert len(graph_ids) == 1 and len(f.plans.graph) == 1
    assert len(f.plans.eager) == 2  # one decode, one prefill wrapper for every size
    graph = f.plans.graph.wrapper(f.pool.decode.view(4))
    assert graph._paged_kv_indptr_buf.data_ptr() == f.pool.decode.view(4).kv_indptr.data_ptr()


@pytest.mark.usefixtures("fake_flashinfer")
def test_vllm_flashinfer_refuses_other_scale() -> None:
    """A layer asking for another scale or soft cap than the plan's is refused, not computed
    with the planned one."""
    from attnpool import LayoutError

    dims, dev = CPU_DIMS, torch.device("cpu")
    f = _filler(dims, dev, Backend.FLASHINFER)
    md = f.fill(**vllm_batch([5, 9], [1, 1], 2, dims, dev, random.Random(0)).kw)  # type: ignore[arg-type]
    k, v = _caches(dims, dev)
    q = torch.zeros(2, H, dims.d, dtype=BF16)
    assert md.run is not None
    md.run(q, k, v, dims.d ** -0.5)
    with pytest.raises(LayoutError, match="scale"):
        md.run(q, k, v, 0.5)
    with pytest.raises(LayoutError, match="softcap"):
        md.run(q, k, v, dims.d ** -0.5, softcap=30.0)


@pytest.mark.cuda
@pytest.mark.parametrize("decode", [False, True], ids=["extend", "decode"])
def test_vllm_graphs_flashinfer_cuda(decode: bool) -> None:
    """FlashInfer's real wrappers: decode graphs per captured size replayed from the builder's
    plans, mixed steps eager, against SDPA."""
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        pytest.skip(f"flashinfer does not import: {e}")
    dims = CUDA_DIMS
    for bs in (dims.max_bs, 3) if decode else (dims.max_bs,):
        stream(torch.device("cuda"), dims, decode, bs, CUDA_STEPS, seed=bs,
               kernel=Backend.FLASHINFER)


def test_padded_requests_and_tokens_read_and_write_the_null_block() -> None:
    """A batch vLLM's CUDA runner padded to a captured size: the padded requests (no query,
    length 0, the null block in their table row) keep length 0 and page 0 (vLLM's null block,
    the pool's pad page) in the refilled view, and the padded tokens (slot -1) are stored to
    block 0 only, which nothing reads."""
    dims, dev = CPU_DIMS, torch.device("cpu")
    f = _filler(dims, dev)
    b = vllm_batch([37, 5], [1, 5], 4, dims, dev, random.Random(2))
    md = f.fill(**b.kw)  # type: ignore[arg-type]
    view = md.view
    assert view.bs == 4 and view.max_seqlen_q == dims.t  # static bounds, padded rows included
    assert view.cache_seqlens[2:4].tolist() == [0, 0]
    assert view.page_table[2:4, 0].tolist() == [0, 0]
    assert view.cu_seqlens_q[2:5].tolist() == [6, 6, 6]  # no query rows for padded requests
    real = len([s for s in b.kw["slot_mapping"].tolist() if s >= 0])  # type: ignore[union-attr]
    assert real == 6 and md.blocks[real:].eq(0).all()

"""GraphRunner over every phase with real paged attention: replays == eager attention.

For decode, verify (chain and tree), draft (chain and tree), encoder and local attention, a runner
captures one graph per batch size (CUDA) or runs eagerly (CPU), then runs a stream of random
batches (requests joining and leaving, padded rows, short and full-length contexts). Each step's
real rows must equal an eager forward over a separate reference pool refilled with the same batch
at the same padded size. On CUDA the stream is 1,000 steps and the test also checks that
``memory_allocated()`` is flat across replays and that no arena pointer moves; on CPU a few steps
check the same logic eagerly.

Backends: PyTorch SDPA (:mod:`attnpool.adapters.sdpa`) everywhere; flash-attn FA3/FA2 and
FlashInfer on CUDA when importable (compared with SDPA on the same half-precision inputs).
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Impl, Layout, Phase, PoolConfig
from attnpool.adapters import sdpa
from attnpool.graphs import GraphRunner

from batches import make_batch, make_table

H, H_KV, D = 4, 2, 16
#: replays per CUDA case (fewer under compute-sanitizer, which slows every launch down)
CUDA_STEPS = int(os.environ.get("ATTNPOOL_GRAPH_STEPS", "1000"))


@dataclass(frozen=True)
class Case:
    name: str
    phase: Phase
    cfg: dict[str, Any]
    extra: int  # tokens past seq_lens the phase reads (verify N, draft S, encoder max)


CASES = [
    Case("decode", Phase.DECODE, {}, 0),
    Case("verify-chain", Phase.VERIFY, {"num_draft_tokens": 4}, 4),
    Case("verify-tree", Phase.VERIFY, {"num_draft_tokens": 4, "topk": 2}, 4),
    Case("draft-chain", Phase.DRAFT, {"spec_steps": 3}, 3),
    Case("draft-tree", Phase.DRAFT, {"spec_steps": 3, "topk": 2}, 3),
    Case("encoder", Phase.ENCODER, {"max_encoder_len": 96}, 96),
    Case("local", Phase.LOCAL, {"attention_chunk_size": 64}, 0),
]


def forward_for(case: Case, attn: Callable[[Any, Tensor], Tensor]) -> Callable[[Any, Tensor], Tensor]:
    """The phase's forward over one attention call per part (``attn(part, q) -> out``)."""
    if case.phase is Phase.DRAFT:
        def draft(view: Any, q: Tensor) -> Tensor:
            out = attn(view.steps[0], q)
            for step in view.steps[1:]:
                out = out + attn(step, q)
            return out
        return draft
    if case.phase is Phase.ENCODER:
        return lambda view, q: attn(view.cross, q) + attn(view.decoder, q)
    return attn


def inputs(case: Case, cfg: PoolConfig, n: int, rng: random.Random, table: Tensor,
           dev: torch.device) -> dict[str, Tensor]:
    """One batch of ``n`` requests as the phase's ``update_`` keyword arguments."""
    b = make_batch(cfg, n, rng, extra=case.extra, table=table.cpu())
    seq, rpi, tab = b.tensors(dev)
    kw: dict[str, Tensor] = {"seq_lens": seq, "req_pool_indices": rpi, "req_to_token": tab}
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if case.name == "verify-tree":
        nd = cfg.num_draft_tokens
        mask = (torch.rand(n, nd, nd, generator=g) < 0.5) | torch.eye(nd, dtype=torch.bool)
        kw["tree_mask"] = mask.to(dev)
    if case.name == "draft-tree":
        tokens = int(table.max())
        kw["out_cache_loc"] = torch.randint(1, tokens, (n, cfg.spec_steps, cfg.topk),
                                            generator=g).to(dev)
    if case.phase is Phase.ENCODER:
        kw["encoder_lens"] = torch.randint(1, cfg.max_encoder_len + 1, (n,), generator=g).to(dev)
    return kw


def make_pool(case: Case, dev: torch.device, impl: Impl, poison: bool) -> BufferPool:
    cfg = PoolConfig(max_bs=16, max_context_len=512, page_size=16, device=dev, layout=Layout.BOTH,
                     pad_page=0, impl=impl, **case.cfg)
    return BufferPool(cfg, poison=poison)


def kv_cache(table: Tensor, dtype: torch.dtype, dev: torch.device) -> tuple[Tensor, Tensor]:
    pages = int(table.max()) // 16 + 2
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, 16, H_KV, D, generator=g).to(dev, dtype)
    v = torch.randn(pages, 16, H_KV, D, generator=g).to(dev, dtype)
    return k, v


def replay_stream(case: Case, dev: torch.device, steps: int, impl: Impl = Impl.AUTO,
                  backend: str = "sdpa") -> None:
    rng = random.Random(hash(case.name) % 2**16)
    pool = make_pool(case, dev, impl, poison=True)
    ref = make_pool(case, dev, Impl.REFERENCE, poison=True)
    table = make_table(pool.cfg, 48, rng).to(dev)
    dtype = torch.float32 if backend == "sdpa" else torch.float16
    k, v = kv_cache(table, dtype, dev)
    view_kw = {"for_phase": Phase.DECODE} if case.phase is Phase.LOCAL else {}

    def sdpa_attn(part: Any, q: Tensor) -> Tensor:
        return sdpa.attention(part, q, k, v).out

    attn, prepare = sdpa_attn, None
    if backend in ("fa3", "fa2"):
        from attnpool.adapters import flash_attn as fa

        version = fa.FlashAttnVersion[backend.upper()]

        def attn(part: Any, q: Tensor) -> Tensor:
            return fa.attention(part, q, k, v, version=version).out
    elif backend == "flashinfer":
        from attnpool.adapters import flashinfer as fi

        wrappers = fi.GraphWrappers(torch.empty(128 << 20, dtype=torch.uint8, device=dev))

        def parts_of(view: Any) -> list[Any]:
            if hasattr(view, "steps"):
                return [p for s in view.steps for p in (s.prefix, s.expand) if p is not None]
            if hasattr(view, "cross"):
                return [view.cross, view.decoder]
            if hasattr(view, "prefix"):
                return [p for p in (view.prefix, view.expand) if p is not None]
            return [view]

        def prepare(view: Any) -> None:
            for p in parts_of(view):
                wrappers.wrapper(p)
                wrappers.plan(p, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=dtype)

        def attn(part: Any, q: Tensor) -> Tensor:
            return wrappers.run(part, q, k, v).out

    fwd = forward_for(case, attn)
    runner = GraphRunner(pool, case.phase, fwd, torch.empty(1, H, D, dtype=dtype, device=dev),
                         view_kwargs=view_kw, prepare=prepare)
    ref_fwd = forward_for(case, sdpa_attn)
    ptrs = {key: t.data_ptr() for key, t in pool.arena.buffers().items()}
    mem0 = None
    for step in range(steps):
        n = rng.choice([1, runner.capture_sizes[-1], rng.randint(1, runner.capture_sizes[-1])])
        kw = inputs(case, pool.cfg, n, rng, table, dev)
        x = torch.randn(n * runner.r, H, D, device=dev, dtype=dtype)
        out = runner.run(x, **kw)
        bs = runner.padded_size(n) if runner.use_graphs else n
        assert bs is not None
        view = ref.phase(case.phase).update_(bs, **kw, **view_kw)
        xs = torch.zeros(bs * runner.r, H, D, device=dev, dtype=dtype)
        xs[: n * runner.r] = x
        want = ref_fwd(view, xs)[: n * runner.r]
        if dev.type == "cpu":
            assert torch.equal(out, want), (case.name, step)
        else:  # same inputs, same shapes; half-precision kernels are compared with a tolerance
            tol = 1e-5 if backend == "sdpa" else 2e-2
            torch.testing.assert_close(out, want, rtol=tol, atol=tol, msg=f"{case.name} {step}")
        del kw, x, out, view, xs, want
        if dev.type == "cuda" and step == 1:
            torch.cuda.synchronize()
            mem0 = torch.cuda.memory_allocated()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == mem0, "replays must not grow memory"
        assert runner.use_graphs and set(runner._graphs) == set(runner.capture_sizes)
    assert {key: t.data_ptr() for key, t in pool.arena.buffers().items()} == ptrs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_eager_stream_cpu(case: Case) -> None:
    replay_stream(case, torch.device("cpu"), steps=4)


@pytest.mark.cuda
@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.AUTO], ids=["reference", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_graph_stream_cuda(case: Case, impl: Impl) -> None:
    replay_stream(case, torch.device("cuda"), steps=CUDA_STEPS, impl=impl)


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


KERNELS = [
    pytest.param("fa3", marks=pytest.mark.skipif(not _have("flash_attn_interface"),
                                                 reason="flash-attn 3 not installed")),
    pytest.param("fa2", marks=pytest.mark.skipif(not _have("flash_attn"),
                                                 reason="flash-attn 2 not installed")),
    pytest.param("flashinfer", marks=pytest.mark.skipif(not _have("flashinfer"),
                                                        reason="flashinfer not installed")),
]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_graph_stream_cuda_kernels(case: Case, backend: str) -> None:
    replay_stream(case, torch.device("cuda"), steps=min(200, CUDA_STEPS), backend=backend)


@pytest.mark.cuda
def test_update_recorded_inside_the_graph_cuda() -> None:
    """Capturable mode: the fused update (``num_real``) and the forward in one graph. Per
    replay the engine writes only the static inputs (lengths, rows, real count) in place."""
    dev = torch.device("cuda")
    case = CASES[0]
    pool = make_pool(case, dev, Impl.TRITON, poison=True)
    ref = make_pool(case, dev, Impl.REFERENCE, poison=True)
    rng = random.Random(5)
    table = make_table(pool.cfg, 48, rng).to(dev)
    k, v = kv_cache(table, torch.float32, dev)
    bs = 16
    seq = torch.ones(bs, dtype=torch.int64, device=dev)
    rpi = torch.zeros(bs, dtype=torch.int64, device=dev)
    num_real = torch.ones(1, dtype=torch.int32, device=dev)
    q = torch.zeros(bs, H, D, device=dev)

    def step() -> Tensor:
        view = pool.decode.update_(bs, seq, rpi, table, num_real=num_real)
        return sdpa.attention(view, q, k, v).out

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernel: never inside a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for i in range(200):
        n = rng.randint(1, bs)
        b = make_batch(pool.cfg, n, rng, table=table.cpu())
        s, r, _ = b.tensors(dev)
        seq[:n], rpi[:n] = s, r
        num_real.fill_(n)
        x = torch.randn(n, H, D, device=dev)
        q.zero_()
        q[:n] = x
        graph.replay()
        view = ref.decode.update_(bs, s, r, table)
        want = sdpa.attention(view, q, k, v).out[:n]
        torch.testing.assert_close(out[:n], want, rtol=1e-5, atol=1e-5, msg=str(i))

"""GraphRunner over every phase with real paged attention: replays == eager attention.

For decode, verify (chain and tree), draft (chain and tree), draft extend, encoder and local
attention (decode and verify shapes), a runner captures one graph per batch size (CUDA) or runs
eagerly (CPU), then runs a stream of random batches (requests joining and leaving, padded rows,
short and full-length contexts). Each step's real query rows must equal an eager forward over a
separate reference pool refilled with the same batch at the same padded size. On CUDA the stream is
1,000 steps and the test also checks that ``memory_allocated()`` is flat across replays and that no
arena pointer moves; on CPU a few steps check the same logic eagerly.

Backends: PyTorch SDPA (:mod:`attnpool.adapters.sdpa`) everywhere; flash-attn FA3/FA2 and
FlashInfer on CUDA when importable (bfloat16, head dim 64; FA2 with 256-token pages), compared with
SDPA on the same inputs. On CPU the kernel backends run against the fakes of ``fakes_fa3.py`` and
``fakes_flashinfer.py`` (which enforce the real libraries' checks) under a simulated capture: the
steps an engine takes before ``torch.cuda.graph`` (capture view, prepare, warm-up and capture on
the graph's whole query buffer), then per step update, prepare and replay.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Impl, Layout, Phase, PoolConfig
from attnpool.adapters import sdpa
from attnpool.graphs import GraphRunner

from tests.helpers.batches import make_batch, make_table
from tests.helpers.fakes_fa3 import FA2, FA3
from tests.helpers.fakes_fa4 import FA4

H, H_KV = 4, 2
#: head dim per backend: FlashInfer's prefill kernels and the flash-attn builds want 64 or 128
HEAD_DIM = {"sdpa": 16, "fa3": 64, "fa2": 64, "fa4": 64, "flashinfer": 64}
#: page size per backend: FA2's paged path needs a multiple of 256
PAGE = {"sdpa": 16, "fa3": 16, "fa2": 256, "fa4": 16, "flashinfer": 16}
#: replays per CUDA case (fewer under compute-sanitizer, which slows every launch down)
CUDA_STEPS = int(os.environ.get("ATTNPOOL_GRAPH_STEPS", "1000"))
ND = 4  # draft tokens of the verify, draft-extend and local-verify cases


@dataclass(frozen=True)
class Case:
    name: str
    phase: Phase
    cfg: dict[str, Any]
    extra: int  # tokens past seq_lens the phase reads (verify N, draft S, encoder max)
    view_kwargs: dict[str, Any] | None = None


CASES = [
    Case("decode", Phase.DECODE, {}, 0),
    Case("verify-chain", Phase.VERIFY, {"num_draft_tokens": ND}, ND),
    Case("verify-tree", Phase.VERIFY, {"num_draft_tokens": ND, "topk": 2}, ND),
    Case("draft-chain", Phase.DRAFT, {"spec_steps": 3}, 3),
    Case("draft-tree", Phase.DRAFT, {"spec_steps": 3, "topk": 2}, 3),
    Case("draft-extend", Phase.DRAFT_EXTEND, {"num_draft_tokens": ND}, ND),
    Case("encoder", Phase.ENCODER, {"max_encoder_len": 96}, 96),
    Case("local", Phase.LOCAL, {"attention_chunk_size": 64}, 0, {"for_phase": Phase.DECODE}),
    Case("local-verify", Phase.LOCAL, {"attention_chunk_size": 64, "num_draft_tokens": ND}, ND,
         {"for_phase": Phase.VERIFY}),
]
#: what each kernel cannot take. FA2: token-slot expand parts (page size 1), rows with varying
#: query counts. FlashInfer: chain draft steps (one shared page table, no CSR; see phases/draft.py)
CANNOT = {"fa2": {"verify-tree", "draft-tree", "draft-extend", "local-verify"},
          "flashinfer": {"draft-chain"}, "fa3": set(), "fa4": set()}


def queries_per_request(case: Case, cfg: PoolConfig) -> int:
    """Query rows one request owns in the forward's packed input."""
    if case.phase in (Phase.VERIFY, Phase.DRAFT_EXTEND) or case.name == "local-verify":
        return cfg.num_draft_tokens
    return cfg.topk if case.phase is Phase.DRAFT else 1


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
    if case.name == "local-verify":  # the runner's rows are requests of [N, H, D] queries each
        def local_verify(view: Any, x: Tensor) -> Tensor:
            return attn(view, x.reshape(-1, *x.shape[2:])).view(x.shape)
        return local_verify
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
    if case.phase is Phase.DRAFT_EXTEND:  # accepted tokens are already in seq_lens
        acc = [rng.choice([1, cfg.num_draft_tokens, rng.randint(1, cfg.num_draft_tokens)])
               for _ in range(n)]
        kw["accept_lens"] = torch.tensor(acc, device=dev)
        kw["seq_lens"] = seq + kw["accept_lens"]
    return kw


def real_rows(case: Case, cfg: PoolConfig, kw: dict[str, Tensor]) -> int:
    """Output rows that belong to real queries (the caller's; the rest are padding)."""
    n = kw["seq_lens"].shape[0]
    if case.phase is Phase.DRAFT_EXTEND:  # packed accepted queries first
        return int(kw["accept_lens"].sum())
    if case.name == "local-verify":
        return n  # runner rows (requests)
    return n * queries_per_request(case, cfg)


def make_pool(case: Case, dev: torch.device, impl: Impl, poison: bool, page: int = 16
              ) -> BufferPool:
    extra = dict(case.cfg)
    if "attention_chunk_size" in extra:
        extra["attention_chunk_size"] = max(extra["attention_chunk_size"], page)
    cfg = PoolConfig(max_bs=16, max_context_len=512, page_size=page, device=dev,
                     layout=Layout.BOTH, pad_page=0, impl=impl, **extra)
    return BufferPool(cfg, poison=poison)


def kv_cache(table: Tensor, page: int, d: int, dtype: torch.dtype, dev: torch.device
             ) -> tuple[Tensor, Tensor]:
    pages = int(table.max()) // page + 2
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pages, page, H_KV, d, generator=g).to(dev, dtype)
    v = torch.randn(pages, page, H_KV, d, generator=g).to(dev, dtype)
    return k, v


def parts_of(view: Any) -> list[Any]:
    if hasattr(view, "steps"):
        return [p for s in view.steps for p in (s.prefix, s.expand) if p is not None]
    if hasattr(view, "cross"):
        return [view.cross, view.decoder]
    if hasattr(view, "prefix"):
        return [p for p in (view.prefix, view.expand) if p is not None]
    return [view]


class _Replay:
    """A simulated graph: replay re-runs the captured forward over the same view and static
    input, writing into the captured output (the addresses a CUDA graph bakes)."""

    def __init__(self, forward: Callable[[Any, Tensor], Tensor], view: Any, xs: Tensor,
                 out: Tensor) -> None:
        self.forward, self.view, self.xs, self.out = forward, view, xs, out

    def replay(self) -> None:
        self.out.copy_(self.forward(self.view, self.xs))


class SimulatedGraphRunner(GraphRunner):
    """GraphRunner with its capture simulated on CPU: per size, the engine's steps before
    ``torch.cuda.graph`` (capture view, prepare, two warm-ups and the captured call, all on the
    graph's whole static input); replays go through :class:`_Replay`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, use_graphs=True, **kw)

    def _capture(self) -> None:
        for bs in reversed(self.capture_sizes):
            view = self._ph.view(bs, **self.view_kwargs)
            if self.prepare is not None:
                self.prepare(view)
            xs = self._x[: bs * self.r]
            for _ in range(2):
                self.forward(view, xs)
            out = self.forward(view, xs)
            self._graphs[bs] = (_Replay(self.forward, view, xs, out), out)  # type: ignore[assignment]


def replay_stream(case: Case, dev: torch.device, steps: int, impl: Impl = Impl.AUTO,
                  backend: str = "sdpa", simulate: bool = False, poison: bool = True,
                  check_memory: bool = True) -> None:
    """``poison=False``: the runner's pool is a plain ``torch.empty`` arena (initcheck runs);
    ``check_memory``: on CUDA, bytes allocated after the last step equal those after step 1."""
    rng = random.Random(hash(case.name) % 2**16)
    page, d = PAGE[backend], HEAD_DIM[backend]
    pool = make_pool(case, dev, impl, poison=poison, page=page)
    ref = make_pool(case, dev, Impl.REFERENCE, poison=True, page=page)
    table = make_table(pool.cfg, 48, rng).to(dev)
    dtype = torch.float32 if backend == "sdpa" else torch.bfloat16
    k, v = kv_cache(table, page, d, dtype, dev)
    view_kw = case.view_kwargs or {}

    def sdpa_attn(part: Any, q: Tensor) -> Tensor:
        return sdpa.attention(part, q, k, v).out

    attn, prepare = sdpa_attn, None
    if backend in ("fa3", "fa2", "fa4"):
        from attnpool.adapters import flash_attn as fa

        version = fa.FlashAttnVersion[backend.upper()]
        kernel = {"fa3": fa.load_fa3, "fa2": fa.load_fa2, "fa4": fa.load_fa4}[backend]()
        print(f"{backend} module: {kernel.name}")

        def attn(part: Any, q: Tensor) -> Tensor:
            return fa.attention(part, q, k, v, version=version, kernel=kernel).out
    elif backend == "flashinfer":
        from attnpool.adapters import flashinfer as fi

        # torch.empty on purpose: GraphWrappers zeroes the workspace before its first use
        wrappers = fi.GraphWrappers(torch.empty(128 << 20 if dev.type == "cuda" else 1 << 10,
                                                dtype=torch.uint8, device=dev))

        def prepare(view: Any) -> None:
            for p in parts_of(view):
                wrappers.wrapper(p)
                wrappers.plan(p, num_qo_heads=H, num_kv_heads=H_KV, head_dim=d, q_dtype=dtype)

        def attn(part: Any, q: Tensor) -> Tensor:
            return wrappers.attention(part, q, k, v).out

    fwd = forward_for(case, attn)
    r = queries_per_request(case, pool.cfg)
    example = torch.empty((1, r, H, d) if case.name == "local-verify" else (1, H, d), dtype=dtype,
                          device=dev)
    runner_cls = SimulatedGraphRunner if simulate else GraphRunner
    sizes = [3, 16] if simulate else None  # fewer simulated captures: CPU time
    runner = runner_cls(pool, case.phase, fwd, example, capture_sizes=sizes, view_kwargs=view_kw,
                        prepare=prepare)
    ref_fwd = forward_for(case, sdpa_attn)
    ptrs = {key: t.data_ptr() for key, t in pool.arena.buffers().items()}
    mems: list[int] = []  # bytes allocated after each step (the first may warm caches up)
    for step in range(steps):
        n = rng.choice([1, runner.capture_sizes[-1], rng.randint(1, runner.capture_sizes[-1])])
        kw = inputs(case, pool.cfg, n, rng, table, dev)
        x = torch.randn(n * runner.r, *example.shape[1:], device=dev, dtype=dtype)
        out = runner.run(x, **kw)
        bs = runner.padded_size(n) if runner.use_graphs else n
        assert bs is not None
        view = ref.phase(case.phase).update_(bs, **kw, **view_kw)
        xs = torch.zeros(bs * runner.r, *example.shape[1:], device=dev, dtype=dtype)
        xs[: n * runner.r] = x
        rows = real_rows(case, pool.cfg, kw)
        want = ref_fwd(view, xs)[:rows]
        if backend == "sdpa" and dev.type == "cpu":
            assert torch.equal(out[:rows], want), (case.name, step)
        else:  # same inputs, same shapes; half-precision kernels are compared with a tolerance
            tol = 1e-5 if backend == "sdpa" else 2e-2
            torch.testing.assert_close(out[:rows].float(), want.float(), rtol=tol, atol=tol,
                                       msg=f"{case.name} {step}")
        del kw, x, out, view, xs, want
        if dev.type == "cuda":  # (the allocator counts on the host: no sync needed)
            if step < 2:  # what a first call left in reference cycles is not live memory
                gc.collect()
            mems.append(torch.cuda.memory_allocated())
    if dev.type == "cuda":
        gc.collect()  # the same at the end: only tensors still referenced are counted
        torch.cuda.synchronize()
        assert not check_memory or torch.cuda.memory_allocated() == mems[1], \
            f"replays must not grow memory: {mems}"
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
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that is not installed
        return False


def _have_fa3() -> bool:
    return any(_have(name) for name in ("flash_attn_interface", "sgl_kernel", "vllm"))


def kernel_params(have: Callable[[str], bool]) -> list[Any]:
    """(case, backend) pairs each backend can run, skipped where its library is missing."""
    # flash-attn 2's package holds flash_attn_interface; flash-attn-4 alone makes flash_attn a
    # namespace package with only flash_attn.cute in it
    avail = {"fa3": _have_fa3() if have is _have else True,
             "fa2": have("flash_attn.flash_attn_interface"), "fa4": have("flash_attn.cute"),
             "flashinfer": have("flashinfer")}
    out = []
    for backend in ("fa3", "fa2", "fa4", "flashinfer"):
        for c in CASES:
            if c.name in CANNOT[backend]:
                continue
            marks = [] if avail[backend] else [pytest.mark.skip(reason=f"{backend} not installed")]
            out.append(pytest.param(c, backend, id=f"{c.name}-{backend}", marks=marks))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize(("case", "backend"), kernel_params(_have))
def test_graph_stream_cuda_kernels(case: Case, backend: str) -> None:
    replay_stream(case, torch.device("cuda"), steps=min(200, CUDA_STEPS), backend=backend)


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The kernel libraries as CPU fakes that enforce their checks (none of the real ones)."""
    from attnpool.adapters import flash_attn as fa

    from tests.helpers import fakes_flashinfer

    for name, _ in fa.FA3_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", FA3().module("flash_attn_interface"))
    monkeypatch.setitem(sys.modules, "flash_attn", FA2().module())
    monkeypatch.setitem(sys.modules, "flash_attn.cute", FA4().module())
    monkeypatch.setitem(sys.modules, "flashinfer", fakes_flashinfer.module())
    fa.clear_kernel_cache()
    yield
    fa.clear_kernel_cache()


@pytest.mark.parametrize(("case", "backend"), kernel_params(lambda _: True))
def test_graph_stream_fake_kernels_cpu(fake_kernels: None, case: Case, backend: str) -> None:
    """The GPU kernel cases, same configuration, on CPU through the fakes with simulated capture:
    every argument the real libraries check, at capture and per step, is accepted."""
    replay_stream(case, torch.device("cpu"), steps=4, backend=backend, simulate=True)


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
    d = HEAD_DIM["sdpa"]
    k, v = kv_cache(table, 16, d, torch.float32, dev)
    bs = 16
    seq = torch.ones(bs, dtype=torch.int64, device=dev)
    rpi = torch.zeros(bs, dtype=torch.int64, device=dev)
    num_real = torch.ones(1, dtype=torch.int32, device=dev)
    q = torch.zeros(bs, H, d, device=dev)

    def step() -> Tensor:
        view = pool.decode.update_(bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                                   num_real=num_real)
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
        x = torch.randn(n, H, d, device=dev)
        q.zero_()
        q[:n] = x
        graph.replay()
        view = ref.decode.update_(bs, seq_lens=s, req_pool_indices=r, req_to_token=table)
        want = sdpa.attention(view, q, k, v).out[:n]
        torch.testing.assert_close(out[:n], want, rtol=1e-5, atol=1e-5, msg=str(i))

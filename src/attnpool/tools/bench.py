"""``attnpool bench``: attnpool against the classic baseline, without pytest.

Three questions, each answered for attnpool and the baseline in the same run:

* **init**: per-buffer zero-filled allocations (engine style) vs per-buffer ``torch.empty`` vs the pool's
  single arena (``BufferPool``), over the buffers :func:`attnpool.plan_arena` reports, so the
  benchmark grows with every phase the library learns.
* **update**: one metadata refill per step, the classic per-op replay on zero-initialised buffers
  vs attnpool's update paths (:data:`UPDATE_IMPLS`; one line adds a path), over mixed context
  lengths and padded batches.
* **memory**: overlaid vs separate bytes of the same configs (arithmetic on the plan).

The cases and implementations are defined here once; ``benchmarks/`` (pytest-benchmark) runs the
same ones. Ratios are ``attnpool / baseline`` medians: below 1 means attnpool is faster or smaller.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..arena import plan_arena
from ..config import Impl, PoolConfig
from ..errors import PoolError
from ..pool import BufferPool
from .baseline import ClassicPaged, Fill, per_buffer_allocator
from .bench_report import format_report, plot
from .progress import Bar

K = 1024

#: Realistic init/memory configs (``PoolConfig`` keyword arguments, device added at run time).
INIT_CONFIGS: dict[str, dict[str, Any]] = {
    f"bs{bs}-c{c // K}k-p{p}": {"max_bs": bs, "max_context_len": c, "page_size": p}
    for bs in (160, 256) for c in (32 * K, 128 * K) for p in (1, 16)
} | {
    "eagle-tree-bs160-c128k-p1": {"max_bs": 160, "max_context_len": 128 * K, "page_size": 1,
                                  "num_draft_tokens": 8, "topk": 4, "spec_steps": 4},
    "eagle-chain-bs160-c128k-p16": {"max_bs": 160, "max_context_len": 128 * K, "page_size": 16,
                                    "num_draft_tokens": 4, "topk": 1, "spec_steps": 3},
}

#: Draft tokens of the chain-verify update cases.
VERIFY_N = 4


@dataclass(frozen=True)
class Suite:
    """What one run measures: configs, update cases and how long to time each."""

    init_configs: tuple[str, ...]
    update_parts: tuple[tuple[str, int], ...]  # (phase, page_size)
    update_bs: tuple[int, ...]
    update_context: int
    budget_s: float  # per measured case
    min_rounds: int
    max_rounds: int
    configs: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(INIT_CONFIGS))


FULL = Suite(tuple(INIT_CONFIGS), (("decode", 1), ("decode", 16), ("verify", 16)),
             (1, 8, 64, 160, 256), 32 * K, budget_s=0.4, min_rounds=5, max_rounds=200)
QUICK = Suite(("bs160-c32k-p1", "bs256-c128k-p16", "eagle-tree-bs160-c128k-p1"),
              (("decode", 16), ("verify", 16)), (1, 64, 256), 8 * K,
              budget_s=0.08, min_rounds=3, max_rounds=50)


def device_of(name: str) -> torch.device:
    """``"auto"`` (CUDA when available), or a device that exists here (else :class:`PoolError`)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise PoolError(f"--device must be cpu, cuda[:N] or auto, got {name!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PoolError(f"--device {name!r}: no CUDA device is available here (use cpu or auto)")
    return dev


def machine_info(device: torch.device) -> dict[str, Any]:
    """What a result depends on: device, torch/python versions, CPU count."""
    info: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def config_info(cfg: PoolConfig) -> dict[str, Any]:
    """The config fields that size a pool, JSON-able (benchmark ``extra_info``)."""
    return {"max_bs": cfg.max_bs, "max_context_len": cfg.max_context_len,
            "page_size": cfg.page_size, "num_draft_tokens": cfg.num_draft_tokens,
            "topk": cfg.topk, "spec_steps": cfg.spec_steps, "layout": str(cfg.layout.name),
            "device": str(cfg.torch_device)}


# ---- init -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class InitImpl:
    """One way to allocate a config's buffers. ``prepare(cfg)`` does the arithmetic once and
    returns the timed call, which allocates (and returns) everything; ``nbytes`` is what it holds.
    ``about``: one line under the report's tables saying what the column measures."""

    name: str
    baseline: bool
    about: str
    prepare: Callable[[PoolConfig], Callable[[], object]]
    nbytes: Callable[[PoolConfig], int]


INIT_IMPLS: tuple[InitImpl, ...] = (
    InitImpl("per-buffer zeros", True, "one torch.zeros per buffer, as engines allocate "  # ok: a label
             "(the baseline)", lambda c: per_buffer_allocator(c, Fill.ZEROS),
             lambda c: plan_arena(c).separate_nbytes),
    InitImpl("per-buffer empty", False, "one torch.empty per buffer (no fill: not safe to read "
             "before a write)", lambda c: per_buffer_allocator(c, Fill.EMPTY),
             lambda c: plan_arena(c).separate_nbytes),
    # The pool's call includes planning its layout: a user pays for it at construction.
    InitImpl("attnpool arena", False, "BufferPool(cfg): the plan and one torch.empty for every "
             "buffer", lambda c: lambda: BufferPool(c), lambda c: plan_arena(c).nbytes),
)


# ---- update -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class UpdateCase:
    """One refill: ``phase`` ("decode" or chain "verify") of ``bs`` captured rows, ``n`` real."""

    phase: str
    page_size: int
    bs: int
    context: int
    max_bs: int = 256

    @property
    def n(self) -> int:
        """Real rows: the batch is padded to the captured size, as a graph runner does."""
        return max(1, self.bs - self.bs // 8)

    @property
    def draft(self) -> int:
        return VERIFY_N if self.phase == "verify" else 0

    @property
    def name(self) -> str:
        return f"{self.phase}-p{self.page_size}-bs{self.bs}"

    def config(self, device: torch.device, impl: Impl = Impl.REFERENCE) -> PoolConfig:
        return PoolConfig(max_bs=self.max_bs, max_context_len=self.context,
                          page_size=self.page_size, device=device, num_draft_tokens=self.draft,
                          impl=impl)


@dataclass(frozen=True)
class UpdateInputs:
    """Engine-side inputs of one step (device tensors plus the host copy of the lengths)."""

    seq_lens: Tensor
    req_pool_indices: Tensor
    req_to_token: Tensor
    seq_lens_cpu: Tensor


def make_inputs(case: UpdateCase, device: torch.device, seed: int = 0) -> UpdateInputs:
    """Mixed lengths (a quarter short, half log-uniform, a quarter near the limit) on shuffled pages.

    ``req_to_token`` has ``max_bs`` request slots; page ids are a random permutation (page 0, the
    pad page, is never used), so a gather cannot be mistaken for a copy.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = case.config(torch.device("cpu"))
    p, pages, slots = cfg.page_size, cfg.max_pages, case.max_bs
    ids = torch.randperm(slots * pages, generator=g).add_(1).view(slots, pages)
    table = (ids.repeat_interleave(p, 1) * p + torch.arange(p).repeat(pages))[:, : case.context]
    hi = case.context - case.draft
    u = torch.rand(case.n, generator=g, dtype=torch.float64)
    kind = torch.randint(0, 4, (case.n,), generator=g)
    log_uni = torch.exp(u * torch.log(torch.tensor(float(hi)))).long()
    lens = torch.where(kind == 0, (u * min(hi, 512)).long() + 1,
                       torch.where(kind == 3, hi - (u * 64).long(), log_uni)).clamp_(1, hi)
    req_pool_indices = torch.randperm(slots, generator=g)[: case.n]
    return UpdateInputs(lens.to(device), req_pool_indices.to(device),
                        table.to(torch.int32).contiguous().to(device), lens.clone())


@dataclass(frozen=True)
class UpdateImpl:
    """One update path. ``prepare(case, inputs, device)`` builds its buffers and returns the
    per-step call; ``skip(case, device)`` returns why it cannot run here, or None. ``about``:
    one line under the report's tables saying what the column measures."""

    name: str
    baseline: bool
    about: str
    prepare: Callable[[UpdateCase, UpdateInputs, torch.device], Callable[[], object]]
    skip: Callable[[UpdateCase, torch.device], str | None] = lambda case, dev: None


def _classic(case: UpdateCase, x: UpdateInputs, dev: torch.device) -> Callable[[], object]:
    c = ClassicPaged(case.config(dev), num_draft_tokens=case.draft)
    return lambda: c.replay(case.bs, x.seq_lens, x.req_pool_indices, x.req_to_token,
                            x.seq_lens_cpu)


def _attnpool(impl: Impl, host: bool) -> Callable[[UpdateCase, UpdateInputs, torch.device],
                                                  Callable[[], object]]:
    def prepare(case: UpdateCase, x: UpdateInputs, dev: torch.device) -> Callable[[], object]:
        pool = BufferPool(case.config(dev, impl))
        phase = pool.verify if case.phase == "verify" else pool.decode
        lens = x.seq_lens_cpu if host else None
        return lambda: phase.update_(case.bs, seq_lens=x.seq_lens,
                                     req_pool_indices=x.req_pool_indices,
                                     req_to_token=x.req_to_token, seq_lens_cpu=lens)
    return prepare


#: Why the fused path is not timed on CPU (op counts may still run it in the interpreter).
INTERPRET_ONLY = "Triton runs on CPU only in interpret mode, which is not a timing"


def _triton_skip(case: UpdateCase, dev: torch.device) -> str | None:
    if dev.type != "cuda":
        return INTERPRET_ONLY
    try:
        BufferPool(case.config(dev, Impl.TRITON))
    except PoolError as e:
        return f"no fused path in this build ({e})"
    return None


#: Update paths, baseline first. Adding a path is adding a line.
UPDATE_IMPLS: tuple[UpdateImpl, ...] = (
    UpdateImpl("classic", True, "the per-op refill of zero-filled buffers engines did before "
               "fusing (the baseline; attnpool.tools.baseline)", _classic),
    UpdateImpl("attnpool-reference", False, "pool.decode/verify.update_ on the torch reference "
               "path, given seq_lens_cpu (host bounds: only the longest row's page columns)",
               _attnpool(Impl.REFERENCE, host=True)),
    UpdateImpl("attnpool-reference-static", False, "the same update without seq_lens_cpu: "
               "nothing read on the host, static bounds, every page column gathered",
               _attnpool(Impl.REFERENCE, host=False)),
    UpdateImpl("attnpool-triton", False, "the fused Triton update, given seq_lens_cpu (timed "
               "on CUDA only)", _attnpool(Impl.TRITON, host=True), _triton_skip),
)


def update_cases(suite: Suite) -> list[UpdateCase]:
    return [UpdateCase(ph, p, bs, suite.update_context, max(suite.update_bs))
            for ph, p in suite.update_parts for bs in suite.update_bs]


# ---- timing -----------------------------------------------------------------------------------
def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a device synchronise on CUDA, so a timing covers the device work."""
    if device.type != "cuda":
        return fn

    def run() -> object:
        out = fn()
        torch.cuda.synchronize(device)
        return out
    return run


def rounds_for(fn: Callable[[], object], budget_s: float, lo: int, hi: int) -> int:
    """Rounds that fit ``budget_s`` from one warm call (at least ``lo``, at most ``hi``)."""
    fn()
    t0 = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t0, 1e-7)
    return max(lo, min(hi, int(budget_s / dt)))


def interleaved(fns: list[Callable[[], object]], device: torch.device, suite: Suite
                ) -> list[list[float]]:
    """Per-call times of each of ``fns``, one call of each per round in turn (the rounds that
    fit the suite's budget for the slowest). Each is warmed first (caches, compilation)."""
    fns = [synced(fn, device) for fn in fns]
    rounds = min((rounds_for(fn, suite.budget_s, suite.min_rounds, suite.max_rounds)
                  for fn in fns), default=0)
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, ts in zip(fns, out, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return out


# ---- runner -----------------------------------------------------------------------------------
def run(suite: Suite, device: torch.device, progress: bool = True) -> dict[str, Any]:
    """Measure every case of ``suite``; returns the JSON-able report (see :func:`format_report`)."""
    cases = update_cases(suite)
    total = len(suite.init_configs) * (len(INIT_IMPLS) + 1) + len(cases) * len(UPDATE_IMPLS)
    bar = Bar(total, progress)
    results: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []

    def record(group: str, case: str, impl: str, ts: list[float], cfg: PoolConfig,
               **extra: Any) -> None:
        results.append({"group": group, "case": case, "impl": impl,
                        "median_s": statistics.median(ts), "min_s": min(ts), "rounds": len(ts),
                        "config": config_info(cfg), **extra})

    def measure(group: str, case: str, impl: str, fn: Callable[[], object], cfg: PoolConfig,
                **extra: Any) -> None:
        record(group, case, impl, interleaved([fn], device, suite)[0], cfg, **extra)

    for name in suite.init_configs:
        cfg = PoolConfig(device=device, **suite.configs[name])
        plan = plan_arena(cfg)
        memory.append({"case": name, "overlaid_nbytes": plan.nbytes,
                       "separate_nbytes": plan.separate_nbytes,
                       "ratio": plan.nbytes / plan.separate_nbytes, "config": config_info(cfg)})
        bar.step(f"memory {name}")
        for ii in INIT_IMPLS:
            bar.step(f"init {name} {ii.name}")
            measure("init", name, ii.name, ii.prepare(cfg), cfg, nbytes=ii.nbytes(cfg))
    for case in cases:
        # Every path of a case is timed in the same rounds, alternating, so a change of the
        # machine's load while the case runs reaches the baseline and attnpool alike.
        x = make_inputs(case, device)
        run_now: list[tuple[str, Callable[[], object]]] = []
        for ui in UPDATE_IMPLS:
            bar.step(f"update {case.name} {ui.name}")
            why = ui.skip(case, device)
            if why is not None:
                skipped.append({"case": case.name, "impl": ui.name, "reason": why})
                continue
            run_now.append((ui.name, ui.prepare(case, x, device)))
        times = interleaved([fn for _, fn in run_now], device, suite)
        for (name, _), ts in zip(run_now, times, strict=True):
            record("update", case.name, name, ts, case.config(device),
                   part=case.name.rsplit("-bs", 1)[0], bs=case.bs, n=case.n)
    return {"machine": machine_info(device), "results": results, "memory": memory,
            "ratios": ratios(results), "skipped": skipped}


#: baselines of benchmark groups outside the init / update tables (``benchmarks/``): a pool
#: without a sliding window, against which the window part's cost is read
OTHER_BASELINES = {"full-only"}


def _baselines() -> set[str]:
    return ({i.name for i in INIT_IMPLS if i.baseline} | {u.name for u in UPDATE_IMPLS if u.baseline}
            | OTHER_BASELINES)


def columns() -> dict[str, str]:
    """What each implementation's column measures (printed under the tables, kept in JSON)."""
    return {i.name: i.about for i in INIT_IMPLS} | {u.name: u.about for u in UPDATE_IMPLS}


def ratios(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``impl / baseline`` median of every non-baseline result with a baseline in its case."""
    base = {(r["group"], r["case"]): r for r in results if r["impl"] in _baselines()}
    out = []
    for r in results:
        b = base.get((r["group"], r["case"]))
        if b is not None and r is not b:
            out.append({"group": r["group"], "case": r["case"], "impl": r["impl"],
                        "baseline": b["impl"], "ratio": r["median_s"] / b["median_s"]})
    return out


def run_cli(quick: bool, json_path: str | None, plot_path: str | None, device: str,
            progress: bool = True) -> int:
    """``attnpool bench``: measure, print the tables, optionally write JSON and a plot."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        print("attnpool bench: --plot needs matplotlib; install it with "
              "`pip install 'attnpool[plot]'` (or drop --plot)", file=sys.stderr)
        return 2
    dev = device_of(device)
    rep = run(QUICK if quick else FULL, dev, progress=progress)
    rep["quick"] = quick
    rep["columns"] = columns()
    print(format_report(rep, _baselines()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=2)
    if plot_path:
        plot(rep, plot_path)
    return 0

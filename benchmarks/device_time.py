"""Device time and host time per step: metadata updates and the adapters' decode attention.

``attnpool bench`` times a call from the host, synchronised, so a host-bound path and a
device-bound one look alike. This script separates the two on CUDA:

* **device time** per call: CUDA events around ``N`` calls. Before the start event the stream is
  held busy by ``torch.cuda._sleep`` long enough for the host to enqueue all ``N`` calls, so the
  device runs them back to back and the events measure device work, not host gaps
  (``covered`` in the JSON says whether the hold lasted; when it did not, the device time
  includes host gaps and is an upper bound);
* **host time** per call: ``perf_counter`` around ``N`` enqueues in a loop of their own (after a
  synchronise, with no hold: a path that syncs pays its wait, as it would in a step);
* **host units**: host time over that of one small torch op (``x.fill_(1)`` on a small device
  tensor) measured in the same run, so host costs compare across machines.

Sections: the update paths of :data:`attnpool.tools.bench.UPDATE_IMPLS` plus ``bound`` (the
fused update bound once with ``phase.bind``: on CUDA one graph replay per call), for decode and
chain verify (4 draft tokens); then one decode attention call per adapter (SDPA, FlashInfer,
flash-attn FA3 and FA4 where a kernel loads) with every row at the context length.

On a CPU (``--smoke``: tiny sizes) the same code runs with wall-clock times (column ``wall``), so
every path is exercised; the fused paths then run in Triton's interpreter (not a timing).
Every case is guarded: a failure prints its exception and the run goes on; a global time
budget (``--budget-s``) skips what is left, with a note. Run::

    python benchmarks/device_time.py --json device_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

K = 1024
#: the attention cases' model: query heads, KV heads, head dim; the page size of every case
H, H_KV, D, PAGE = 32, 8, 128, 16


@dataclass(frozen=True)
class Sizes:
    """What one run covers. ``kv_cap_bytes``: attention cases whose KV cache is larger are
    skipped; ``sdpa_cap_tokens``: the SDPA adapter (a padded gather) only up to ``bs * context``
    tokens; ``case_timeout_s``: the most one case may take before it is abandoned."""

    contexts: tuple[int, ...]
    bs: tuple[int, ...]
    warmup: int
    iters: int
    kv_cap_bytes: int
    sdpa_cap_tokens: int
    case_timeout_s: float


FULL = Sizes((1 * K, 8 * K, 32 * K, 128 * K), (1, 8, 32, 128, 256), warmup=20, iters=50,
             kv_cap_bytes=24 << 30, sdpa_cap_tokens=1 << 20, case_timeout_s=30.0)
SMOKE = Sizes((64, 256), (1, 4, 8), warmup=2, iters=3, kv_cap_bytes=1024 * 4 * H_KV * D,
              sdpa_cap_tokens=512, case_timeout_s=60.0)


def kv_bytes(bs: int, context: int) -> int:
    """Bytes of a bfloat16 K and V cache holding ``bs`` rows of ``context`` tokens."""
    return bs * context * 2 * H_KV * D * 2


# ---- timing -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """One measured path: per-call device time (None off CUDA), host time (wall off CUDA), and
    whether the device was held busy for the whole enqueue (see the module docstring)."""

    device_us: float | None
    host_us: float
    covered: bool | None


class Clock:
    """Times calls on one device, ``warmup`` calls then ``iters`` timed ones."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.cuda = device.type == "cuda"
        self.cycles_per_us = self._calibrate() if self.cuda else 0.0

    def _calibrate(self) -> float:
        """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (0: no such op)."""
        try:
            cycles = 2_000_000
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # warm up
            a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            a.record()
            torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
            b.record()
            b.synchronize()
            return float(cycles / max(a.elapsed_time(b) * 1000.0, 1e-3))
        except Exception as e:  # a missing private op only loses the hold
            print(f"note: torch.cuda._sleep unavailable ({e}); device times may include host gaps")
            return 0.0

    def time(self, fn: Callable[[], object]) -> Timing:
        """Warm up, then two loops of ``iters`` calls: the host loop (``perf_counter`` around
        the enqueues, after a synchronise; a path that syncs pays its wait here, as it would in
        a step) and, on CUDA, the device loop (events, behind a hold of the stream)."""
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(self.iters):
            fn()
        host_us = (time.perf_counter() - t0) / self.iters * 1e6
        if not self.cuda:
            return Timing(None, host_us, None)
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        if self.cycles_per_us:
            hold_us = min(host_us * self.iters * 1.5 + 200.0, 200_000.0)
            torch.cuda._sleep(int(hold_us * self.cycles_per_us))  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(self.iters):
            fn()
        covered = bool(self.cycles_per_us) and not start.query()  # type: ignore[no-untyped-call]
        end.record()
        end.synchronize()
        return Timing(start.elapsed_time(end) * 1000.0 / self.iters, host_us, covered)

    def small_op_us(self) -> float:
        """Host time (wall on a CPU) of one ``x.fill_(1)`` on a small tensor: the host unit."""
        x = torch.empty(16, device=self.device)
        runs = [self.time(lambda: x.fill_(1)).host_us for _ in range(5)]
        return statistics.median(runs)


# ---- run state --------------------------------------------------------------------------------
class CaseTimeout(Exception):
    """A case ran past its time limit (raised from the alarm handler)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the main thread after ``seconds`` (Unix; else no limit)."""
    usable = hasattr(signal, "setitimer") and _main_thread()
    if not usable:
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise CaseTimeout(f"case took more than {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.5))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclass
class Run:
    """Rows, the clock, the host unit and the deadline of one run."""

    device: torch.device
    sizes: Sizes
    clock: Clock
    start: float
    budget_s: float
    machine: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    unit_us: float = 0.0
    dead: dict[str, str] = field(default_factory=dict)  # path -> why later cases skip it

    def left(self, until: float) -> float:
        """Seconds left before ``until`` (a fraction of the budget) is reached."""
        return self.start + self.budget_s * until - time.perf_counter()

    def add(self, section: str, case: dict[str, Any], path: str, t: Timing | None = None,
            status: str = "ok", note: str = "") -> None:
        row: dict[str, Any] = {**self.machine, "section": section, **case, "path": path,
                               "status": status, "note": note, "device_us": None,
                               "host_us": None, "host_units": None, "covered": None,
                               "host_timing": "enqueue" if self.clock.cuda else "wall"}
        if t is not None:
            row.update(device_us=t.device_us, host_us=t.host_us, covered=t.covered,
                       host_units=t.host_us / self.unit_us if self.unit_us else None)
        self.rows.append(row)

    def guarded(self, section: str, case: dict[str, Any], path: str, until: float,
                setup: Callable[[], tuple[Callable[[], object], str]]) -> None:
        """Set up and time one path; any failure becomes a row with its reason."""
        if path in self.dead:
            self.add(section, case, path, status="skipped", note=self.dead[path])
            return
        left = self.left(until)
        if left <= 0:
            self.add(section, case, path, status="skipped", note="budget")
            return
        try:
            with time_limit(min(self.sizes.case_timeout_s, left + 5.0)):
                fn, note = setup()
                t = self.clock.time(fn)
            self.add(section, case, path, t, note=note)
        except Skip as e:
            self.add(section, case, path, status="skipped", note=str(e))
        except CaseTimeout as e:
            self.dead[path] = f"an earlier case timed out ({e})"
            self.add(section, case, path, status="error", note=str(e))
            print(f"{section} {case} {path}: {e}", file=sys.stderr)
        except Exception as e:  # one case never aborts the run
            self.add(section, case, path, status="error", note=f"{type(e).__name__}: {e}")
            print(f"{section} {case} {path}: error", file=sys.stderr)
            traceback.print_exc()
        finally:
            if self.device.type == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)


class Skip(Exception):
    """A path that cannot run here; the message says why."""


# ---- updates ----------------------------------------------------------------------------------
def run_updates(r: Run, phase: str, until: float, smoke_fused: bool) -> None:
    """Every update path for ``phase`` over the contexts and batch sizes."""
    from attnpool.tools import bench

    max_bs = max(r.sizes.bs)
    for ctx in r.sizes.contexts:
        for bs in r.sizes.bs:
            case = bench.UpdateCase(phase, PAGE, bs, ctx, max_bs)
            info = {"case": f"{phase}-p{PAGE}-bs{bs}-c{ctx}", "phase": phase, "bs": bs,
                    "context": ctx, "n": case.n}
            if r.left(until) <= 0:
                for ui in bench.UPDATE_IMPLS:
                    r.add("update", info, ui.name, status="skipped", note="budget")
                r.add("update", info, "bound", status="skipped", note="budget")
                continue
            _update_case(r, case, info, until, smoke_fused)
            gc.collect()


def _update_case(r: Run, case: Any, info: dict[str, Any], until: float,
                 smoke_fused: bool) -> None:
    """Every update path of one :class:`attnpool.tools.bench.UpdateCase`, plus ``bound``."""
    from attnpool import BufferPool, Impl
    from attnpool.tools import bench

    try:
        x = bench.make_inputs(case, r.device)
    except Exception as e:
        r.add("update", info, "inputs", status="error", note=f"{type(e).__name__}: {e}")
        return

    def path(ui: bench.UpdateImpl) -> Callable[[], tuple[Callable[[], object], str]]:
        def setup() -> tuple[Callable[[], object], str]:
            why = ui.skip(case, r.device)
            if why is not None and not (smoke_fused and why == bench.INTERPRET_ONLY):
                raise Skip(why)
            return ui.prepare(case, x, r.device), ui.about
        return setup

    for ui in bench.UPDATE_IMPLS:
        r.guarded("update", info, ui.name, until, path(ui))

    def bound() -> tuple[Callable[[], object], str]:
        if r.device.type != "cuda" and not smoke_fused:
            raise Skip(bench.INTERPRET_ONLY)
        pool = BufferPool(case.config(r.device, Impl.TRITON))
        ph: Any = pool.verify if case.phase == "verify" else pool.decode
        u = ph.bind(case.bs, seq_lens=x.seq_lens, req_pool_indices=x.req_pool_indices,
                    req_to_token=x.req_to_token)
        return u, (f"phase.bind(bs, ...) on the fused path, graphed={u.graphed}, "
                   f"launches per call={u.launches}")
    r.guarded("update", info, "bound", until, bound)


# ---- extend and mixed updates -----------------------------------------------------------------
#: T of the extend sections' pools: the packed query tokens of one prefill step
EXTEND_TOKENS = {"full": 8192, "smoke": 64}


def extend_step(kind: str, n: int, context: int, t: int, seed: int = 0
                ) -> tuple[Tensor, Tensor]:
    """``(seq_lens, extend_lens)`` of one step of ``n`` requests (host int64).

    ``extend``: every request a prefill chunk of ``t // n`` new tokens (at least 1) after a
    prefix of mixed length; ``mixed``: a quarter of the requests (at least one) share the chunk
    tokens ``t - (n - k)``, the others decode one token each (chunked prefill beside decode)."""
    g = torch.Generator().manual_seed(seed)
    k = n if kind == "extend" else max(1, n // 4)
    chunk = max(1, (t - (n - k)) // k)
    ext = torch.ones(n, dtype=torch.int64)
    ext[:k] = min(chunk, context)
    prefix = (torch.rand(n, generator=g, dtype=torch.float64) * (context - ext)).long()
    return prefix + ext, ext


def run_extend_updates(r: Run, kind: str, until: float, smoke_fused: bool) -> None:
    """Classic per-op extend refill against ``pool.extend.update_`` (reference, fused, bound)
    for prefill (``extend``) or mixed prefill + decode (``mixed``) steps, with the new tokens'
    KV slots written (``out_slots``) on every path."""
    t = EXTEND_TOKENS["smoke" if r.sizes is SMOKE else "full"]
    for ctx in r.sizes.contexts[:2]:
        for bs in r.sizes.bs:
            _extend_case(r, kind, until, smoke_fused, ctx, bs, t)
            gc.collect()


def _extend_case(r: Run, kind: str, until: float, smoke_fused: bool, ctx: int, bs: int,
                 t: int) -> None:
    """Every path of one extend or mixed step of ``bs`` captured rows at context ``ctx``."""
    from attnpool import BufferPool, Impl, PoolConfig
    from attnpool.tools import bench
    from attnpool.tools.baseline_extend import ClassicExtend

    max_bs = max(r.sizes.bs)
    case = bench.UpdateCase("decode", PAGE, bs, ctx, max_bs)
    n = case.n
    info = {"case": f"{kind}-p{PAGE}-bs{bs}-c{ctx}", "phase": kind, "bs": bs, "context": ctx,
            "n": n, "tokens": 0}
    try:
        x = bench.make_inputs(case, r.device)
        seq, ext = extend_step(kind, n, ctx, t)
        info["tokens"] = int(ext.sum())
    except Exception as e:
        r.add(kind, info, "inputs", status="error", note=f"{type(e).__name__}: {e}")
        return
    dseq, dext = seq.to(r.device), ext.to(r.device)
    cfg = PoolConfig(max_bs=max_bs, max_context_len=ctx, page_size=PAGE, device=r.device,
                     max_extend_tokens=t)
    inputs = {"seq_lens": dseq, "extend_lens": dext, "req_pool_indices": x.req_pool_indices,
              "req_to_token": x.req_to_token}

    def classic() -> tuple[Callable[[], object], str]:
        c = ClassicExtend(cfg)
        return (lambda: c.replay(bs, dseq, dext, x.req_pool_indices, x.req_to_token, seq, ext),
                "per-op extend refill with host bounds (attnpool.tools.baseline_extend)")

    def pool_path(impl: Impl) -> Callable[[], tuple[Callable[[], object], str]]:
        def setup() -> tuple[Callable[[], object], str]:
            if impl is Impl.TRITON and r.device.type != "cuda" and not smoke_fused:
                raise Skip(bench.INTERPRET_ONLY)
            ph = BufferPool(dataclasses.replace(cfg, impl=impl)).extend
            slots = torch.empty(t, dtype=torch.int64, device=r.device)
            return (lambda: ph.update_(bs, **inputs, seq_lens_cpu=seq, extend_lens_cpu=ext,
                                       out_slots=slots),
                    f"pool.extend.update_ ({impl.value}, with the host copies)")
        return setup

    def bound() -> tuple[Callable[[], object], str]:
        if r.device.type != "cuda" and not smoke_fused:
            raise Skip(bench.INTERPRET_ONLY)
        ph = BufferPool(dataclasses.replace(cfg, impl=Impl.TRITON)).extend
        slots = torch.empty(t, dtype=torch.int64, device=r.device)
        u = ph.bind(bs, **inputs, out_slots=slots)
        return u, f"pool.extend.bind on the fused path, graphed={u.graphed}"

    paths = {"classic": classic, "attnpool-reference": pool_path(Impl.REFERENCE),
             "attnpool-triton": pool_path(Impl.TRITON), "bound": bound}
    for name, setup in paths.items():
        r.guarded(kind, info, name, until, setup)


# ---- attention --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backends:
    """Attention backends to time; fields left None load the real ones. Tests pass fakes."""

    flashinfer: tuple[type[Any], type[Any]] | None = None  # (decode, prefill) wrapper classes
    fa3: Any = None  # a FlashKernel
    fa4: Any = None  # a FlashKernel


def _fa_kernel(given: Any, loader: str) -> Any:
    from attnpool.adapters import flash_attn as fa
    from attnpool.adapters.flash_attn import load as fal

    if given is not None:
        return given
    load = getattr(fa, loader, None) or getattr(fal, loader, None)
    if load is None:
        raise Skip(f"attnpool.adapters.flash_attn has no {loader}()")
    try:
        return load()
    except ImportError as e:
        raise Skip(f"no kernel loads: {e}") from None


@dataclass(frozen=True)
class Case:
    """One attention case's tensors: the pool, its capture and refilled decode views, queries,
    cache and the FlashInfer workspace."""

    pool: Any
    cap: Any  # the capture view (taken before the update, as an engine does)
    view: Any
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ws: torch.Tensor


def _attention_case(r: Run, until: float, backends: Backends, info: dict[str, Any],
                    c: Case) -> None:
    """Time every adapter on one refilled decode view."""
    from attnpool.adapters import flash_attn as fa
    from attnpool.adapters import flashinfer as fi
    from attnpool.adapters import sdpa

    bs, ctx, dev = info["bs"], info["context"], r.device

    def run_sdpa() -> tuple[Callable[[], object], str]:
        if bs * ctx > r.sizes.sdpa_cap_tokens:
            raise Skip(f"capped: SDPA only up to bs*context <= {r.sizes.sdpa_cap_tokens}"
                       " tokens (a padded gather of the whole batch)")
        return (lambda: sdpa.paged_attention_out(c.view, c.q, c.k, c.v),
                "sdpa.paged_attention_out (plan built in every call)")

    def run_flashinfer() -> tuple[Callable[[], object], str]:
        cls = backends.flashinfer
        if cls is None:
            if dev.type != "cuda":
                raise Skip("FlashInfer needs CUDA")
            try:
                import flashinfer  # noqa: F401
            except Exception as e:
                raise Skip(f"flashinfer does not import: {e}") from None
        gw = fi.GraphWrappers(c.ws, decode_cls=cls[0] if cls else None,
                              prefill_cls=cls[1] if cls else None)
        gw.wrapper(c.cap)  # built on the capture view, then planned on the refilled one
        gw.plan(c.view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=D, q_dtype=c.q.dtype)
        return (lambda: gw.run(c.view, c.q, c.k, c.v),
                "GraphWrappers.run (decode wrapper, no tensor cores; planned once, outside "
                "the timing)")

    def run_fa(given: Any, loader: str) -> Callable[[], tuple[Callable[[], object], str]]:
        def setup() -> tuple[Callable[[], object], str]:
            if given is None and dev.type != "cuda":
                raise Skip("flash-attn needs CUDA")
            kern = _fa_kernel(given, loader)
            return (lambda: fa.run(c.view, c.q, c.k, c.v, version=kern.version, kernel=kern),
                    f"flash_attn.run, kernel {kern.name}")
        return setup

    r.guarded("attention", info, "sdpa", until, run_sdpa)
    r.guarded("attention", info, "flashinfer", until, run_flashinfer)
    r.guarded("attention", info, "fa3", until, run_fa(backends.fa3, "load_fa3"))
    r.guarded("attention", info, "fa4", until, run_fa(backends.fa4, "load_fa4"))


def run_attention(r: Run, until: float, backends: Backends) -> None:
    """One decode attention call per adapter, every row at the context length."""
    from attnpool import BufferPool, Layout, PoolConfig

    dev, bf16 = r.device, torch.bfloat16
    fits = [(c, b) for c in r.sizes.contexts for b in r.sizes.bs
            if kv_bytes(b, c) <= r.sizes.kv_cap_bytes]
    pages = max((b * c // PAGE for c, b in fits), default=0) + 1  # + the pad page 0
    try:
        k = torch.empty(pages, PAGE, H_KV, D, dtype=bf16, device=dev).normal_()
        v = torch.empty(pages, PAGE, H_KV, D, dtype=bf16, device=dev).normal_()
    except Exception as e:
        print(f"attention: cache of {pages} pages failed: {e}", file=sys.stderr)
        r.add("attention", {"case": "cache"}, "all", status="error", note=str(e))
        return
    ws = torch.empty(128 << 20 if dev.type == "cuda" else 1 << 16, dtype=torch.uint8, device=dev)
    paths = ("sdpa", "flashinfer", "fa3", "fa4")
    g = torch.Generator().manual_seed(0)
    for ctx in r.sizes.contexts:
        try:
            pool = BufferPool(PoolConfig(max_bs=max(r.sizes.bs), max_context_len=ctx,
                                         page_size=PAGE, device=dev,
                                         layout=Layout.FLASH_ATTN | Layout.FLASHINFER))
        except Exception as e:
            r.add("attention", {"case": f"pool-c{ctx}"}, "all", status="error",
                  note=f"{type(e).__name__}: {e}")
            continue
        for bs in r.sizes.bs:
            info = {"case": f"decode-attn-bs{bs}-c{ctx}", "phase": "decode", "bs": bs,
                    "context": ctx, "n": bs}
            if kv_bytes(bs, ctx) > r.sizes.kv_cap_bytes:
                for p in paths:
                    r.add("attention", info, p, status="skipped",
                          note=f"memory: KV cache {_mib(kv_bytes(bs, ctx))} > cap "
                               f"{_mib(r.sizes.kv_cap_bytes)}")
                continue
            if r.left(until) <= 0:
                for p in paths:
                    r.add("attention", info, p, status="skipped", note="budget")
                continue
            ppr = ctx // PAGE
            try:
                ids = torch.randperm(bs * ppr, generator=g).add_(1).view(bs, ppr)
                table = ids.to(torch.int32).to(dev)
                lens_cpu = torch.full((bs,), ctx, dtype=torch.int64)
                cap = pool.decode.view(bs)
                view = pool.decode.update_(bs, seq_lens=lens_cpu.to(dev), block_table=table,
                                           seq_lens_cpu=lens_cpu)
                q = torch.randn(bs, H, D, generator=g).to(bf16).to(dev)
            except Exception as e:
                r.add("attention", info, "all", status="error", note=f"{type(e).__name__}: {e}")
                traceback.print_exc()
                continue

            info["max_seqlen_k"] = view.max_seqlen_k  # the view's host bound: the context
            _attention_case(r, until, backends, info, Case(pool, cap, view, q, k, v, ws))
        del pool
        gc.collect()


# ---- report -----------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def _us(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}"


def table(rows: list[dict[str, Any]], section: str, cuda: bool) -> str:
    """A markdown table of one section's rows."""
    head = ("| case | path | device µs | host µs | host units | note |" if cuda
            else "| case | path | wall µs | host units | note |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for x in rows:
        if x["section"] != section:
            continue
        # an ok row's note describes its path (kept in the JSON); others say why not
        note = "" if x["status"] == "ok" else f"{x['status']}: {x['note']}"
        if x.get("covered") is False:
            note = "device time includes host gaps; " + note
        units = "" if x["host_units"] is None else f"{x['host_units']:.1f}"
        cells = ([_us(x["device_us"]), _us(x["host_us"])] if cuda else [_us(x["host_us"])])
        out.append(f"| {x['case']} | {x['path']} | " + " | ".join(cells)
                   + f" | {units} | {note[:120]} |")
    return "\n".join(out)


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "gpu": None}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def main(argv: Sequence[str] | None = None, backends: Backends | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds; CPU)")
    ap.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (default)")
    ap.add_argument("--json", default=None, help="write every row to this file")
    ap.add_argument("--budget-s", type=float, default=90.0,
                    help="time budget of the measurements; what is left is skipped (default 90)")
    ap.add_argument("--sections", default="decode,attention,verify",
                    help="which sections run, in this order: decode (updates), attention, "
                         "verify (updates), extend and mixed (prefill and prefill + decode "
                         "updates); the budget is shared by their weights")
    args = ap.parse_args(argv)
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
    from attnpool.tools import bench

    dev = bench.device_of(args.device)
    sizes = SMOKE if args.smoke else FULL
    smoke_fused = dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"
    r = Run(dev, sizes, Clock(dev, sizes.warmup, sizes.iters), time.perf_counter(),
            args.budget_s, machine(dev))
    r.unit_us = r.clock.small_op_us()
    print(f"# device_time on {dev} ({r.machine['gpu'] or 'cpu'}), torch {torch.__version__}; "
          f"host unit (x.fill_(1)): {r.unit_us:.2f} µs; {sizes.warmup} warm-up + "
          f"{sizes.iters} timed calls per path; budget {args.budget_s:.0f} s", flush=True)
    # Sections by share of the budget: decode updates, attention, then chain verify updates.
    every: dict[str, tuple[str, float, Callable[[float], None]]] = {
        "decode": ("decode updates", 0.45, lambda u: run_updates(r, "decode", u, smoke_fused)),
        "attention": ("attention", 0.40, lambda u: run_attention(r, u, backends or Backends())),
        "verify": ("verify updates", 0.15, lambda u: run_updates(r, "verify", u, smoke_fused)),
        "extend": ("extend updates", 0.2,
                   lambda u: run_extend_updates(r, "extend", u, smoke_fused)),
        "mixed": ("mixed updates", 0.2, lambda u: run_extend_updates(r, "mixed", u, smoke_fused)),
    }
    chosen = [every[k.strip()] for k in args.sections.split(",") if k.strip()]
    total = sum(w for _, w, _ in chosen) or 1.0
    sections, acc = [], 0.0
    for name, weight, fn in chosen:  # cumulative shares of the budget, in the order given
        acc += weight / total
        sections.append((name, acc, fn))
    for name, until, fn in sections:
        t0 = time.perf_counter()
        try:
            fn(until)
        except Exception:  # a section never aborts the run
            print(f"{name}: section failed", file=sys.stderr)
            traceback.print_exc()
        print(f"# {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    cuda = dev.type == "cuda"
    print("\n## Updates (page 16; decode, then chain verify with 4 draft tokens)\n")
    print(table(r.rows, "update", cuda))
    print(f"\n## Decode attention (bf16, {H} query / {H_KV} KV heads, head dim {D}, page {PAGE},"
          f" every row at the context length; SDPA only up to bs*context <= "
          f"{sizes.sdpa_cap_tokens} tokens)\n")
    print(table(r.rows, "attention", cuda))
    for kind in ("extend", "mixed"):
        if any(x["section"] == kind for x in r.rows):
            print(f"\n## {kind.capitalize()} updates (page {PAGE}, T = new tokens of the step; "
                  f"out_slots written on every path)\n")
            print(table(r.rows, kind, cuda))
    skipped_budget = sum(1 for x in r.rows if x["note"] == "budget")
    if skipped_budget:
        print(f"\nnote: {skipped_budget} rows skipped for the time budget (--budget-s)")
    print(f"\ntotal {time.perf_counter() - r.start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": r.machine, "host_unit_us": r.unit_us, "args": vars(args),
                       "sizes": dataclasses.asdict(sizes), "rows": r.rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

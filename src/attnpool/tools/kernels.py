"""``attnpool kernels``: compile every fused-kernel specialization for a GPU target, without a GPU.

Why: on a CPU the test suite runs the Triton kernels in Triton's interpreter, which never compiles
them, so a kernel that fails to compile for a GPU, or spills registers there, would only show up on
a GPU. Triton's NVIDIA backend compiles without one (the triton wheel ships ``ptxas`` and
``cuobjdump``): this compiles each specialization the pools launch and reads its registers, spills
and shared memory from the compiler's own output. It is compile-only evidence: nothing runs, so it
says nothing about speed.

Where the specializations come from: not a list kept by hand. :mod:`.kernel_cases` updates real
pools (:class:`attnpool.BufferPool`, :class:`attnpool.KVCachePool`) over a matrix of configs with
a :class:`Recorder` registered as the launch recorder (:func:`attnpool.update.launch.recording`).
Each launch the update wrappers assemble becomes its :class:`Spec` through Triton's own launch
binder (the code that picks the compiled kernel at a launch: argument types, the values it
specializes on, constexprs, ``num_warps``), and is not run. Compiling happens in worker
processes (:mod:`.kernel_compile`) started without ``TRITON_INTERPRET``, under which
``@triton.jit`` gives interpreter objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import InputError

#: The targets ``--target`` accepts, by compute capability (Triton's ``GPUTarget("cuda", cc, 32)``).
TARGETS = {"sm_80": 80, "sm_90": 90}

#: One kernel parameter of a specialization: ``(name, kind, value)``. ``kind`` is Triton's type
#: (``*i32``, ``i32``, ...; ``value`` then is ``"D"`` when Triton assumes divisibility by 16, else
#: ``""``), ``"constexpr"`` (a declared constexpr, ``value`` its value), ``"dtype"`` (a constexpr
#: holding a ``tl.dtype``, ``value`` its name) or ``"one"`` (a runtime int equal to 1, which Triton
#: turns into a constant).
Param = tuple[str, str, Any]


def capability(target: str) -> int:
    """The compute capability of ``target`` (``sm_80`` -> 80); :class:`InputError` otherwise."""
    if target not in TARGETS:
        raise InputError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    return TARGETS[target]


def _int_class(v: int) -> str:
    """What a numeric constexpr is to the code Triton generates: 1, a power of two, or another."""
    return "1" if v == 1 else "2^k" if v > 1 and v & (v - 1) == 0 else "n"


@dataclass(frozen=True)
class Spec:
    """One compiled variant of a kernel: what Triton's launch binder keys its cache on."""

    kernel: str  # "module:qualname" of the @triton.jit function
    params: tuple[Param, ...]
    num_warps: int
    maxnreg: int | None = None  # the launch's ``maxnreg`` (a ``.maxnreg`` in the PTX), if any

    @property
    def name(self) -> str:
        return self.kernel.rpartition(":")[2]

    def family(self) -> tuple[object, ...]:
        """The launch *kind*, without what varies with sizes and values: declared constexprs
        (numbers as 1 / power of two / other), pointer element types (every integer pointer as
        ``*int``: their widths are checked per parameter, :meth:`arg_types`) and nothing of the
        runtime ints. Launches of one family run the same code paths."""
        out: list[object] = [self.kernel]
        for name, kind, v in self.params:
            if kind == "constexpr":
                out.append((name, _int_class(v) if type(v) is int else v))
            elif kind == "dtype":
                out.append((name, v))
            elif kind.startswith("*"):
                out.append((name, "*int" if kind[1] in "iu" else kind))
        return tuple(out)

    def arg_types(self) -> set[tuple[str, str, str]]:
        """``(kernel, parameter, integer pointer type)`` and ``(kernel, "num_warps", w)``: the
        argument widths and warp counts launched, one parameter at a time."""
        out = {(self.name, "num_warps", str(self.num_warps))}
        out.update((self.name, n, k) for n, k, _ in self.params if k[:2] in ("*i", "*u"))
        return out

    def label(self) -> str:
        """A short text of the specialization: flags, sizes, non-int32 pointers, runtime ints
        equal to 1, and a hash of the whole key (rows with equal text differ in alignment)."""
        on = [n for n, k, v in self.params if k == "constexpr" and v is True]
        sizes = [f"{n}={v}" for n, k, v in self.params
                 if (k == "constexpr" and type(v) in (int, float)) or (k == "dtype")]
        wide: dict[str, list[str]] = {}
        for n, k, _ in self.params:
            if k.startswith("*") and k != "*i32":
                wide.setdefault(k[1:], []).append(n.removesuffix("_ptr"))
        ones = [n for n, k, _ in self.params if k == "one"]
        parts = [" ".join(on) or "-", " ".join(sizes)]
        parts += [f"{t}: {' '.join(ns)}" for t, ns in sorted(wide.items())]
        if ones:
            parts.append("=1: " + " ".join(ones))
        digest = hashlib.sha1(repr(self).encode()).hexdigest()[:6]
        return "; ".join(p for p in parts if p) + f" #{digest}"

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "params": [list(p) for p in self.params],
                "num_warps": self.num_warps, "maxnreg": self.maxnreg}


def _from_pool() -> bool:
    """Whether the launch being assembled comes from a pool (a phase's update, a KV store), not
    from a direct call of an update wrapper (the wrappers' own tests combine flags freely)."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("attnpool.phases.") or mod == "attnpool.kv.cache":
            return True
        f = f.f_back  # type: ignore[assignment]
    return False


class Recorder:
    """A launch recorder (:class:`attnpool.update.launch.LaunchRecorder`): turns each assembled
    launch into its :class:`Spec` for ``target``.

    Args:
        dry_run: skip the recorded launches (enumeration needs the arguments, not the bytes).
        pools_only: record only launches assembled by a pool (see :func:`_from_pool`).
    """

    def __init__(self, target: str = "sm_90", *, dry_run: bool = False,
                 pools_only: bool = False) -> None:
        self.cc = capability(target)
        self.dry_run, self.pools_only = dry_run, pools_only
        #: every specialization seen, with the case that first launched it
        self.specs: dict[Spec, str] = {}
        #: what is being updated now (set by the enumerator; shown with each specialization)
        self.case = ""
        self._binders: dict[int, tuple[Any, list[str], list[bool], Callable[..., Any], int]] = {}

    def __call__(self, kernel: Any, grid: tuple[int, ...], args: tuple[object, ...],
                 kw: dict[str, Any]) -> bool:
        if not callable(getattr(kernel, "fn", None)):
            return False  # not a Triton kernel (a benchmark's stand-in): nothing to compile
        if self.pools_only and not _from_pool():
            return False
        self.specs.setdefault(self.spec(kernel, args, kw), self.case)
        return self.dry_run

    def _binder(self, kernel: Any) -> tuple[Any, list[str], list[bool], Callable[..., Any], int]:
        b = self._binders.get(id(kernel))
        if b is None:
            from triton.backends.compiler import GPUTarget
            from triton.compiler.compiler import make_backend
            from triton.runtime.jit import JITFunction, create_function_from_signature

            # Under TRITON_INTERPRET the kernel is an interpreter object: its function, jitted
            # again here, has the same parameters (nothing is compiled by this).
            jf = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn,
                                                                            **kernel.kwargs)
            with warnings.catch_warnings():  # (triton 3.9's note on a default to change)
                warnings.simplefilter("ignore")
                backend = make_backend(GPUTarget("cuda", self.cc, 32))
                warps = int(backend.parse_options({}).num_warps)
            fn = create_function_from_signature(jf.signature, jf.params, backend)
            b = (kernel, [p.name for p in jf.params], [p.is_constexpr for p in jf.params], fn,
                 warps)
            self._binders[id(kernel)] = b
        return b

    def spec(self, kernel: Any, args: tuple[object, ...], kw: dict[str, Any]) -> Spec:
        """The specialization Triton picks for ``kernel[grid](*args, **kw)`` on this target."""
        k, names, declared, bind, warps = self._binder(kernel)
        _, special, options = bind(*args, **kw)
        params: list[Param] = []
        for name, is_cx, (kind, v) in zip(names, declared, special, strict=True):
            if is_cx:
                dt = type(v).__name__ == "dtype"
                params.append((name, "dtype" if dt else "constexpr", str(v) if dt else v))
            elif kind == "constexpr":
                params.append((name, "one", v))
            else:
                params.append((name, str(kind), v or ""))
        fn = k.fn
        maxnreg = options.get("maxnreg")
        return Spec(f"{fn.__module__}:{fn.__qualname__}", tuple(params),
                    int(options.get("num_warps", warps)),
                    None if maxnreg is None else int(maxnreg))

    @contextmanager
    def active(self) -> Iterator[Recorder]:
        """Register this recorder as the launch recorder while the block runs
        (:func:`attnpool.update.launch.recording`); the previous one comes back after."""
        from ..update.launch import recording

        with recording(self):
            yield self


def missing(launched: Iterable[Spec], enumerated: Iterable[Spec]) -> list[str]:
    """What ``launched`` has that ``enumerated`` lacks: families, then per-parameter types and
    warp counts (one line each; empty when ``enumerated`` covers ``launched``)."""
    enum, got = list(enumerated), list(launched)
    fams = {s.family() for s in enum}
    types: set[tuple[str, str, str]] = set().union(*(s.arg_types() for s in enum))
    seen: set[tuple[str, str, str]] = set().union(*(s.arg_types() for s in got))
    out = [f"{s.name}: {s.label()}" for s in got if s.family() not in fams]
    out += [f"{k}: {p} = {t}" for k, p, t in sorted(seen - types)]
    return sorted(set(out))


@dataclass(frozen=True)
class Result:
    """What compiling one specialization gave (sizes in bytes; ``error`` when it failed)."""

    spec: Spec
    case: str
    regs: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    shared: int = 0
    cubin: int = 0
    seconds: float = 0.0
    error: str = ""


_DONE: dict[tuple[Spec, int], Result] = {}
_LOCK = threading.Lock()


def compile_specs(specs: dict[Spec, str], target: str, jobs: int | None = None) -> list[Result]:
    """Compile every spec for ``target`` in ``jobs`` worker processes (default: one per core).

    Results are kept for the life of this process: a spec is compiled once per run. Workers
    start without ``TRITON_INTERPRET`` and with their own empty Triton cache, so each compile
    runs ``ptxas`` (whose log is where spills are read)."""
    import queue
    import subprocess
    import tempfile

    cc = capability(target)
    todo = [s for s in specs if (s, cc) not in _DONE]
    # largest blocks first: the slowest compiles start early and the workers finish together
    todo.sort(key=lambda s: -max([v for _, k, v in s.params if k == "constexpr"
                                  and type(v) is int] + [0]) * s.num_warps)
    if todo:
        q: queue.Queue[Spec] = queue.Queue()
        for s in todo:
            q.put(s)
        with tempfile.TemporaryDirectory(prefix="attnpool-kernels-") as tmp:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            # (FP fusion "1" is triton 3.9's default; set, it keeps the worker from warning)
            env.update(TRITON_CACHE_DIR=os.path.join(tmp, "cache"), TRITON_DEFAULT_FP_FUSION="1")
            n = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
            cmd = [sys.executable, "-m", "attnpool.tools.kernel_compile", str(cc)]

            def work(i: int) -> None:
                log = os.path.join(tmp, f"worker{i}.log")
                with open(log, "w") as err, subprocess.Popen(
                        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                        env=env, bufsize=1) as p:
                    assert p.stdin is not None and p.stdout is not None
                    while True:
                        try:
                            s = q.get_nowait()
                        except queue.Empty:
                            break
                        p.stdin.write(json.dumps(s.to_json()) + "\n")
                        p.stdin.flush()
                        line = ""
                        while line is not None and not line.startswith("@@ "):
                            line = p.stdout.readline() or None  # type: ignore[assignment]
                        if line is None:  # the worker died: that spec is a failure
                            with open(log) as f:
                                tail = f.read()[-2000:]
                            _store(s, cc, specs[s], {"error": f"worker died: {tail}"})
                            break
                        _store(s, cc, specs[s], json.loads(line[3:]))
                    p.stdin.close()

            threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        left = [s for s in todo if (s, cc) not in _DONE]
        if left:  # every worker died before the queue emptied: new ones take the rest
            return compile_specs(specs, target, jobs)
    return [_DONE[s, cc] for s in specs]


def _store(s: Spec, cc: int, case: str, r: dict[str, Any]) -> None:
    keys = ("regs", "spill_stores", "spill_loads", "stack", "shared", "cubin", "seconds", "error")
    with _LOCK:
        _DONE[s, cc] = Result(s, case, **{k: r[k] for k in keys if k in r})


def table(results: Sequence[Result], target: str) -> str:
    """The Markdown table of ``results``; its last line sums them up."""
    head = ("| kernel | specialization | num_warps | registers | spill stores / loads (B) | "
            "shared (B) | cubin (B) | compile (s) |\n|---|---|---:|---:|---:|---:|---:|---:|")
    rows = [head]
    for r in sorted(results, key=lambda r: (r.spec.name, r.spec.label())):
        if r.error:
            first = " ".join(r.error.split())[:200].replace("|", "/")
            rows.append(f"| {r.spec.name} | {r.spec.label()} | {r.spec.num_warps} | "
                        f"FAILED: {first} | | | | |")
            continue
        rows.append(f"| {r.spec.name} | {r.spec.label()} | {r.spec.num_warps} | {r.regs} | "
                    f"{r.spill_stores} / {r.spill_loads} | {r.shared} | {r.cubin} | "
                    f"{r.seconds:.2f} |")
    return "\n".join(rows) + "\n\n" + by_kernel(results) + "\n\n" + summary(results, target)


def by_kernel(results: Sequence[Result]) -> str:
    """One row per kernel and warp count: how many specializations, register range, spills."""
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.spec.name, r.spec.num_warps), []).append(r)
    rows = ["| kernel | num_warps | specializations | failed | registers | with spills | "
            "spill stores / loads (B) | shared max (B) | cubin max (B) | compile (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, w), rs in sorted(groups.items()):
        failed = sum(bool(r.error) for r in rs)
        ok = [r for r in rs if not r.error] or [Result(rs[0].spec, "")]  # (all failed: zeros)
        regs = sorted(r.regs for r in ok)
        rows.append(f"| {name} | {w} | {len(rs)} | {failed} | {regs[0]}-{regs[-1]} | "
                    f"{sum(bool(r.spill_stores or r.spill_loads) for r in ok)} | "
                    f"{sum(r.spill_stores for r in ok)} / {sum(r.spill_loads for r in ok)} | "
                    f"{max(r.shared for r in ok)} | {max(r.cubin for r in ok)} | "
                    f"{sum(r.seconds for r in ok):.1f} |")
    return "\n".join(rows)


def summary(results: Sequence[Result], target: str) -> str:
    ok = [r for r in results if not r.error]
    failed = len(results) - len(ok)
    top = max(ok, key=lambda r: r.regs, default=None)
    spilled = [r for r in ok if r.spill_stores or r.spill_loads]
    most = (f"largest register count {top.regs} ({top.spec.name}, {top.spec.num_warps} warps)"
            if top else "no kernel compiled")
    return (f"**{len(ok)} of {len(results)} specializations compiled for {target}** "
            f"({failed} failed); {most}; spills: {sum(r.spill_stores for r in ok)} B stored / "
            f"{sum(r.spill_loads for r in ok)} B loaded in {len(spilled)} specializations.")


_ENUMERATED: dict[str, dict[Spec, str]] = {}


def enumerate_specs(target: str = "sm_90") -> dict[Spec, str]:
    """Every specialization the pools launch over :mod:`.kernel_cases`' matrix, each with the
    case that first launched it (computed once per process and target)."""
    from .kernel_cases import run_matrix

    if target not in _ENUMERATED:
        rec = Recorder(target, dry_run=True)
        with rec.active():
            run_matrix(rec)
        _ENUMERATED[target] = rec.specs
    return dict(_ENUMERATED[target])


def run_cli(target: str, json_path: str | None = None, jobs: int | None = None) -> int:
    """``attnpool kernels``: enumerate, compile, print the table. Exit code 1 when any
    specialization fails to compile or spills."""
    specs = enumerate_specs(target)
    results = compile_specs(specs, target, jobs)
    print(table(results, target))
    if json_path:
        import triton

        rows = [{**r.spec.to_json(), "name": r.spec.name, "label": r.spec.label(),
                 "case": r.case, "regs": r.regs, "spill_stores": r.spill_stores,
                 "spill_loads": r.spill_loads, "stack": r.stack, "shared": r.shared,
                 "cubin": r.cubin, "seconds": r.seconds, "error": r.error} for r in results]
        with open(json_path, "w") as f:
            json.dump({"target": target, "triton": triton.__version__, "results": rows}, f,
                      indent=1)
    bad = any(r.error or r.spill_stores or r.spill_loads for r in results)
    return 1 if bad else 0

"""Count what one metadata update costs in aten ops: launches, host syncs, temporaries.

``DispatchCounter`` is a ``TorchDispatchMode``: it sees every aten op after Python and composite
ops are decomposed, i.e. what would reach a device kernel. Each op is classified as

* ``view``: a view op (``slice``, ``select``, ``view``, ...): metadata only, no kernel;
* ``launch``: a compute op on device memory with a non-empty output (one kernel launch on CUDA);
* ``empty``: the same on a zero-element tensor (dispatched, but CUDA launches no kernel);
* ``sync``: a host read of device memory (``aten._local_scalar_dense`` on a device tensor, i.e.
  ``.item()``; a device-to-host ``copy_``/``_to_copy``, i.e. ``.cpu()``/``.tolist()``), which
  blocks the host until the device has caught up and cannot be captured in a graph;
* ``host``: an op whose tensor inputs all live on the host (e.g. ``seq_lens_cpu.max()`` and its
  ``.item()``): no device work, no sync.

Launches that allocate a new output tensor are also counted as ``alloc`` (temporaries), and so
are bare device allocations (``aten.empty``), which launch nothing. Python-level
host work that does not dispatch (``Tensor.tolist()`` of a host tensor) is not counted.

On a CPU-only machine the "device" is the CPU too, so host tensors are told apart by tagging: pass
the host inputs (``seq_lens_cpu``) as ``host``; every output computed only from tagged tensors is
tagged in turn. On CUDA a CPU tensor is a host tensor, tagged or not.

Triton launches are counted apart (``triton``), by the launch counter of ``tests/helpers/opcount.py``
(triton's launch hook on a GPU; the interpreter's ``run`` on CPU). The aten ops the interpreter
issues to emulate a kernel on the host are not counted: a compiled launch issues none.

Run ``python benchmarks/dispatch_count.py`` for the tables in BENCHMARKS.md (on CPU the fused
path runs in the Triton interpreter: its counts are the same as on a GPU, its times are not).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_ALLOC_ONLY = ("aten.empty.", "aten.empty_strided.", "aten.new_empty.", "aten.new_empty_strided.")
_SYNC_SHAPE_OPS = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                   "aten.unique_consecutive.default"}


@dataclass
class Counts:
    triton: int = 0
    launch: int = 0
    empty: int = 0
    view: int = 0
    sync: int = 0
    host: int = 0
    alloc: int = 0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    syncs: list[str] = field(default_factory=list)


def _opcount() -> ModuleType:
    """tests/helpers/opcount.py (the tests' op recorder and Triton launch counter), loaded by path
    (this script runs without the repository root on ``sys.path``)."""
    path = pathlib.Path(__file__).resolve().parent.parent / "tests" / "helpers" / "opcount.py"
    spec = importlib.util.spec_from_file_location("opcount", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("opcount", mod)
    spec.loader.exec_module(mod)
    return mod


_OC = sys.modules.get("tests.helpers.opcount") or sys.modules.get("opcount") or _opcount()


class DispatchCounter(_OC.OpRecorder):  # type: ignore[misc]
    """Classify every aten op run under it (see the module docstring); the recording itself, and
    leaving out the ops of an interpreted Triton launch, is the tests' :class:`OpRecorder`."""

    def __init__(self, device: torch.device, host: Iterable[torch.Tensor] = (),
                 in_launch: Callable[[], bool] = lambda: False) -> None:
        super().__init__(in_launch)
        self.device = device
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in host:
            self._host[t] = True
        self.counts = Counts()

    def _is_host(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        return self.device.type != "cpu" or t in self._host

    def record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name = str(func)
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        c = self.counts
        c.ops[name] += 1
        # an op reads the host only when every tensor it touches is a host tensor (for a factory
        # op with no tensor input: when its output is one)
        host_in = all(self._is_host(t) for t in (ins or outs)) and bool(ins or outs)
        if host_in:
            for o in outs:
                self._host[o] = True
        if func.is_view:
            c.view += 1
            return
        if name.startswith(_ALLOC_ONLY):
            c.alloc += 0 if host_in else 1  # an allocation, no kernel
            return
        if name.startswith("aten._local_scalar_dense"):
            kind = "host" if host_in else "sync"
        elif name.startswith(("aten.copy_", "aten._to_copy")):
            src = ins[1] if name.startswith("aten.copy_") else ins[0]
            dst = ins[0] if name.startswith("aten.copy_") else outs[0]
            kind = "sync" if self._is_host(dst) and not self._is_host(src) else (
                "host" if host_in else "launch")
        elif name in _SYNC_SHAPE_OPS and not host_in:
            kind = "sync"
        else:
            kind = "host" if host_in else "launch"
        if kind == "launch":
            written = _written(func, args, kwargs)
            target = written[0] if written else (outs[0] if outs else None)
            if target is not None and target.numel() == 0:
                kind = "empty"
            elif not written:
                c.alloc += 1
        setattr(c, kind, getattr(c, kind) + 1)
        if kind == "sync":
            c.syncs.append(name)


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Tensors an op writes in place (``copy_``'s self, ``out=``): it allocates no output."""
    got = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                got.append(v)
    return got


@contextlib.contextmanager
def _launches(device: torch.device) -> Iterator[Any]:
    """Count Triton launches when triton can run here; otherwise count nothing."""
    from attnpool.config import triton_usable

    if not triton_usable(device):
        yield None
        return
    state = _OC.LaunchState()
    with _OC.launch_counter(state):
        yield state


def count(fn: Callable[[], object], device: torch.device,
          host: Iterable[torch.Tensor] = ()) -> Counts:
    """Counts of one call of ``fn`` (call it once before, so lazy one-time work is not counted)."""
    with _launches(device) as state:
        counter = DispatchCounter(device, host,
                                  (lambda: state.in_launch > 0) if state else (lambda: False))
        with counter:
            fn()
    if state is not None:
        counter.counts.triton = state.counts.launches
    return counter.counts


def update_counts(device: torch.device | None = None) -> list[tuple[str, str, Counts]]:
    """Counts per (case, update path) for the update cases of ``attnpool bench --quick``; the
    fused path too on CPU when the Triton interpreter can run it (counts only, never timed)."""
    from attnpool.config import triton_usable
    from attnpool.tools import bench

    dev = device or torch.device("cpu")
    rows = []
    for phase, p in (("decode", 1), ("decode", 16), ("verify", 16)):
        case = bench.UpdateCase(phase, p, bs=64, context=8192, max_bs=64)
        x = bench.make_inputs(case, dev)
        for ui in bench.UPDATE_IMPLS:
            why = ui.skip(case, dev)
            if why is not None and not (why == bench.INTERPRET_ONLY and triton_usable(dev)):
                continue
            fn = ui.prepare(case, x, dev)
            fn()
            rows.append((case.name, ui.name, count(fn, dev, host=[x.seq_lens_cpu])))
    return rows


#: Per-phase cases: (name, config overrides, update_ call of the phase).
PHASES: tuple[tuple[str, dict[str, Any], Callable[..., object]], ...] = (
    ("decode", {}, lambda pool, bs, x: pool.decode.update_(bs, seq_lens=x.seq, req_pool_indices=x.rpi,
                                                           req_to_token=x.table)),
    ("verify chain N=4", {"num_draft_tokens": 4},
     lambda pool, bs, x: pool.verify.update_(bs, seq_lens=x.seq, req_pool_indices=x.rpi,
                                             req_to_token=x.table)),
    ("verify tree N=4", {"num_draft_tokens": 4, "topk": 2},
     lambda pool, bs, x: pool.verify.update_(bs, seq_lens=x.seq, req_pool_indices=x.rpi,
                                             req_to_token=x.table, tree_mask=x.mask)),
    ("draft chain S=3", {"spec_steps": 3},
     lambda pool, bs, x: pool.draft.update_(bs, seq_lens=x.seq, req_pool_indices=x.rpi,
                                            req_to_token=x.table)),
    ("draft tree S=3 K=2", {"spec_steps": 3, "topk": 2},
     lambda pool, bs, x: pool.draft.update_(bs, seq_lens=x.seq, req_pool_indices=x.rpi,
                                            req_to_token=x.table, out_cache_loc=x.loc)),
    ("draft extend N=4", {"num_draft_tokens": 4},
     lambda pool, bs, x: pool.draft_extend.update_(bs, seq_lens=x.seq, accept_lens=x.acc,
                                                   req_pool_indices=x.rpi, req_to_token=x.table)),
    ("encoder + decoder", {"max_encoder_len": 1024},
     lambda pool, bs, x: pool.encoder.update_(bs, seq_lens=x.seq, encoder_lens=x.enc,
                                              req_pool_indices=x.rpi, req_to_token=x.table)),
    ("local (decode)", {"attention_chunk_size": 1024},
     lambda pool, bs, x: pool.local.update_(bs, seq_lens=x.seq, req_pool_indices=x.rpi,
                                            req_to_token=x.table)),
)


@dataclass
class PhaseInputs:
    seq: torch.Tensor
    rpi: torch.Tensor
    table: torch.Tensor
    mask: torch.Tensor
    loc: torch.Tensor
    acc: torch.Tensor
    enc: torch.Tensor


def phase_counts(device: torch.device | None = None, bs: int = 64, n: int = 56,
                 context: int = 8192) -> list[tuple[str, str, Counts]]:
    """Counts of one update per phase and path (static form: no host copies), page size 16."""
    from attnpool import BufferPool, Impl, PoolConfig
    from attnpool.config import resolve_impl, triton_usable

    dev = device or torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    slots = 2 * bs
    table = torch.randperm(slots * context, generator=g).view(slots, context).to(torch.int32)
    x = PhaseInputs(
        seq=torch.randint(1, context - 1100, (n,), generator=g).to(dev),
        rpi=torch.randperm(slots, generator=g)[:n].to(dev), table=table.to(dev),
        mask=(torch.rand(n, 4, 4, generator=g) < 0.5).logical_or_(torch.eye(4, dtype=torch.bool))
        .to(dev),
        loc=torch.randint(0, 10**6, (n, 3, 2), generator=g).to(dev),
        acc=torch.randint(1, 5, (n,), generator=g).to(dev),
        enc=torch.randint(1, 1025, (n,), generator=g).to(dev))
    impls = [Impl.REFERENCE] + ([Impl.TRITON] if triton_usable(dev) else [])
    rows = []
    for name, kw, call in PHASES:
        for impl in impls:
            cfg = PoolConfig(max_bs=bs, max_context_len=context, page_size=16, device=dev,
                             impl=impl, **kw)
            pool = BufferPool(cfg)
            assert resolve_impl(impl, dev) is impl
            call(pool, bs, x)  # compiles the kernels once, as an engine does before capture
            rows.append((name, f"attnpool-{impl.value}",
                         count(lambda pool=pool, call=call: call(pool, bs, x), dev)))
    return rows


def _table(rows: list[tuple[str, str, Counts]]) -> None:
    print("| case | path | Triton launches | aten launches | empty | views | temporaries "
          "| host syncs | host-only ops |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, impl, c in rows:
        print(f"| {case} | {impl} | {c.triton} | {c.launch} | {c.empty} | {c.view} | {c.alloc} "
              f"| {c.sync} | {c.host} |")


def main() -> None:
    from attnpool.tools import bench

    dev = bench.device_of("auto")
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are compiled
    print(f"torch {torch.__version__} on {dev}; bs 64 with 56 real rows (8 padded), context 8192\n")
    rows = update_counts(dev)
    _table(rows)
    print()
    for case, impl, c in rows:
        ops = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(c.ops.items()))
        print(f"- {case} {impl}: {ops}")
    print("\nEvery phase, page 16, static form (no host copies):\n")
    _table(phase_counts(dev))


if __name__ == "__main__":
    main()

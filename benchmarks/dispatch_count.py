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

Run ``python benchmarks/dispatch_count.py`` for the table in BENCHMARKS.md.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_ALLOC_ONLY = ("aten.empty.", "aten.empty_strided.", "aten.new_empty.", "aten.new_empty_strided.")
_SYNC_SHAPE_OPS = {"aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
                   "aten.unique_consecutive.default"}


@dataclass
class Counts:
    launch: int = 0
    empty: int = 0
    view: int = 0
    sync: int = 0
    host: int = 0
    alloc: int = 0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    syncs: list[str] = field(default_factory=list)


class DispatchCounter(TorchDispatchMode):
    """Classify every aten op run under it (see the module docstring)."""

    def __init__(self, device: torch.device, host: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in host:
            self._host[t] = True
        self.counts = Counts()

    def _is_host(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return False
        return self.device.type != "cpu" or t in self._host

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
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
            return out
        if name.startswith(_ALLOC_ONLY):
            c.alloc += 0 if host_in else 1  # an allocation, no kernel
            return out
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
        return out


def _written(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    """Tensors an op writes in place (``copy_``'s self, ``out=``): it allocates no output."""
    got = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                got.append(v)
    return got


def count(fn: Callable[[], object], device: torch.device,
          host: Iterable[torch.Tensor] = ()) -> Counts:
    """Counts of one call of ``fn`` (call it once before, so lazy one-time work is not counted)."""
    counter = DispatchCounter(device, host)
    with counter:
        fn()
    return counter.counts


def update_counts(device: torch.device | None = None) -> list[tuple[str, str, Counts]]:
    """Counts per (case, update path) for the update cases of ``attnpool bench --quick``."""
    from attnpool import bench

    dev = device or torch.device("cpu")
    rows = []
    for phase, p in (("decode", 1), ("decode", 16), ("verify", 16)):
        case = bench.UpdateCase(phase, p, bs=64, context=8192, max_bs=64)
        x = bench.make_inputs(case, dev)
        for ui in bench.UPDATE_IMPLS:
            if ui.skip(case, dev) is not None:
                continue
            fn = ui.prepare(case, x, dev)
            fn()
            rows.append((case.name, ui.name, count(fn, dev, host=[x.seq_lens_cpu])))
    return rows


def main() -> None:
    from attnpool import bench

    dev = bench.device_of("auto")
    print(f"torch {torch.__version__} on {dev}; bs 64 with 56 real rows (8 padded), context 8192\n")
    print("| case | path | launches | empty | views | temporaries | host syncs | host-only ops |")
    print("|---|---|---|---|---|---|---|---|")
    rows = update_counts(dev)
    for case, impl, c in rows:
        print(f"| {case} | {impl} | {c.launch} | {c.empty} | {c.view} | {c.alloc} | {c.sync} "
              f"| {c.host} |")
    print()
    for case, impl, c in rows:
        ops = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(c.ops.items()))
        print(f"- {case} {impl}: {ops}")


if __name__ == "__main__":
    main()

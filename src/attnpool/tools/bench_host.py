"""``attnpool bench --host``: host cost per metadata update, in units of one small torch op.

An update's host time is a budget like its launches: the fused path replaces ~10 launches with
one, which only pays if its Python costs about as little. Every figure here is a ratio to one
*unit*, ``t.fill_(1)`` on an 8-element tensor of the pool's device, timed in the same process
and interleaved with the case: each round times a batch of the unit, then a batch of each case,
and a case's figure is the median over the rounds of its batch's ratio to the same round's
unit batch (a slow spell of a shared machine reaches both within a round; the median drops the
odd disturbed round). Every batch starts warm (one untimed call first), as the unit's does: the
heavier columns of a row run between two batches of a light one and would otherwise charge it
their cache misses, which made the light columns' figures swing by a unit or two between runs.

Columns, per phase part and batch size (``n = bs`` real rows):

* ``fused eager``: ``update_`` on the fused path with the Triton launch replaced by a no-op
  (the launch itself is the kernel library's cost; what is left is attnpool's: input checks,
  the cached launch's argument swap, the bookkeeping and the view);
* ``bound``: a :meth:`~attnpool.phases.PhaseBase.bind` update's call, launch stubbed the same
  way (on CUDA a bound call is one graph replay instead);
* ``reference``: ``update_`` on the reference path (real torch ops), given the host copy of the
  lengths as the classic replay is (so both write only the live page columns);
* ``classic``: the engine-style per-op replay (:class:`attnpool.tools.baseline.ClassicPaged`; decode
  and chain verify only).

The fused columns need triton installed; on a machine without CUDA they set
``TRITON_INTERPRET=1`` while they build their pools (nothing is interpreted: the kernels are
stubbed).
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import timeit
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Impl, Layout, Phase, PoolConfig
from ..pool import BufferPool
from .baseline import ClassicPaged

#: (label, phase attribute, topk): every part kind a pool updates
PARTS = (("decode", "decode", 1), ("verify chain", "verify", 1), ("verify tree", "verify", 2),
         ("draft chain", "draft", 1), ("draft tree", "draft", 2),
         ("draft extend", "draft_extend", 1), ("encoder", "encoder", 1), ("local", "local", 1))
BATCH_SIZES = (1, 32, 160)
CONTEXT, PAGE, DRAFT, STEPS, ENC, CHUNK = 4096, 16, 4, 3, 32, 256
COLUMNS = ("fused eager", "bound", "reference", "classic")


def config(impl: Impl, topk: int, device: torch.device) -> PoolConfig:
    return PoolConfig(max_bs=max(BATCH_SIZES), max_context_len=CONTEXT, page_size=PAGE,
                      device=device, layout=Layout.FLASH_ATTN, num_draft_tokens=DRAFT, topk=topk,
                      spec_steps=STEPS, max_encoder_len=ENC, attention_chunk_size=CHUNK,
                      impl=impl)


def inputs(cfg: PoolConfig, phase: str, bs: int, seed: int = 0) -> dict[str, Any]:
    """In-contract ``update_`` keywords for ``bs`` real rows of ``phase`` (device tensors)."""
    rng, dev = random.Random(seed), cfg.torch_device
    slots = 2 * cfg.max_bs
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(slots * cfg.max_pages, generator=g).add_(1).view(slots, cfg.max_pages)
    table = (ids.repeat_interleave(PAGE, 1) * PAGE + torch.arange(PAGE).repeat(cfg.max_pages))
    lens = [rng.randint(1, CONTEXT // 4) for _ in range(bs)]
    kw: dict[str, Any] = {
        "seq_lens": torch.tensor(lens, device=dev),
        "req_pool_indices": torch.tensor(rng.sample(range(slots), bs), device=dev),
        "req_to_token": table[:, :CONTEXT].to(torch.int32).contiguous().to(dev),
    }
    if phase == "verify" and cfg.topk > 1:  # a chain-shaped tree: each draft sees its ancestors
        kw["tree_mask"] = torch.ones(DRAFT, DRAFT, dtype=torch.bool).tril().expand(
            bs, DRAFT, DRAFT).contiguous().to(dev)
    if phase == "draft" and cfg.topk > 1:
        kw["out_cache_loc"] = torch.randint(PAGE, 1 << 20, (bs, STEPS, cfg.topk), generator=g
                                            ).to(dev)
    if phase == "draft_extend":
        kw["accept_lens"] = torch.tensor([rng.randint(1, DRAFT) for _ in range(bs)], device=dev)
    if phase == "encoder":
        kw["encoder_lens"] = torch.tensor([rng.randint(1, ENC) for _ in range(bs)], device=dev)
    if phase == "local":
        kw["for_phase"] = Phase.DECODE
    return kw


class _NoLaunch:
    """Stands in for a jit kernel: ``kernel[grid](*args, **kw)`` does nothing. It keeps the
    kernel's parameter names, so launches are assembled exactly as for the real kernel."""

    def __init__(self, kernel: object) -> None:
        self.arg_names = getattr(kernel, "arg_names", None)

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return _noop


def _noop(*args: object, **kw: object) -> None:
    return None


@contextlib.contextmanager
def stubbed_launches(device: torch.device) -> Iterator[None]:
    """Every fused kernel replaced by :class:`_NoLaunch` (restored on exit)."""
    from ..update.triton import draft_kernels, kernels, paged_kernels

    saved: list[tuple[object, str, object]] = []
    env = os.environ.get("TRITON_INTERPRET")
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # lets a CPU pool pick the (stubbed) fused path
    try:
        for mod in (kernels, paged_kernels, draft_kernels):
            for name in [n for n in dir(mod) if n.endswith("_kernel")]:
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, _NoLaunch(getattr(mod, name)))
        yield
    finally:
        for owner, attr, kernel in saved:
            setattr(owner, attr, kernel)
        if env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = env


def units(fn: Callable[[], object], device: torch.device, rounds: int = 25, number: int = 20
          ) -> float:
    """``fn``'s host time in units of ``t.fill_(1)`` (8 elements): see :func:`units_of`."""
    return units_of({"fn": fn}, device, rounds, number)["fn"]


def units_of(fns: dict[str, Callable[[], object]], device: torch.device, rounds: int = 25,
             number: int = 20) -> dict[str, float]:
    """:func:`units` of several calls, all timed in the same rounds in turn (with the unit op):
    a change of the machine's load reaches every column of a row alike, so their ratios hold.
    Each figure is the median over rounds of the call's time over that round's unit."""
    t = torch.zeros(8, device=device)  # ok: the unit op's operand, once per case
    calls: dict[str, int] = {}
    for k, fn in fns.items():
        fn()  # first call: builds caches / compiles; not what a step costs
        # Calls per timed batch: at least ``number``, and enough for the batch to last about
        # half a millisecond, so the cold first call after another column's (much larger)
        # work is amortised alike for a cheap column and an expensive one.
        once = timeit.timeit(fn, number=5) / 5
        calls[k] = max(number, min(1000, int(5e-4 / max(once, 1e-9))))
    us: list[float] = []
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        us.append(timeit.timeit(lambda: t.fill_(1), number=number * 10) / (number * 10))
        for k, fn in fns.items():
            fn()  # untimed: the batch starts warm, as the unit's does (module docstring)
            ts[k].append(timeit.timeit(fn, number=calls[k]) / calls[k])
    return {k: statistics.median(case / unit for case, unit in zip(v, us, strict=True))
            for k, v in ts.items()}


@dataclass(frozen=True)
class Row:
    part: str
    bs: int
    cost: dict[str, float | None]  # column -> units (None: not applicable here)


def _case(label: str, phase: str, topk: int, bs: int, column: str, device: torch.device
          ) -> Callable[[], object] | None:
    if column == "classic":
        if label not in ("decode", "verify chain"):
            return None
        cfg = config(Impl.REFERENCE, 1, device)
        kw = inputs(cfg, "decode", bs)
        c = ClassicPaged(cfg, num_draft_tokens=DRAFT if phase == "verify" else 0)
        host = kw["seq_lens"].cpu()
        return lambda: c.replay(bs, kw["seq_lens"], kw["req_pool_indices"], kw["req_to_token"],
                                host)
    impl = Impl.REFERENCE if column == "reference" else Impl.TRITON
    cfg = config(impl, topk, device)
    pool = BufferPool(cfg)
    kw = inputs(cfg, phase, bs)
    ph = getattr(pool, phase)
    if column == "bound":
        bound: Callable[[], object] = ph.bind(bs, **kw)
        return bound
    if column == "reference":  # with the host copy, as the classic replay has it
        kw["seq_lens_cpu"] = kw["seq_lens"].tolist()
    return lambda: ph.update_(bs, **kw)


def run(device: torch.device, triton: bool, batch_sizes: tuple[int, ...] = BATCH_SIZES
        ) -> list[Row]:
    """Every part x batch size x column (fused columns only when ``triton``)."""
    rows = []
    for label, phase, topk in PARTS:
        for bs in batch_sizes:
            # Every column of a row is timed in the same rounds (units_of). The stubs only
            # replace the fused kernels; the reference and classic columns never launch one.
            with stubbed_launches(device) if triton else contextlib.nullcontext():
                fns = {col: fn for col in COLUMNS
                       if (triton or col not in ("fused eager", "bound"))
                       and (fn := _case(label, phase, topk, bs, col, device)) is not None}
                got = units_of(fns, device)
            rows.append(Row(label, bs, {col: got.get(col) for col in COLUMNS}))
    return rows


def table(rows: list[Row]) -> str:
    """Markdown table of the units, with reference / classic where both exist."""
    head = ["part", "bs", *COLUMNS, "reference / classic"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [f"{r.cost[c]:.1f}" if r.cost[c] is not None else "-" for c in COLUMNS]
        ref, cl = r.cost["reference"], r.cost["classic"]
        ratio = f"{ref / cl:.2f}" if ref is not None and cl is not None else "-"
        out.append("| " + " | ".join([r.part, str(r.bs), *cells, ratio]) + " |")
    return "\n".join(out)



def run_cli(device: torch.device, quick: bool) -> int:
    """``attnpool bench --host``: print the table (``--quick``: bs 1 and 32 only)."""
    import importlib.util

    triton = importlib.util.find_spec("triton") is not None
    rows = run(device, triton, BATCH_SIZES[:2] if quick else BATCH_SIZES)
    print(f"host cost per update, in units of one t.fill_(1) on {device} (launches stubbed)")
    print(table(rows))
    if not triton:
        print("fused columns skipped: triton is not installed")
    return 0

"""One ``torch.empty`` byte arena, its layout plan, and typed slices into it.

The plan is pure arithmetic on the config (``attnpool plan`` prints it without allocating). The
arena makes exactly one allocation, ``torch.empty(nbytes, dtype=uint8)``: no per-buffer tensors
and no memset. Safety comes from the update contract (every update writes its whole read region),
not from zeros. Buffers start on 256-byte boundaries (what CUDA allocations guarantee, and enough for
vectorised kernel loads).

Overlay (docs/design.md, Overlay): decode, verify, draft and draft extend never run in the same
forward, so their buffers start at the same arena offset; the arena is sized by the largest of them.
Constants (``Region.SHARED``) and the parts used in the same forward as an overlaid phase (encoder,
local) never overlap anything. Because overlaid phases clobber each other, the arena tracks which
phase last wrote the overlay (:meth:`Arena.valid_rows`), so a view handed out for capture is
re-padded when another phase wrote there since.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .config import OVERLAID_PHASES, PHASE_FACTS, Phase, PoolConfig, align
from .errors import LayoutError
from .specs import BufferSpec, Pad, Region, Shape, specs_for


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one buffer lives: ``arena[offset : offset + nbytes]`` viewed as ``dtype`` ``shape``."""

    spec: BufferSpec
    shape: Shape
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ArenaPlan:
    """The byte layout of a pool, computed from the config alone.

    Attributes:
        cfg: the config it was planned for.
        placements: one per buffer, in table order.
        nbytes: the arena size, overlay applied (the single allocation).
        separate_nbytes: what the same buffers take allocated one by one (no overlay).
    """

    cfg: PoolConfig
    placements: tuple[Placement, ...]
    nbytes: int
    separate_nbytes: int

    def phase_nbytes(self) -> dict[str, int]:
        """Aligned bytes per phase ("shared" for constants)."""
        out: dict[str, int] = {}
        for p in self.placements:
            k = p.spec.phase.value if p.spec.phase else "shared"
            out[k] = out.get(k, 0) + align(p.nbytes)
        return out

    def as_dict(self) -> dict[str, object]:
        """A JSON-able form (``attnpool plan --json``)."""
        return {
            "nbytes": self.nbytes,
            "separate_nbytes": self.separate_nbytes,
            "phases": self.phase_nbytes(),
            "buffers": [
                {
                    "phase": p.spec.phase.value if p.spec.phase else "shared",
                    "name": p.spec.name,
                    "shape": list(p.shape),
                    "dtype": str(p.spec.dtype).removeprefix("torch."),
                    "pad": p.spec.pad.value,
                    "region": p.spec.region.value,
                    "offset": p.offset,
                    "nbytes": p.nbytes,
                }
                for p in self.placements
            ],
        }

    def report(self) -> str:
        """A per-buffer table with per-phase and overlaid-vs-separate totals."""
        rows = [("phase", "buffer", "shape", "dtype", "pad", "region", "bytes")]
        for p in self.placements:
            rows.append((
                p.spec.phase.value if p.spec.phase else "shared",
                p.spec.name,
                "x".join(map(str, p.shape)),
                str(p.spec.dtype).removeprefix("torch."),
                p.spec.pad.value,
                p.spec.region.value,
                _fmt_bytes(p.nbytes),
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                 for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append("")
        for k, v in self.phase_nbytes().items():
            lines.append(f"{k:>14}: {_fmt_bytes(v)}")
        saved = 1 - self.nbytes / self.separate_nbytes if self.separate_nbytes else 0.0
        lines.append(f"{'overlaid':>14}: {_fmt_bytes(self.nbytes)}  (one allocation)")
        lines.append(f"{'separate':>14}: {_fmt_bytes(self.separate_nbytes)}  "
                     f"(overlay saves {saved:.1%})")
        return "\n".join(lines)


def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def plan_arena(cfg: PoolConfig) -> ArenaPlan:
    """Lay out every buffer ``cfg`` needs: non-overlaid regions first, then the shared overlay."""
    specs = specs_for(cfg)
    placements: dict[tuple[Phase | None, str], Placement] = {}
    offset = 0
    for s in specs:
        if s.region is not Region.OVERLAY:
            shape = s.shape(cfg)
            nbytes = _numel(shape) * s.dtype.itemsize
            placements[s.key] = Placement(s, shape, offset, nbytes)
            offset += align(nbytes)
    base = offset
    top = base
    for phase in Phase:
        if phase not in OVERLAID_PHASES:
            continue
        at = base
        for s in specs:
            if s.phase is phase:
                shape = s.shape(cfg)
                nbytes = _numel(shape) * s.dtype.itemsize
                placements[s.key] = Placement(s, shape, at, nbytes)
                at += align(nbytes)
        top = max(top, at)
    ordered = tuple(placements[s.key] for s in specs)
    separate = sum(align(p.nbytes) for p in ordered)
    return ArenaPlan(cfg, ordered, top, separate)


class Arena:
    """The pool's storage: one uint8 tensor and a typed, aligned slice per buffer.

    ``data_ptr()`` of every slice is fixed for the arena's life (graphs bake addresses): nothing
    here ever reallocates.
    """

    __slots__ = ("_bufs", "_gens", "_own", "cfg", "plan", "recorded", "storage")

    def __init__(self, cfg: PoolConfig, poison: bool = False) -> None:
        self.cfg = cfg
        self.plan = plan_arena(cfg)
        # The one allocation of the pool. torch.empty: no memset (see the module docstring).
        self.storage = torch.empty(self.plan.nbytes, dtype=torch.uint8, device=cfg.torch_device)
        self._bufs: dict[tuple[Phase | None, str], torch.Tensor] = {}
        for p in self.plan.placements:
            flat = self.storage[p.offset : p.offset + p.nbytes].view(p.spec.dtype)
            self._bufs[p.spec.key] = flat.view(p.shape)
        #: per region (the overlay, or a phase that is not overlaid): the last write's
        #: ``(phase, generation, rows)``; absent: nothing valid there (see :meth:`mark_written`).
        self._own: dict[object, tuple[Phase, int, int]] = {}
        #: the generations: a new one for every write through this arena (updates, capture
        #: states, poison); a counter object, which the host lane's C step advances too
        #: (``host_lane.c``'s ``mark``, the same record as :meth:`mark`)
        self._gens = itertools.count(1)
        #: set once an update ran in capturable mode (``num_real``): the engine may replay it from
        #: its own graph, writing bytes behind this bookkeeping, so epochs prove nothing after.
        self.recorded = False
        if poison:
            self.poison_()
        else:
            self._write_constants()

    # ---- lookup --------------------------------------------------------------------------------
    def buffer(self, phase: Phase | None, name: str) -> torch.Tensor:
        """The full-size buffer ``(phase, name)``; raises :class:`LayoutError` if not planned."""
        try:
            return self._bufs[(phase, name)]
        except KeyError:
            where = phase.value if phase else "shared"
            raise LayoutError(
                f"buffer {where}.{name} is not in this pool (layout={self.cfg.layout}); "
                f"present: {sorted(n for p, n in self._bufs if p is phase)}"
            ) from None

    def maybe(self, phase: Phase | None, name: str) -> torch.Tensor | None:
        """The buffer, or None when the config's layout/phase does not need it."""
        return self._bufs.get((phase, name))

    def buffers(self) -> dict[tuple[Phase | None, str], torch.Tensor]:
        return dict(self._bufs)

    # ---- overlay bookkeeping -------------------------------------------------------------------
    def valid_rows(self, phase: Phase) -> int:
        """Rows of ``phase`` whose read region is valid now (0: must be (re)written first)."""
        rows = -1
        for r in _REGIONS[phase]:
            o = self._own.get(r)
            if o is None or o[0] is not phase:
                return 0
            rows = o[2] if rows < 0 else min(rows, o[2])
        return rows

    def mark_written(self, phase: Phase, rows: int) -> None:
        """Record that ``phase`` just wrote its read region for ``rows`` rows.

        Overlaid phases share one region: writing one invalidates every other. The encoder
        phase writes its own region and, for its decoder rows, the decode phase's buffers in the
        overlay, so it takes both. A dict store per region: the bookkeeping costs next to
        nothing per update.
        """
        self.mark(_REGIONS[phase], phase, rows)

    def regions(self, phase: Phase) -> tuple[object, ...]:
        """The regions ``phase``'s updates write (for :meth:`mark`)."""
        return _REGIONS[phase]

    def mark(self, regions: tuple[object, ...], phase: Phase, rows: int) -> None:
        """:meth:`mark_written` with ``phase``'s :meth:`regions` looked up once by the caller
        (the per-update path)."""
        rec = (phase, next(self._gens), rows)
        for r in regions:
            self._own[r] = rec

    def mark_state(self) -> tuple[dict[object, tuple[Phase, int, int]], Iterator[int]]:
        """The owners of the regions and the generation counter, for a native step that
        records its write itself (``host_lane.c``'s ``mark``: :meth:`mark`'s record, the same
        counter advanced); both objects live as long as the arena."""
        return self._own, self._gens

    def holds(self, phase: Phase) -> bool:
        """True while every region ``phase`` writes holds ``phase``'s last write."""
        for r in _REGIONS[phase]:
            o = self._own.get(r)
            if o is None or o[0] is not phase:
                return False
        return True

    def owner(self, phase: Phase) -> Phase | None:
        """The phase whose write the bytes ``phase``'s views read hold now: ``phase`` itself, or
        the phase that wrote over one of its regions since, or None when nothing valid is there
        (never written, or poisoned since)."""
        for r in _REGIONS[phase]:  # the first region ``phase`` no longer holds, if any
            o = self._own.get(r)
            if o is None or o[0] is not phase:
                return None if o is None else o[0]
        return phase

    def stamp(self, phase: Phase) -> RegionStamp:
        """The :class:`attnpool.views.Stamp` of views ``phase`` hands out."""
        return RegionStamp(self, phase)

    def epoch(self, phase: Phase) -> int:
        """A value that changes whenever ``phase``'s bytes may have been written.

        A phase that reuses what its previous update left (the incremental page table) compares
        the epoch right after that update with the epoch now: equal means no other phase, capture
        state or poison wrote those bytes in between through this arena's calls (each such write
        takes a new generation; bytes another phase owns read ``-1``). Writes replayed from an
        engine's own graph bypass it; see :attr:`recorded`.
        """
        return self._own[_REGIONS[phase][0]][1] if self.holds(phase) else -1

    # ---- poison --------------------------------------------------------------------------------
    def poison_(self) -> None:
        """Fill every buffer with its sentinel (int max, float NaN), then rewrite the constants.

        After this no phase is valid: the next ``view`` re-pads and the next update rewrites, and a
        checker finds any element of a read region that they failed to write.
        """
        self.storage.fill_(0xFF)
        for (_, _), buf in self._bufs.items():
            buf.fill_(sentinel(buf.dtype))
        self._own.clear()
        next(self._gens)
        self._write_constants()

    def _write_constants(self) -> None:
        for p in self.plan.placements:
            s = p.spec
            if s.pad is Pad.CONST and s.const_step is not None:
                buf = self._bufs[s.key]
                step = s.const_step(self.cfg)
                torch.arange(0, buf.numel() * step, step, out=buf)


#: the regions each phase's update writes: the shared overlay, or the phase's own; the encoder
#: also writes the decode phase's buffers (its decoder rows), which live in the overlay
#: the regions each phase writes, keyed by name: a string hashes in C, an enum member through
#: ``Enum.__hash__`` in Python, and every update marks its regions
_REGIONS: dict[Phase, tuple[object, ...]] = {
    p: ("overlay",) if f.overlaid else (p.value, "overlay") if f.writes_decode else (p.value,)
    for p, f in PHASE_FACTS.items()
}


class RegionStamp:
    """A view's producer (:class:`attnpool.views.Stamp`): ``phase`` of one arena. Current while
    every region the phase writes still holds that phase's last write."""

    __slots__ = ("arena", "phase")

    def __init__(self, arena: Arena, phase: Phase) -> None:
        self.arena, self.phase = arena, phase

    def current(self) -> bool:
        return self.arena.holds(self.phase)

    def describe(self) -> str:
        owner = self.arena.owner(self.phase)
        now = "nothing valid (poisoned or never written)" if owner is None else (
            f"the {owner.value} phase's last write")
        return f"a view of the {self.phase.value} phase, but its bytes now hold {now}"


def sentinel(dtype: torch.dtype) -> int | float:
    """The poison value of a dtype: its max for integers, NaN for floats."""
    if dtype.is_floating_point:
        return float("nan")
    if dtype == torch.bool:
        return True
    return int(torch.iinfo(dtype).max)

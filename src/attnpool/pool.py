"""``BufferPool``: one arena for every attention-metadata buffer, and the phases over it.

Create one per model runner at init. Updates and graph replays must be issued on the same CUDA
stream (or ordered by the caller with events): overlaid phases share bytes and the pool relies on
stream order, not on locks, for an update to land before the replay that reads it.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar, cast, overload

from .arena import Arena, ArenaPlan
from .check import check_view
from .config import PHASE_FACTS, Phase, PoolConfig
from .errors import InputError, MissingPhaseError, PoolError, StaleViewError
from .phases import (
    PHASE_TYPES,
    DecodePhase,
    DraftExtendPhase,
    DraftPhase,
    EncoderPhase,
    ExtendPhase,
    LocalPhase,
    PhaseBase,
    VerifyPhase,
)

P = TypeVar("P", bound=PhaseBase[Any])


class _PhaseAttr(Generic[P]):
    """A typed ``pool.<phase>`` attribute: :meth:`BufferPool.phase` cast to the phase's class
    (a missing phase raises :class:`MissingPhaseError` naming the setting that enables it)."""

    def __init__(self, phase: Phase, cls: type[P], doc: str) -> None:
        self.phase, self.cls, self.__doc__ = phase, cls, doc

    @overload
    def __get__(self, pool: None, owner: type[Any]) -> _PhaseAttr[P]: ...

    @overload
    def __get__(self, pool: BufferPool, owner: type[Any]) -> P: ...

    def __get__(self, pool: BufferPool | None, owner: type[Any]) -> _PhaseAttr[P] | P:
        if pool is None:
            return self
        return cast(P, pool.phase(self.phase))


class BufferPool:
    """Every CUDA-graph attention-metadata tensor of an engine, in one ``torch.empty``.

    Args:
        cfg: sizes and options (:class:`PoolConfig`).
        poison: fill the arena with sentinels (int max / NaN) so :meth:`check` catches any element
            a kernel may read that no update wrote. For tests and debugging.
        validate: debug mode: every update reads its device inputs back (one host read, a sync
            on CUDA) and rejects, before any write, what the fast path cannot see: lengths out
            of range, ``req_pool_indices`` outside the request table (``req_to_token`` or
            ``block_table``), host copies that disagree with the device values, a tree mask
            without its diagonal. Off by default (see :mod:`attnpool.phases._validate`).
    """

    def __init__(self, cfg: PoolConfig, poison: bool = False, validate: bool = False) -> None:
        if not isinstance(cfg, PoolConfig):
            raise PoolError(f"BufferPool expects a PoolConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.poisoned = poison
        self.arena = Arena(cfg, poison=poison)
        #: only the phases the config enables exist
        self._phases: dict[Phase, PhaseBase[Any]] = {p: PHASE_TYPES[p](self.arena) for p in cfg.phases}
        for ph in self._phases.values():
            ph.validate = bool(validate)

    # ---- phases --------------------------------------------------------------------------------
    def phase(self, phase: Phase | str) -> PhaseBase[Any]:
        """The phase object for ``phase`` (a :class:`Phase` or its value, e.g. ``"decode"``);
        :class:`MissingPhaseError` if the config lacks it."""
        if not isinstance(phase, Phase):
            names = [p.value for p in Phase]
            if not (isinstance(phase, str) and phase in names):
                got = repr(phase) if isinstance(phase, str) else type(phase).__name__
                raise InputError(f"phase must be a Phase or one of {names}, got {got}")
            phase = Phase(phase)
        try:
            return self._phases[phase]
        except KeyError:
            hint = PHASE_FACTS[phase].needs
            raise MissingPhaseError(
                f"this pool has no {phase.value} phase (needs {hint}); "
                f"enabled: {[p.value for p in self._phases]}"
            ) from None

    decode = _PhaseAttr(Phase.DECODE, DecodePhase, "Decode views and updates (always present).")
    verify = _PhaseAttr(Phase.VERIFY, VerifyPhase, "Target verify (needs num_draft_tokens > 0).")
    draft = _PhaseAttr(Phase.DRAFT, DraftPhase,
                       "Draft decode steps of a speculative round (needs spec_steps > 0).")
    draft_extend = _PhaseAttr(Phase.DRAFT_EXTEND, DraftExtendPhase,
                              "Draft extend (needs num_draft_tokens > 0).")
    encoder = _PhaseAttr(Phase.ENCODER, EncoderPhase,
                         "Encoder-decoder cross-attention (needs max_encoder_len > 0).")
    local = _PhaseAttr(Phase.LOCAL, LocalPhase,
                       "Chunked local attention (needs attention_chunk_size).")
    extend = _PhaseAttr(Phase.EXTEND, ExtendPhase,
                        "Prefill with a cached prefix (needs max_extend_tokens > 0).")

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(self._phases)

    # ---- memory --------------------------------------------------------------------------------
    @property
    def plan(self) -> ArenaPlan:
        return self.arena.plan

    @property
    def nbytes(self) -> int:
        """Bytes of the single arena allocation (overlay applied)."""
        return self.arena.plan.nbytes

    def report(self) -> str:
        """Per-buffer table (phase, name, shape, dtype, pad rule, bytes) with overlaid vs separate
        totals."""
        return self.arena.plan.report()

    # ---- poison --------------------------------------------------------------------------------
    def poison_(self) -> None:
        """Refill the arena with sentinels; every phase must be re-viewed or updated before use."""
        self.arena.poison_()

    def check(self, view: object) -> None:
        """Raise :class:`attnpool.StaleViewError` if another phase (or poison) wrote ``view``'s
        bytes since the write that produced it, else :class:`attnpool.ReadRegionError` if its read
        region is not valid (a device read: a debugging aid, not for the hot path)."""
        stamp = getattr(view, "stamp", None)
        if stamp is not None and not stamp.current():
            raise StaleViewError(f"{type(view).__name__} is stale: {stamp.describe()}; take a "
                                 "new view (view() / update_()) after another phase has run")
        check_view(view, num_pages=self.cfg.num_pages, page_size=self.cfg.page_size)

    def owner(self, phase: Phase | str) -> Phase | None:
        """Which phase's write the bytes ``phase``'s views read hold now (None: nothing valid,
        e.g. after ``poison_``). Overlaid phases share bytes: after ``pool.draft.update_``,
        ``pool.owner(Phase.DECODE)`` is ``Phase.DRAFT``. Host bookkeeping, no device access."""
        return self.arena.owner(self.phase(phase).phase)

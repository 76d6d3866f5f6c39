"""A phase's assembled parts, per batch shape, replayed with each update's value record.

A phase declares its parts once (one ``*_launch`` of its update path per part, built from a value
record); the first update of a batch shape builds and checks them, and every later update of the
shape only swaps its inputs into the cached arguments (:class:`.paths.Replay`). The key is
the phase's: bs, the request table's kind and shape and which optional inputs are given (the kind
must be part of it, as one 2-D shape may be either kind).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from .paths import Replay

#: a batch shape's per-update calls (each part's :attr:`.paths.Replay.replay`), in part order
Plan = tuple[Callable[[tuple[Any, ...]], None], ...]


class LaunchCache(dict[Hashable, Plan]):
    """Plans per key (a dict: a hit is one lookup), bounded: past ``limit`` keys (a new table
    shape per call, say) it starts over. ``parts`` keeps each key's parts themselves (a bound
    update fixes their values). While ``recording`` is a list (a bound update is being built),
    every run also appends its launches with the values fixed."""

    __slots__ = ("limit", "parts", "recording")

    def __init__(self, limit: int = 1024) -> None:
        super().__init__()
        self.limit = limit
        self.parts: dict[Hashable, tuple[Replay, ...]] = {}
        self.recording: list[Callable[[], object]] | None = None

    def add(self, key: Hashable, parts: Sequence[Replay], values: tuple[Any, ...],
            aliases: Sequence[dict[str, str]] = ()) -> Plan:
        """Cache ``parts`` (just built from ``values``) under ``key``, each reading its inputs
        from records shaped like ``values`` (``aliases``: per part, input -> record name where
        the two differ)."""
        if len(self) >= self.limit:
            self.clear()
            self.parts.clear()
        aliases = (*aliases, *({},) * (len(parts) - len(aliases)))
        taken = self.parts[key] = tuple(
            part.take(values, **alias) for part, alias in zip(parts, aliases, strict=True))
        plan = self[key] = tuple(part.replay for part in taken)
        return plan

    def record(self, key: Hashable, values: tuple[Any, ...]) -> None:
        """While a bound update is being built: keep the launches of ``key`` with ``values``
        fixed (each part replays as ``part.replay(values)``; the caller runs them)."""
        if self.recording is not None:
            self.recording.extend(part.bound(values) for part in self.parts[key])

"""One module per phase; each exposes ``view(bs)`` and ``update_(...)`` over the pool's arena."""

from .base import PhaseBase
from .decode import DecodePhase

__all__ = ["DecodePhase", "PhaseBase"]

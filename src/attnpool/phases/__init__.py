"""One module per phase; each exposes ``view(bs)`` and ``update_(...)`` over the pool's arena."""

from .base import PhaseBase
from .bound import BoundUpdate
from .decode import DecodePhase
from .draft import DraftPhase
from .draft_extend import DraftExtendPhase
from .encoder import EncoderPhase
from .extend import ExtendPhase
from .local import LocalPhase
from .verify import VerifyPhase

__all__ = [
    "BoundUpdate",
    "DecodePhase",
    "DraftExtendPhase",
    "DraftPhase",
    "EncoderPhase",
    "ExtendPhase",
    "LocalPhase",
    "PhaseBase",
    "VerifyPhase",
]

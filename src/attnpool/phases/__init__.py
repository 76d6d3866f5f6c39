"""One module per phase; each exposes ``view(bs)`` and ``update_(...)`` over the pool's arena."""

from typing import Any

from ..config import Phase
from .base import PhaseBase
from .bound import BoundUpdate
from .decode import DecodePhase
from .draft import DraftPhase
from .draft_extend import DraftExtendPhase
from .encoder import EncoderPhase
from .extend import ExtendPhase
from .local import LocalPhase
from .verify import VerifyPhase

#: the class of every phase: the pool builds each enabled phase from here (a new phase adds its
#: module, its row here and its row in ``config.PHASE_FACTS``)
PHASE_TYPES: dict[Phase, type[PhaseBase[Any]]] = {
    Phase.DECODE: DecodePhase,
    Phase.VERIFY: VerifyPhase,
    Phase.DRAFT: DraftPhase,
    Phase.DRAFT_EXTEND: DraftExtendPhase,
    Phase.ENCODER: EncoderPhase,
    Phase.LOCAL: LocalPhase,
    Phase.EXTEND: ExtendPhase,
}

__all__ = [
    "PHASE_TYPES",
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

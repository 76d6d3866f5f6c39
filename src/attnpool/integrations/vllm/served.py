"""Which pool phase served a vLLM engine's steps, for a test or a demo to read (off by default),
and the verify view's negative-control hook (tests only; off by default).

vLLM runs its model runner, and so attnpool's builders, in an engine-core process of its own
unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the caller that started the engine cannot look
inside. With :data:`SERVED` set to a path, each process keeps one small file
``<path>.<pid>``, memory-mapped once, of one int64 count per :class:`Kind` (the refills of each
phase, every KV-cache group of the process together), so counting a refill is one store and
:func:`read` sums every process's file.

:data:`CORRUPT_VERIFY` set to ``1`` makes every verify refill shorten its first row's
``cache_seqlens`` by one after the update (attention then drops a key of that request): the
check that the verify view is what attention reads. Never set it outside a test.

Plain Python and numpy: nothing here imports vLLM.
"""

from __future__ import annotations

import enum
import os
from typing import Any, ClassVar

#: set to a path: each engine process counts its refills per phase in ``<path>.<pid>``
SERVED = "ATTNPOOL_VLLM_SERVED"
#: ``1``: corrupt every verify refill (negative control of the tests; see the module doc)
CORRUPT_VERIFY = "ATTNPOOL_VLLM_CORRUPT_VERIFY"


class Kind(enum.IntEnum):
    """A refill's phase: the index of its count in a :class:`Counts` file."""

    DECODE = 0
    EXTEND = 1
    VERIFY = 2


class Counts:
    """One process's refill counts, in the file ``<path>.<pid>`` (see the module doc); one
    object per path and process (:meth:`of`), shared by its builders."""

    _open: ClassVar[dict[str, Counts]] = {}

    def __init__(self, path: str) -> None:
        import numpy as np

        self.counts: Any = np.memmap(f"{path}.{os.getpid()}", dtype=np.int64, mode="w+",
                                     shape=(len(Kind),))
        self.counts[:] = 0

    @classmethod
    def of(cls, path: str) -> Counts:
        """This process's counts at ``path`` (made at the first call)."""
        got = cls._open.get(path)
        if got is None:
            got = cls._open[path] = cls(path)
        return got

    def count(self, kind: Kind) -> None:
        self.counts[kind] += 1


def counts_from_env() -> Counts | None:
    """The process's :class:`Counts` when :data:`SERVED` is set, else None (nothing counted)."""
    path = os.environ.get(SERVED, "").strip()
    return Counts.of(path) if path else None


def corrupting() -> bool:
    """Whether :data:`CORRUPT_VERIFY` is ``1`` in this process's environment."""
    return os.environ.get(CORRUPT_VERIFY, "0").strip() == "1"


def read(path: str) -> dict[Kind, int]:
    """The counts of every process that wrote a ``<path>.<pid>`` file, summed per phase."""
    import glob

    import numpy as np

    total = dict.fromkeys(Kind, 0)
    for name in glob.glob(f"{glob.escape(path)}.*"):
        got = np.fromfile(name, dtype=np.int64)
        for kind in Kind:
            if kind < got.shape[0]:
                total[kind] += int(got[kind])
    return total

"""What one SGLang engine process's pools served, counted for another process to read.

SGLang runs its scheduler (and so attnpool's backend) in a spawned process, where the caller
that started the engine cannot look; with :data:`REPORT` set, each backend counts its refills
in a small file that caller reads afterwards (the tests' proof that the pool served a run,
and ``examples/sglang_smollm2.py``'s). Plain Python and numpy: no SGLang import.
"""

from __future__ import annotations

import os
from typing import ClassVar

#: set to a path: each engine process writes its refill counts to ``<path>.<pid>`` (see
#: :class:`Served`); off by default (nothing is counted)
REPORT = "ATTNPOOL_SGLANG_REPORT"


class Served:
    """One process's refill counts, int64 in a file memory-mapped once, so a refill costs one
    store (only when :data:`REPORT` is set). The backends of one process (a target's and its
    draft's) share the file (:meth:`of`).

    The counters, in file order: decode refills, extend refills, the pools' bytes, then
    speculative decoding's verify refills, draft rounds (one ``pool.draft`` refill each) and
    draft extend refills, then an encoder-decoder model's ``pool.encoder`` refills (decode
    and extend batches with encoder rows: :mod:`.cross`). A reader sums whatever length a file
    has (:meth:`read_all`), so a file written with fewer counters reads as zeros past its end.
    """

    #: the counters' indices
    DECODE, EXTEND, BYTES, VERIFY, DRAFT, DRAFT_EXTEND, ENCODER = range(7)
    #: how many counters a file holds
    KINDS = 7
    _open: ClassVar[dict[str, Served]] = {}

    def __init__(self, path: str, nbytes: int) -> None:
        import numpy as np

        self.counts = np.memmap(f"{path}.{os.getpid()}", dtype=np.int64, mode="w+",
                                shape=(self.KINDS,))
        self.counts[:] = 0
        self.counts[self.BYTES] = nbytes
        self.counts.flush()

    @classmethod
    def of(cls, path: str, nbytes: int) -> Served:
        """This process's counter file at ``path``, its pools' bytes grown by ``nbytes``."""
        got = cls._open.get(path)
        if got is None:
            got = cls._open[path] = cls(path, nbytes)
        else:
            got.counts[cls.BYTES] += nbytes
        return got

    def count(self, kind: int) -> None:
        self.counts[kind] += 1

    @staticmethod
    def read(path: str) -> tuple[int, int, int]:
        """The counts of every process that wrote ``<path>.<pid>`` files, summed: (decode
        refills, extend refills, the pools' bytes)."""
        got = Served.read_all(path)
        return got[0], got[1], got[2]

    @staticmethod
    def read_all(path: str) -> tuple[int, ...]:
        """All counts (the class doc's order), summed over the processes."""
        import glob

        import numpy as np

        total = [0] * Served.KINDS
        for name in glob.glob(f"{glob.escape(path)}.*"):
            got = np.fromfile(name, dtype=np.int64, count=Served.KINDS)
            for i in range(min(Served.KINDS, got.shape[0])):
                total[i] += int(got[i])
        return tuple(total)

"""The host route: an engine's step on a CPU pool written by one C call (``host_lane.c``).

Why a C step: an engine's metadata build on a CPU runs between two forwards, on caches the
forward has just evicted, so it costs what the code it walks costs there, not what its ops cost
in a loop. The general path (:mod:`attnpool.update.reference`, the oracle) walks several
dispatched torch ops per field; the C step is one call that checks every value and then writes
every field, the same bytes (``tests/update/test_host_route.py`` compares the whole arena of
both).

How it is built: at install time, by setuptools (``setup.py``, an optional extension: Python's
headers only, no torch headers, so one build per CPython serves every torch). Nothing compiles
at run time. Where the install had no C compiler, or ``ATTNPOOL_NATIVE=0`` is set, :func:`load`
returns None and every CPU step takes the general path: the same bytes, more host time. Which
route runs, and why, is logged once (logger ``attnpool``) and told by :func:`why`.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

#: set to ``0`` to keep every CPU step on the general path (the C step is not loaded)
ENV = "ATTNPOOL_NATIVE"

_state: list[ModuleType | str | None] = [None]  # the module, or why there is none
_log = logging.getLogger("attnpool")


def load() -> ModuleType | None:
    """The C step's module (loaded once per process), or None (see :func:`why`)."""
    got = _state[0]
    if got is None:
        if os.environ.get(ENV, "1") == "0":
            got = f"turned off ({ENV}=0): CPU steps take the general path"
            _log.info("attnpool host route %s", got)
        else:
            try:
                import torch  # (the route's callers hold torch already; the CLI never loads it)

                from . import _lane  # type: ignore[attr-defined]

                _lane.setup(torch.Tensor, torch.int32)
                got = _lane
            except ImportError as e:
                got = (f"not built ({e}; the install had no C compiler): CPU steps take the "
                       "general path, the same bytes with more host time per step; reinstall "
                       "attnpool where a C compiler is present to build it")
                _log.warning("attnpool host route %s", got)
        _state[0] = got
    return got if isinstance(got, ModuleType) else None


def why() -> str:
    """Whether the C step is in use, and if not why."""
    load()
    got = _state[0]
    return f"in use ({got.__file__})" if isinstance(got, ModuleType) else str(got)

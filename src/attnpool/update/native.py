"""The host lane's native step: ``host_lane.c``, compiled on first use with the system's C
compiler and loaded as a Python extension.

Why native: an engine's metadata build on a CPU runs between two forwards, on caches the
forward has just evicted, so it costs what the code it walks costs there, not what its ops
cost in a loop. The torch lane (:mod:`.reference_lean`) walks one dispatched torch op per field
(lengths, page columns, cumsum, query offsets, positions, the window part); the native step is
one call that checks every value and then writes every field, the same bytes
(``tests/update/test_host_lane.py`` compares the whole arena of both with the general path's).

How it is built: like Triton's launchers, from the C source shipped in the package, by the
compiler and flags Python itself was built with (``sysconfig``'s ``LDSHARED``), into the
``native`` folder of attnpool's cache (``$ATTNPOOL_CACHE``, else ``~/.cache/attnpool``, as
``attnpool fetch`` uses it) under a name keyed by the source and the interpreter, so a later
process loads it without compiling; a compile writes a private file and renames it into place,
so processes starting together (tensor-parallel workers) never load a half-written one. Where
there is no compiler, the build fails, or ``ATTNPOOL_NATIVE=0`` is set, :func:`load` returns
None and the torch lane runs: the same bytes, more host time. :func:`why` says which.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

#: the extension's module name (its ``PyInit_`` symbol)
NAME = "_attnpool_lane"
SOURCE = Path(__file__).with_name("host_lane.c")
#: set to ``0`` to keep the torch lane (no compile, no load)
ENV = "ATTNPOOL_NATIVE"
#: attnpool's cache folder (default ``~/.cache/attnpool``); compiled steps go to its ``native``
CACHE_ENV = "ATTNPOOL_CACHE"

_state: list[ModuleType | str | None] = [None]  # the module, or why there is none


def cache_dir() -> Path:
    """The folder compiled steps are kept in."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "attnpool") / "native"


def _target() -> Path:
    """The compiled file for this source and interpreter."""
    tag = hashlib.sha256(SOURCE.read_bytes() + sys.version.encode()
                         + str(sysconfig.get_platform()).encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / f"{NAME}_{tag}{suffix}"


def _compile(out: Path) -> None:
    """Compile :data:`SOURCE` into ``out`` (raises on failure)."""
    ldshared = sysconfig.get_config_var("LDSHARED")
    if not ldshared or sys.platform == "win32":
        raise OSError("no C toolchain recorded for this interpreter")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [*shlex.split(os.environ.get("LDSHARED", ldshared)), "-O2", "-fPIC",
           f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch  # (the lane's callers hold torch already; the CLI never loads the step)

    module.setup(torch.Tensor, torch.int32)  # what step_tensors and diffs take
    return module


def load() -> ModuleType | None:
    """The native step's module (compiled and loaded once per process), or None (see
    :func:`why`)."""
    got = _state[0]
    if got is None:
        if os.environ.get(ENV, "1") == "0":
            got = f"turned off ({ENV}=0)"
        else:
            try:
                path = _target()
                if not path.exists():
                    _compile(path)
                got = _import(path)
            except (OSError, ImportError, subprocess.SubprocessError) as e:
                got = f"not built: {e}"
        _state[0] = got
    return got if isinstance(got, ModuleType) else None


def why() -> str:
    """Whether the native step is in use, and if not why."""
    load()
    got = _state[0]
    return f"in use ({got.__file__})" if isinstance(got, ModuleType) else str(got)

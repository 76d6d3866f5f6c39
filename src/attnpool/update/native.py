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
#: the C++ tensor reader's module name and source (see :func:`_tensor_facts`)
TENSOR_NAME = "_attnpool_tensor"
TENSOR_SOURCE = Path(__file__).with_name("tensor_facts.cpp")
#: set to ``0`` to keep the torch lane (no compile, no load)
ENV = "ATTNPOOL_NATIVE"
#: set to ``0`` to build the step without the C++ tensor reader (it reads tensor attributes)
TENSOR_ENV = "ATTNPOOL_NATIVE_TENSOR"
#: attnpool's cache folder (default ``~/.cache/attnpool``); compiled steps go to its ``native``
CACHE_ENV = "ATTNPOOL_CACHE"

#: the C++ standard of the tensor reader's build (torch 2.14's headers need C++20)
_CPP_STD = "-std=c++20"

_state: list[ModuleType | str | None] = [None]  # the module, or why there is none
_tensor_state: list[str] = [""]  # how the step reads tensors (for why())


def cache_dir() -> Path:
    """The folder compiled steps are kept in."""
    root = os.environ.get(CACHE_ENV)
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "attnpool") / "native"


def _target(name: str, source: Path, extra: str = "") -> Path:
    """The compiled file of ``source`` for this interpreter (and ``extra``: torch's build)."""
    tag = hashlib.sha256(source.read_bytes() + sys.version.encode() + extra.encode()
                         + str(sysconfig.get_platform()).encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return cache_dir() / f"{name}_{tag}{suffix}"


def _compile(cmd: list[str], out: Path) -> None:
    """Run the compile command ``cmd`` (which ends by naming its output) into ``out``: the
    output goes to a private name first and is renamed into place (raises on failure)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    cmd = [*cmd, str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-400:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _c_command() -> list[str]:
    """host_lane.c's compile: Python's own C toolchain (``LDSHARED``), Python's headers."""
    ldshared = sysconfig.get_config_var("LDSHARED")
    if not ldshared or sys.platform == "win32":
        raise OSError("no C toolchain recorded for this interpreter")
    return [*shlex.split(os.environ.get("LDSHARED", ldshared)), "-O2", "-fPIC",
            f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o"]


def _cpp_command(torch_dir: Path, cxx11_abi: bool) -> list[str]:
    """tensor_facts.cpp's compile: Python's C++ compiler (``CXX``), torch's headers, linked
    against torch's libc10 (found at run time through the rpath of torch's own folder)."""
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX")
    if not cxx or sys.platform == "win32":
        raise OSError("no C++ compiler recorded for this interpreter")
    inc, lib = torch_dir / "include", torch_dir / "lib"
    return [*shlex.split(cxx), "-shared", "-O2", "-fPIC", _CPP_STD, "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{inc}",
            f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}", str(TENSOR_SOURCE),
            f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}", "-o"]


def _tensor_facts() -> object:
    """The C++ tensor reader's capsule (built on first use like the step, keyed by torch's
    version and folder too), or None: the step then reads tensor attributes. Why a second
    module: reading five attributes of two tensors through Python costs the step more than
    its writes on a cold cache, and the step's own source stays C without torch headers (it
    builds in a second; this takes half a minute, once per torch build, and a build that
    failed is recorded next to its target so that later processes do not try again)."""
    import torch

    if os.environ.get(TENSOR_ENV, "1") == "0":
        _tensor_state[0] = f"tensor attributes ({TENSOR_ENV}=0)"
        return None
    torch_dir = Path(torch.__file__).parent
    path = _target(TENSOR_NAME, TENSOR_SOURCE, f"{torch.__version__}|{torch_dir}|{_CPP_STD}")
    failed = path.with_name(path.name + ".failed")  # (a failed build is not retried per process)
    try:
        if failed.exists():
            raise OSError(f"{failed.read_text()[-400:]} (recorded in {failed}: delete it to retry)")
        if not path.exists():
            try:
                _compile(_cpp_command(torch_dir, bool(torch._C._GLIBCXX_USE_CXX11_ABI)), path)
            except (OSError, subprocess.SubprocessError) as e:
                failed.write_text(str(e))
                raise
        facts = _import(TENSOR_NAME, path).facts
    except (OSError, ImportError, AttributeError, subprocess.SubprocessError) as e:
        _tensor_state[0] = f"tensor attributes (the C++ reader is not built: {e})"
        return None
    _tensor_state[0] = f"the C++ tensor reader ({path})"
    return facts


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
                path = _target(NAME, SOURCE)
                if not path.exists():
                    _compile(_c_command(), path)
                got = _import(NAME, path)
                import torch  # (the lane's callers hold torch already; the CLI never loads it)

                got.setup(torch.Tensor, torch.int32, _tensor_facts())
            except (OSError, ImportError, subprocess.SubprocessError) as e:
                got = f"not built: {e}"
        _state[0] = got
    return got if isinstance(got, ModuleType) else None


def why() -> str:
    """Whether the native step is in use, and if not why."""
    load()
    got = _state[0]
    return (f"in use ({got.__file__}), reading tensors by {_tensor_state[0]}"
            if isinstance(got, ModuleType) else str(got))

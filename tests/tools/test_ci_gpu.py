"""``.ci/gpu`` as steps that fit the GPU machine: run on CPU with stand-ins for what needs a GPU.

The GPU machine runs one command at a time, at most 10 minutes each, without network, with
attnpool not installed. These tests run the script itself (a copy, in a temporary folder) and
check what it does: one log per step, a hard time limit per step, the offline FlashInfer install
from two wheels into a target folder, and compute-sanitizer's initcheck with the caching allocator
off for the eager workloads and on for graph replays.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "gpu"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the script in an otherwise empty checkout, and a bin/ for stand-in commands."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(SCRIPT, tmp_path / ".ci" / "gpu")
    (tmp_path / "src").mkdir()
    (tmp_path / "bin").mkdir()
    return tmp_path


def _stub(repo: Path, name: str, body: str) -> None:
    path = repo / "bin" / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {**os.environ, "PATH": f"{repo / 'bin'}:{os.environ['PATH']}", **env}
    e.pop("OUT", None)
    return subprocess.run(["bash", str(repo / ".ci" / "gpu"), *args], cwd=repo, env=e,
                          capture_output=True, text=True, timeout=300, check=False)


def test_steps_are_listed_and_unknown_ones_refused(repo: Path) -> None:
    got = _run(repo, "list")
    steps = got.stdout.split()
    assert got.returncode == 0 and "install" in steps and len(steps) >= 8
    assert {"initcheck-eager-reference", "initcheck-eager-fused", "initcheck-graphs"} <= set(steps)
    bad = _run(repo, "nope")
    assert bad.returncode == 2 and "unknown step" in bad.stderr


def test_each_step_writes_its_log_and_is_stopped_at_its_limit(repo: Path) -> None:
    _stub(repo, "compute-sanitizer", "sleep 30\n")
    got = _run(repo, "initcheck-graphs", "out", ATTNPOOL_STEP_LIMIT_S="1")
    log = (repo / "out" / "initcheck-graphs.log").read_text()
    assert got.returncode == 124 and "TIMED OUT after 1s" in log and "exit 124" in log
    script = SCRIPT.read_text()
    assert 'LIMIT_S="${ATTNPOOL_STEP_LIMIT_S:-470}"' in script  # < 8 minutes by default


def test_initcheck_allocator_settings(repo: Path) -> None:
    """Eager workloads with the caching allocator off (each tensor its own allocation); graph
    replays with it on (PyTorch refuses to capture without it)."""
    _stub(repo, "compute-sanitizer",
          'echo "cache=${PYTORCH_NO_CUDA_MEMORY_CACHING:-on} pythonpath=$PYTHONPATH args=$*"\n')
    seen = {}
    for step in ("initcheck-eager-reference", "initcheck-eager-fused", "initcheck-graphs"):
        got = _run(repo, step, "out")
        assert got.returncode == 0, got.stdout + got.stderr
        seen[step] = (repo / "out" / f"{step}.log").read_text()
    for step, log in seen.items():
        assert "--tool initcheck" in log and "--error-exitcode 1" in log
        assert "tests/core/test_gpu_initcheck.py" in log and f"pythonpath={repo}/src" in log
        assert ("cache=1" in log) == step.startswith("initcheck-eager"), log
    assert "cache=on" in seen["initcheck-graphs"]


def _wheel(path: Path, dist: str, version: str, module: str) -> None:
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", f"__version__ = '{version}'\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")


def test_install_is_offline_into_a_target_folder(repo: Path) -> None:
    missing = _run(repo, "install", "out")
    assert missing.returncode == 1
    assert "expected the two wheels" in (repo / "out" / "install.log").read_text()
    (repo / "wheels").mkdir()
    _wheel(repo / "wheels" / "flashinfer_python-0.7.2.post1-py3-none-any.whl",
           "flashinfer-python", "0.7.2.post1", "flashinfer")
    _wheel(repo / "wheels" / "apache_tvm_ffi-0.1.15.post2-py3-none-any.whl",
           "apache-tvm-ffi", "0.1.15.post2", "tvm_ffi")
    got = _run(repo, "install", "out", PIP_INDEX_URL="http://127.0.0.1:9/none")
    log = (repo / "out" / "install.log").read_text()
    assert got.returncode == 0, log
    assert (repo / ".gpu-deps" / "site" / "flashinfer" / "__init__.py").exists()
    assert "flashinfer 0.7.2.post1" in log
    assert (repo / ".gpu-deps" / ".gitignore").read_text() == "*\n"  # never committed

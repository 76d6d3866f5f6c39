"""Packaging: the sdist ships the whole test suite with its helpers (and the tests collect from an
unpacked sdist); the suite runs without the optional ``triton`` extra, skipping the fused-path
tests cleanly; ``mypy`` needs no arguments."""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HIDE_TRITON = ROOT / "tests" / "helpers" / "hide_triton"
#: Folders the sdist ships whole (MANIFEST.in), because tests import or open their files.
SHIPPED = ("tests", "benchmarks", "examples", "docs", ".ci")
_JUNK = shutil.ignore_patterns(".git", "__pycache__", "*.py[cod]", "*.egg-info", "build", "dist",
                               ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis",
                               ".benchmarks", ".venv", ".venv-*", ".gpu-deps")


def _pyproject() -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The sdist the build backend makes from a copy of this tree, unpacked; its file list."""
    pytest.importorskip("setuptools", reason="the build backend (setuptools) is not installed")
    tmp = tmp_path_factory.mktemp("sdist")
    src = tmp / "tree"
    shutil.copytree(ROOT, src, ignore=_JUNK)
    # The PEP 517 hook pip and `python -m build` call, run in-process: no network, no isolation.
    code = "from setuptools import build_meta; print(build_meta.build_sdist('dist'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                         timeout=300, check=False, env=_env())
    assert out.returncode == 0, out.stderr[-3000:]
    name = out.stdout.strip().splitlines()[-1]
    with tarfile.open(src / "dist" / name) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp / "unpacked", filter="data")
        else:  # Python without extraction filters (older 3.10/3.11 patch releases)
            tar.extractall(tmp / "unpacked")
    (top,) = (tmp / "unpacked").iterdir()
    return top


def _files(root: pathlib.Path, folder: str) -> set[str]:
    base = root / folder
    if not base.exists():
        return set()
    return {p.relative_to(root).as_posix() for p in base.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


def _local_imports(path: pathlib.Path) -> set[str]:
    """Dotted names a test module imports (anywhere in it, functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)  # and its names, which may be modules (from tests.helpers import x)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _is_module(root: pathlib.Path, name: str) -> bool:
    """Whether ``name`` (dotted) is a module or package of the tests under ``root``."""
    path = root / name.replace(".", "/")
    return name.split(".")[0] == "tests" and (path.with_suffix(".py").is_file()
                                         or (path / "__init__.py").is_file())


def test_sdist_ships_every_test_helper(sdist: pathlib.Path) -> None:
    for folder in SHIPPED:
        mine = {f for f in _files(ROOT, folder) if not any(
            part in {".pytest_cache", ".hypothesis", ".benchmarks", ".gpu-deps"}
            for part in pathlib.PurePosixPath(f).parts)}
        assert mine, f"{folder}/ is empty here"
        missing = mine - _files(sdist, folder)
        assert not missing, f"the sdist lacks {sorted(missing)}"
    # every test module a test imports (``tests.helpers.batches``, ...) is in the sdist, in place
    tests = sorted((sdist / "tests").rglob("*.py"))
    assert any(t.relative_to(sdist).as_posix() == "tests/conftest.py" for t in tests)
    for t in tests:
        for name in _local_imports(t):
            if _is_module(ROOT, name):
                assert _is_module(sdist, name), f"{t.relative_to(sdist)} imports {name}"


def test_tests_collect_from_the_unpacked_sdist(sdist: pathlib.Path) -> None:
    args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    out = subprocess.run(args, cwd=sdist, capture_output=True, text=True, timeout=600,
                         check=False, env=_env(PYTHONPATH=str(sdist / "src")))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "error" not in out.stdout.splitlines()[-1], out.stdout[-3000:]
    # every test module of this tree collected tests there
    modules = {ln.split("::")[0] for ln in out.stdout.splitlines() if "::" in ln}
    expected = {p.relative_to(ROOT).as_posix() for p in ROOT.glob("tests/**/test_*.py")}
    for engine in ("vllm", "sglang"):  # those run in their own environments
        if importlib.util.find_spec(engine) is None:
            expected = {m for m in expected if not m.startswith(f"tests/integrations/{engine}/")}
    assert modules == expected


def test_triton_is_its_own_extra() -> None:
    meta = _pyproject()
    extras = meta["project"]["optional-dependencies"]
    assert not any(r.startswith("triton") for r in extras["test"])
    assert extras["triton"] == ["triton"]
    assert "'.[test,triton]'" in (ROOT / ".ci" / "run").read_text()


def test_fused_path_tests_skip_cleanly_without_triton() -> None:
    """The triton-marked tests, run with triton made uninstalled: collected, every one skipped
    with the reason, none failing or erroring (collection included)."""
    # modules marked whole (one imports attnpool.update.triton at the top) and one marking
    # single parameters
    paths = ["tests/update/triton/test_launches.py", "tests/update/test_opcount.py",
             "tests/kv/test_kv_fp8.py"]
    env = _env(PYTHONPATH=os.pathsep.join([str(HIDE_TRITON), str(ROOT / "src")]))
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u, attnpool; "
                            "c = attnpool.PoolConfig(device='cpu', impl=attnpool.Impl.AUTO); "
                            "print(u.find_spec('triton'), attnpool.BufferPool(c).decode.impl)"],
                           capture_output=True, text=True, timeout=120, check=False, env=env)
    assert probe.stdout.split() == ["None", "Impl.REFERENCE"], probe.stderr
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                          "triton", "-rs", *paths], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, check=False, env=env)
    tail = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "skipped" in tail and "passed" not in tail and "failed" not in tail, tail
    assert "error" not in tail, tail
    assert "triton is not installed" in out.stdout


def test_mypy_runs_without_arguments() -> None:
    cfg = _pyproject()["tool"]["mypy"]
    assert cfg["files"] == ["src"]
    if shutil.which("mypy") is None and subprocess.run(
            [sys.executable, "-c", "import mypy"], capture_output=True, check=False).returncode:
        pytest.skip("mypy is not installed")
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, check=False, env=_env())
    assert out.returncode == 0, out.stdout[-3000:]
    assert "Success" in out.stdout and "source files" in out.stdout

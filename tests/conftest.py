"""Test setup: Triton kernels run in interpret mode when there is no GPU; tests of them (the
``triton`` marker) skip when triton is not installed (it is the optional extra ``triton``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The long adversarial run takes many minutes: only when asked for (pytest -m fuzz).
    if "fuzz" not in (config.option.markexpr or ""):
        long = pytest.mark.skip(reason="long fuzz run: select it with pytest -m fuzz")
        for item in items:
            if "fuzz" in item.keywords:
                item.add_marker(long)
    if not HAS_TRITON:
        no_triton = pytest.mark.skip(reason="triton is not installed (pip install 'attnpool[triton]')")
        for item in items:
            if item.get_closest_marker("triton") is not None:
                item.add_marker(no_triton)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: a second intra-op thread only waits for a busy core (CI shares them). For the
    transformers tests: ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama() -> Any:
    """The tiny random GQA Llama of tests/helpers/hf_tiny.py (one per module: some tests change it)."""
    from tests.helpers import hf_tiny

    return hf_tiny.llama()


@pytest.fixture(scope="module")
def llama_ref(llama: Any) -> list[list[int]]:
    """``model.generate`` greedy outputs of :func:`llama` on hf_tiny's prompts."""
    from tests.helpers import hf_tiny

    return hf_tiny.greedy(llama, hf_tiny.prompts())


@pytest.fixture
def install(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, Any], None]]:
    """No real flash-attn module is importable; ``install(name, module)`` puts a fake in place
    (the flash-attn adapter's module loader is reset around each change)."""
    from attnpool.adapters import flash_attn as fa

    for name in [*(n for n, _ in fa.FA3_MODULES), "flash_attn", fa.FlashAttnVersion.FA4.value]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    fa.clear_kernel_cache()

    def put(name: str, module: Any) -> None:
        monkeypatch.setitem(sys.modules, name, module)
        fa.clear_kernel_cache()

    yield put
    fa.clear_kernel_cache()


# ---- compile coverage ----------------------------------------------------------------------------
# `attnpool kernels` compiles, for a GPU target, every kernel specialization its enumeration of pool
# configs launches (tests/update/triton/test_kernels_compile.py). So that no launch escapes that
# check, every specialization a pool launches during this pytest run (the interpreter runs them)
# is recorded, and the run fails at its end if the enumeration lacks one: a new phase part, flag
# or argument type then needs a config in attnpool/tools/kernel_cases.py. Checked at the end,
# whatever ran.
_POOL_LAUNCHES: Any = None
_REGISTERED = contextlib.ExitStack()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _POOL_LAUNCHES
    if HAS_TRITON:
        from attnpool.tools.kernels import Recorder

        _POOL_LAUNCHES = Recorder(pools_only=True)
        _REGISTERED.enter_context(_POOL_LAUNCHES.active())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    rec = _POOL_LAUNCHES
    if rec is None:
        return
    _REGISTERED.close()
    if not rec.specs or exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        return
    from attnpool.tools.kernels import enumerate_specs, missing

    try:
        gaps = missing(rec.specs, enumerate_specs())
    except Exception as e:  # the enumeration itself broke: the compile check covers nothing
        gaps = [f"(enumerating failed: {type(e).__name__}: {e})"]
    if gaps:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(gaps)} kernel specialization(s) launched by pools in this run are "
                 "not enumerated by attnpool.tools.kernel_cases (so never compiled for a GPU):",
                 *(f"  {g}" for g in gaps)]
        for line in lines:
            if tr is not None:
                tr.write_line(line, red=True)
            else:
                print(line, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def fake_fa4(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``flash_attn.cute`` as the CPU fake (``tests/helpers/fakes_fa4.py``, which asserts what
    the real interface asserts), no real ``flash_attn``; the adapter's kernel cache is reset
    around it. Yields the fake, whose ``calls`` keep every call's arguments."""
    from attnpool.adapters import flash_attn as fa

    from tests.helpers.fakes_fa4 import FA4

    fake = FA4()
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake.module())
    fa.clear_kernel_cache()
    yield fake
    fa.clear_kernel_cache()

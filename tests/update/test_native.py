"""The native step's build (:mod:`attnpool.update.native`): compiled once into the cache folder,
loaded from there by a later process, and replaced by the torch lane (None, with the reason)
when it is turned off or cannot be built. The step's bytes are tests/update/test_host_lane.py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnpool import BufferPool, Layout, PoolConfig
from attnpool.update import native


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder and no module loaded yet (restored after the test)."""
    monkeypatch.setattr(native, "_state", [None])
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(native.ENV, raising=False)
    # (the C++ tensor reader takes half a minute to build: its own test builds it once, into
    # the usual cache folder)
    monkeypatch.setenv(native.TENSOR_ENV, "0")
    return tmp_path


def _compiler() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")


def test_compiled_once_then_loaded_from_the_cache(fresh: Path) -> None:
    _compiler()
    module = native.load()
    assert module is not None, native.why()
    built = list((fresh / "native").iterdir())
    assert len(built) == 1 and built[0].name.startswith(native.NAME)
    assert native.load() is module and native.why().startswith("in use")
    # a later process loads the file without compiling (no compiler on its PATH)
    code = ("import sys; from attnpool.update import native; m = native.load(); "
            "sys.exit(0 if m is not None and m.__file__ == sys.argv[1] else 1)")
    done = subprocess.run([sys.executable, "-c", code, str(built[0])], check=False,
                          env={**os.environ, "PATH": "", native.CACHE_ENV: str(fresh),
                               "LDSHARED": "/nonexistent-cc"})
    assert done.returncode == 0


def test_turned_off_or_unbuildable_leaves_the_torch_lane(fresh: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV, "0")
    assert native.load() is None and "turned off" in native.why()
    monkeypatch.setattr(native, "_state", [None])
    monkeypatch.delenv(native.ENV)
    monkeypatch.setenv("LDSHARED", "false")  # (a compiler that fails)
    assert native.load() is None and native.why().startswith("not built")
    assert not any(p.is_file() for p in fresh.rglob("*"))  # (nothing half-written left)
    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu",
                                 layout=Layout.FLASH_ATTN, max_extend_tokens=16))
    lane = pool.decode._lane
    assert lane is not None and lane._step is None  # (the torch lane serves every step)


def test_diffs_is_torch_diff_or_declines_untouched() -> None:
    """``diffs`` (vLLM's query lengths from ``query_start_loc``) writes ``torch.diff``'s
    values into the first ``n`` rows and nothing else; inputs it does not take leave ``out``
    as it was and return None (the caller then runs ``torch.diff``)."""
    module = native.load()
    if module is None:
        pytest.skip(f"the native step is not built here: {native.why()}")
    qsl = torch.tensor([0, 1, 5, 6, 20, 21], dtype=torch.int32)
    out = torch.full((8,), -7, dtype=torch.int32)
    assert module.diffs(qsl, out, 4) is True
    assert out[:4].tolist() == torch.diff(qsl[:5]).tolist() and out[4:].eq(-7).all()
    assert module.diffs(qsl, out, 0) is True and out[:4].tolist() == [1, 4, 1, 14]
    fresh = torch.full((8,), -7, dtype=torch.int32)
    for label, args in {"n past query_start_loc": (qsl, fresh, 5 + 1),
                        "n past out": (torch.arange(12, dtype=torch.int32), fresh, 9),
                        "negative n": (qsl, fresh, -1), "a float n": (qsl, fresh, 2.0),
                        "n past int64": (qsl, fresh, 2 ** 70),
                        "int64 input": (qsl.long(), fresh, 3),
                        "int64 out": (qsl, fresh.long(), 3),
                        "strided input": (torch.arange(24, dtype=torch.int32)[::2], fresh, 3),
                        "a list": ([0, 1, 2], fresh, 2)}.items():
        assert module.diffs(*args) is None, label
        assert fresh.eq(-7).all(), label


def test_the_cpp_tensor_reader_reads_what_the_attributes_say() -> None:
    """The C++ reader (``tensor_facts.cpp``, built once per torch into the usual cache folder)
    and the attribute reader take and refuse the same tensors, and a step through either
    writes the same arena bytes."""
    module = native.load()
    if module is None:
        pytest.skip(f"the native step is not built here: {native.why()}")
    facts = native._tensor_facts()
    if facts is None:
        pytest.skip(f"the C++ tensor reader is not built here: {native.why()}")
    cfg = PoolConfig(max_bs=4, max_context_len=64, page_size=16, device="cpu",
                     layout=Layout.FLASH_ATTN, max_extend_tokens=16)
    lens = torch.tensor([5, 17, 33], dtype=torch.int32)
    table = torch.arange(40, dtype=torch.int32).view(10, 4)[:3]
    calls = {"good": (lens, table), "int64 lengths": (lens.long(), table),
             "int64 table": (lens, table.long()), "strided lengths":
             (torch.tensor([5, 0, 17, 0, 33, 0], dtype=torch.int32)[::2], table),
             "column-major table": (lens, table.t().contiguous().t()),
             "a 2-D length tensor": (lens.view(3, 1), table),
             "a 1-D table": (lens, table.reshape(-1)),
             "a Parameter table": (lens, torch.nn.Parameter(table.clone(), requires_grad=False)),
             "a sparse table": (lens, table.to_sparse()), "a meta table": (lens, table.to("meta")),
             "empty lengths": (lens[:0], table)}
    got: dict[str, list[object]] = {}
    try:
        for reader in (facts, None):
            module.setup(torch.Tensor, torch.int32, reader)
            pool = BufferPool(cfg, poison=True)  # (the same bytes where nothing writes)
            for label, (seq, tab) in calls.items():
                view = pool.decode.host_step(3, seq, tab)
                got.setdefault(label, []).append(
                    None if view is None else (view.max_seqlen_k,
                                               pool.arena.storage.view(torch.uint8).clone()))
    finally:
        module.setup(torch.Tensor, torch.int32, facts)
    for label, (a, b) in got.items():
        assert (a is None) == (b is None), label
        if a is not None:
            assert a[0] == b[0] and torch.equal(a[1], b[1]), label  # type: ignore[index]
    assert [k for k, v in got.items() if v[0] is not None] == ["good"]


def test_a_failed_cpp_build_is_recorded_not_retried(fresh: Path, monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    """A C++ reader that cannot be built leaves the attribute reader and a record of why, so
    that the next process does not spend the build's time again (the step itself is built)."""
    monkeypatch.delenv(native.TENSOR_ENV)
    monkeypatch.setenv("CXX", "false")  # (a compiler that fails)
    assert native._tensor_facts() is None
    assert [p.suffix for p in (fresh / "native").iterdir()] == [".failed"]
    ran = fresh / "ran"
    script = fresh / "cxx.sh"
    script.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    assert native._tensor_facts() is None and not ran.exists()
    assert "delete it to retry" in native._tensor_state[0]

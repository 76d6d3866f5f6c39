"""SGLang with ``attention_backend="attnpool"`` gives the greedy tokens of SGLang's own
``torch_native`` backend (float32, CPU).

Runs only where SGLang is installed: it pins its own torch, so ``.ci/run`` builds a second
environment for this folder (``.ci/sglang``). Each model is a tiny random one saved locally
(:mod:`tests.helpers.tiny_models`). Every comparison starts SGLang's CPU engine in two fresh
processes, one per backend, with the same engine arguments (:mod:`tests.helpers.sglang_engine`),
run side by side; each setting generates a batch of 11 requests (1 to 200 prompt tokens, three
sharing a 100-token prefix) and then one request alone, sharing that prefix:

- ``defaults``: SGLang's radix cache on, pages of one token;
- ``chunked``: ``chunked_prefill_size=32`` with ``enable_mixed_chunk=True`` (prefill chunks and
  decode rows in one extend batch) and pages of 16 tokens;
- ``pressure``: a KV pool of 400 tokens that the batch outgrows during decode: the scheduler
  retracts requests (its log says so, and the test checks it for both backends).

Models: Llama (every setting), Qwen3, Mistral (SGLang runs Mistral through its Llama model,
without a sliding window, on both backends) and Gemma 2 (sliding window on every other layer,
through the pool's window part; ``logit_cap`` 20: attnpool applies it, ``torch_native`` does not,
and at this cap the tiny model's scores leave the greedy tokens unchanged).

A negative control (Llama's ``corrupt`` setting) corrupts one refilled field of the pool on
every decode batch (the first row's ``cache_seqlens``, through
``tests/helpers/sglang_cpu/sitecustomize.py``) and must change the tokens: attention reads the
pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from tests.helpers import sglang_engine as se
from tests.helpers.tiny_models import save_tiny

#: one line per comparison, written where ATTNPOOL_SGLANG_REPORT points (the closing figures)
REPORT = os.environ.get("ATTNPOOL_SGLANG_REPORT")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("sglang_models")


def _model(name: str, root: Path) -> Path:
    path = save_tiny(name, root)
    cfg = json.loads((path / "config.json").read_text())
    if "hidden_activation" in cfg and "hidden_act" not in cfg:
        # SGLang's Gemma 2 reads the activation under its older name
        cfg["hidden_act"] = cfg["hidden_activation"]
        (path / "config.json").write_text(json.dumps(cfg))
    return path


def _start(model: Path, backend: str, settings: str, out: Path, *args: str, **extra: str
           ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.sglang_engine", "--model", str(model),
         "--backend", backend, "--settings", settings, "--out", str(out), *args],
        env=se.env(**extra), cwd=se.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def _finish(p: subprocess.Popen[str], out: Path) -> tuple[dict[str, Any], str]:
    log, _ = p.communicate(timeout=900)
    assert p.returncode == 0, log[-4000:]
    return json.loads(out.read_text()), log


def run_pair(model: Path, settings: str, tmp: Path, *args: str
             ) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """Both backends' tokens (native, attnpool) and logs, the two processes side by side
    (``args``: more of the helper's options)."""
    from attnpool.integrations.sglang.backend import REPORT, Served

    procs = {b: _start(model, b, settings, tmp / f"{b}.json", *args,
                       **{REPORT: str(tmp / f"{b}-served")})
             for b in ("torch_native", se.NAME)}
    (native, nlog), (ours, olog) = (_finish(procs[b], tmp / f"{b}.json")
                                    for b in ("torch_native", se.NAME))
    # attnpool's pool served the run (its refills counted in the engine's own processes), and
    # SGLang's own backend never reached attnpool's
    decode, extend, nbytes = Served.read(str(tmp / f"{se.NAME}-served"))
    assert decode > 0 and extend > 0 and nbytes > 0, (decode, extend, nbytes)
    assert Served.read(str(tmp / "torch_native-served")) == (0, 0, 0)
    return native, ours, nlog, olog


def _record(**row: Any) -> None:
    print(json.dumps(row))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


def _check(name: str, native: dict[str, Any], ours: dict[str, Any]) -> None:
    for setting, want in native.items():
        got = ours[setting]
        _record(model=name, setting=setting, requests=len(want["batch"]),
                identical=sum(a == b for a, b in zip(want["batch"], got["batch"], strict=True)),
                one_identical=want["one"] == got["one"])
    assert ours == native


def test_llama_every_setting(root: Path, tmp_path: Path) -> None:
    native, ours, nlog, olog = run_pair(_model("llama", root),
                                        "defaults,chunked,pressure,corrupt", tmp_path)
    # the negative control: attnpool's corrupted pool changes tokens (native's run of it is
    # its defaults again: the corruption touches attnpool's pool only)
    assert native["corrupt"] == native["defaults"]
    changed = sum(a != b for a, b in zip(native["corrupt"]["batch"], ours["corrupt"]["batch"],
                                         strict=True))
    _record(model="llama", setting="corrupted cache_seqlens", changed=changed)
    assert changed > 0
    del native["corrupt"], ours["corrupt"]
    _check("llama", native, ours)
    assert se.RETRACTED in nlog and se.RETRACTED in olog  # the pool did run out


@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma2"])
def test_family_chunked(name: str, root: Path, tmp_path: Path) -> None:
    native, ours, _, _ = run_pair(_model(name, root), "chunked", tmp_path)
    _check(name, native, ours)

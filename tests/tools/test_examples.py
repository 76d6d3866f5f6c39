"""The engine integration examples run on CPU, as a user runs them, and check themselves."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(name: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--device", "cpu"],
                         capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_sglang_runner() -> None:
    out = _run("sglang_runner.py")
    assert "prefill: 5 prompts" in out and "through pool.extend" in out
    assert out.count("decode step ") == 6
    assert out.count("speculative round ") == 3 and "acceptance " in out
    assert "generated tokens equal greedy decoding without a cache: ok" in out


def test_vllm_runner() -> None:
    out = _run("vllm_runner.py")
    assert "admitted [0, 1, 2, 3]" in out  # four batch rows, then requests wait for rows/blocks
    assert "10 requests" in out and "all equal to greedy decoding without a cache: ok" in out

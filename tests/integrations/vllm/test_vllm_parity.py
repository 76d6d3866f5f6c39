"""What vLLM's own CPU backend serves, attnpool's serves the same way (float32, greedy, CPU).

- An fp8 KV cache: vLLM's CPU kernel attends over the pool's buffers with the cache dtype and
  the layers' K/V scales, its store op writes the fp8 bytes. Where vLLM's CPU build cannot
  serve fp8 (a CPU without AVX-512 or AMX), both engines refuse with vLLM's own error; where it
  can, both give the same tokens.
- ALiBi (a tiny random Bloom): the slopes go to vLLM's kernel; the same tokens as native.
- What attnpool still refuses is logged at ERROR under vLLM's logger, with the setting to
  change, and the message reaches a multiprocess engine's output (the caller itself only sees
  "Engine core initialization failed").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.helpers import vllm_engine as ve

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-parity")


def _run(model: Path, attnpool: bool, **kw: object) -> tuple[list[list[int]] | None, str]:
    """Token ids of a short mixed batch, or None and the error's last line."""
    try:
        tokens, _, _ = ve.generate(model, attnpool, ve.prompts(lengths=(5, 40, 90), shared=0),
                                   8, **kw)
    except Exception as e:  # (the engines' own errors are compared)
        cause: BaseException = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        return None, f"{type(cause).__name__}: {cause}"
    return tokens, ""


def test_fp8_cache_as_vllm_serves_it(root: Path) -> None:
    model = ve.save_tiny("llama", root)
    native, native_err = _run(model, False, kv_cache_dtype="fp8")
    ours, our_err = _run(model, True, kv_cache_dtype="fp8")
    if native is None:  # this CPU: vLLM's own refusal, the same from both engines
        assert ours is None and our_err == native_err, (our_err, native_err)
        assert "FP8" in native_err, native_err
    else:
        assert ours == native


def test_alibi_tokens_equal_native(root: Path) -> None:
    model = ve.save_tiny("bloom", root)
    native, err = _run(model, False)
    assert native is not None, err
    ours, err = _run(model, True)
    assert ours == native, err


def test_a_refusal_reaches_a_multiprocess_engines_output(root: Path) -> None:
    """attnpool's torch paths (``ATTNPOOL_VLLM_CPU_KERNEL=attnpool``) do not take an fp8
    cache: the engine core process logs why, and which setting to change, at ERROR."""
    model = ve.save_tiny("llama", root)
    code = ("import sys; from vllm import LLM; from tests.helpers import vllm_engine as ve; "
            "LLM(model=sys.argv[1], **ve.engine_args(kv_cache_dtype='fp8', "
            "distributed_executor_backend='mp'))")
    env = {**os.environ, "ATTNPOOL_VLLM": "1", "ATTNPOOL_VLLM_CPU_KERNEL": "attnpool",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(model)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=False, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    lines = [ln for ln in text.splitlines() if "ERROR" in ln and "attnpool's vLLM backend does "
             "not serve an fp8 KV cache" in ln]
    assert lines, text[-4000:]
    assert "unset ATTNPOOL_VLLM_CPU_KERNEL" in lines[0] and "unset ATTNPOOL_VLLM " in lines[0]

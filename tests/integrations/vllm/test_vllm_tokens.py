"""vLLM with attnpool's backend gives vLLM's own greedy tokens (float32, CPU).

Runs only where vLLM is installed: its CPU build pins an older transformers than the main test
extra, so ``.ci/run`` builds a second environment for this folder (``.ci/vllm``). Each model is
a tiny random one saved locally (:mod:`tests.helpers.vllm_engine`); every comparison runs vLLM's
native backend and then attnpool's in the same process with the same engine arguments:

- ``mixed``: chunked prefill with ``max_num_batched_tokens=64`` (prompts up to 200 tokens, so
  prefill chunks and decode rows share steps), prefix caching with three prompts sharing a
  100-token prefix, a KV cache of 17 blocks of 32 tokens (the scheduler preempts and
  recomputes requests: counted), ``max_num_seqs=8``, prompt lengths 1 to 200;
- ``one_seq``: ``max_num_seqs=1``;
- ``ngram``: speculative decoding with n-gram drafts (verify steps of several query rows).

Attention on a CPU runs vLLM's own kernel over the pool's buffers by default
(``ATTNPOOL_VLLM_CPU_KERNEL=vllm``); ``mixed`` also runs attnpool's torch paths (``attnpool``:
the block decode path and the SDPA adapter) for the models that carry a variant (softcap,
windows, sinks) and for Llama, and each run asserts which path attended.

A negative control corrupts one refilled field of the pool (a row's ``cache_seqlens``) and
must change the tokens: the pool's metadata is what attention reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.helpers import vllm_engine as ve

MODELS = ("llama", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss")
#: KV blocks of 32 tokens per model: few enough that the scheduler preempts, enough for one
#: 512-token request. Models with full and sliding layers keep two KV-cache groups, and the
#: full group alone needs 16 blocks for it, so they get more.
BLOCKS = {"llama": 17, "qwen3": 17, "mistral": 17, "gemma2": 24, "gemma3": 32, "gpt_oss": 24}
NEW = 48
#: one line per comparison, written where ATTNPOOL_VLLM_REPORT points (the closing figures)
REPORT = os.environ.get("ATTNPOOL_VLLM_REPORT")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("vllm_models")


def _record(**row: Any) -> None:
    print(json.dumps(row))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


def _compare(model: Path, name: str, setting: str, reqs: list[dict[str, list[int]]],
             **kw: Any) -> tuple[int, int]:
    native, pre_n, _ = ve.generate(model, False, reqs, NEW, **kw)
    ours, pre_a, metrics = ve.generate(model, True, reqs, NEW, **kw)
    same = sum(a == b for a, b in zip(native, ours, strict=True))
    hits = int(sum(getattr(m, "value", 0) for m in metrics
                   if m.name == "vllm:prefix_cache_hits"))
    _record(model=name, setting=setting, identical=same, requests=len(reqs),
            tokens=sum(map(len, ours)), preemptions=[pre_n, pre_a], prefix_cache_hits=hits)
    assert ours == native, f"{name}/{setting}: {same}/{len(reqs)} requests identical"
    return pre_a, hits


#: the models whose ``mixed`` run also goes through attnpool's torch paths
TORCH_PATHS = ("llama", "gemma2", "gemma3", "gpt_oss")


@pytest.mark.parametrize(("name", "kernel"), [*((m, "vllm") for m in MODELS),
                                              *((m, "attnpool") for m in TORCH_PATHS)])
def test_mixed_batches_chunked_prefix_cached_preempted(root: Path, name: str, kernel: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from attnpool.integrations.vllm import CPU_KERNEL, cpu_kernel

    calls = []
    attend = cpu_kernel.CPUKernel.attend

    def counted(self: cpu_kernel.CPUKernel, *a: Any, **kw: Any) -> None:
        calls.append(1)
        attend(self, *a, **kw)

    monkeypatch.setattr(cpu_kernel.CPUKernel, "attend", counted)
    monkeypatch.setenv(CPU_KERNEL, kernel)
    pre, hits = _compare(ve.save_tiny(name, root), name, f"mixed/{kernel}", ve.prompts(),
                         num_gpu_blocks_override=BLOCKS[name])
    assert bool(calls) == (kernel == "vllm"), f"{len(calls)} calls of vLLM's kernel"
    assert pre > 0, "the small KV cache should have forced a preemption"
    assert hits > 0, "the shared prefixes should have hit the prefix cache"


def test_one_request_at_a_time(root: Path) -> None:
    _compare(ve.save_tiny("llama", root), "llama", "one_seq", ve.prompts(lengths=(1, 77, 200),
             shared=1), max_num_seqs=1)


def test_corrupting_the_pool_changes_the_tokens(root: Path, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """Negative control: with one row's refilled ``cache_seqlens`` shortened by one after each
    refill, attention drops a key and the tokens differ from vLLM's."""
    from attnpool.integrations.vllm import step

    model, reqs = ve.save_tiny("llama", root), ve.prompts(lengths=(40, 90), shared=0)
    native, _, _ = ve.generate(model, False, reqs, 16)
    refill = step.StepFiller.step  # (the builder's call)

    def corrupt(self: step.StepFiller, *args: Any) -> step.StepMetadata:
        md = refill(self, *args)
        md.view.cache_seqlens[0] -= 1
        return md

    monkeypatch.setattr(step.StepFiller, "step", corrupt)
    ours, _, _ = ve.generate(model, True, reqs, 16)
    _record(model="llama", setting="corrupted", identical=sum(
        a == b for a, b in zip(native, ours, strict=True)), requests=len(reqs))
    assert ours != native


def test_what_attnpool_does_not_serve_is_refused_at_start(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 KV cache for attnpool's torch paths (vLLM's kernel takes one: see
    test_vllm_parity.py): the engine does not start, and says why (never a wrong token)."""
    from attnpool import LayoutError
    from attnpool.integrations.vllm import CPU_KERNEL

    monkeypatch.setenv(CPU_KERNEL, "attnpool")
    with pytest.raises(Exception) as e:
        ve.generate(ve.save_tiny("llama", root), True, ve.prompts(lengths=(5,), shared=0), 2,
                    kv_cache_dtype="fp8")
    chain, err = [], e.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    assert any(isinstance(x, LayoutError) and "fp8 KV cache" in str(x) for x in chain), chain


def test_ngram_speculative_decoding(root: Path) -> None:
    """Verify steps carry several query rows per request (drafts from repetitive prompts).
    Each engine in its own process: vLLM cannot start another engine in a process that ran
    its n-gram proposer."""
    reqs = [{"prompt_token_ids": [5, 6, 7, 8] * 12}, {"prompt_token_ids": [9, 10, 11] * 20 + [4]}]
    kw = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    model = ve.save_tiny("llama", root)
    native, _ = ve.generate_apart(model, False, reqs, NEW, **kw)
    ours, _ = ve.generate_apart(model, True, reqs, NEW, **kw)
    _record(model="llama", setting="ngram", identical=sum(
        a == b for a, b in zip(native, ours, strict=True)), requests=len(reqs),
        tokens=sum(map(len, ours)))
    assert ours == native

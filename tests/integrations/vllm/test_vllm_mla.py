"""vLLM serving DeepSeek (multi-head latent attention) through attnpool gives vLLM's own greedy
tokens (float32, CPU): attnpool's ``CPU_MLA`` against vLLM's.

Tiny random DeepSeek V2 (no query LoRA) and V3 (query LoRA) models, dense, and a V3 with a MoE
layer (:mod:`tests.helpers.vllm_engine`), each run natively and then through attnpool in the
same process with the same engine arguments as the other vLLM comparisons (``max_num_seqs=8``,
prompts of 1 to 200 tokens, three sharing a 100-token prefix, chunked prefill with
``max_num_batched_tokens=64``, prefix caching) and a KV cache of 40 blocks of 16 tokens, small
enough that the scheduler preempts and recomputes requests (counted). attnpool runs twice: with
vLLM's prefill for the prefill rows (the default) and with every row attnpool's
(``ATTNPOOL_VLLM_MLA_PREFILL=attnpool``).

- ``mla``: under vLLM's CPU platform as it is, which for every MLA model (CPUs without AMX)
  sets block size 16 and turns chunked prefill and prefix caching off (whole prompts, steps
  mixing decode rows and fresh prompts);
- ``mla_chunked``: that platform keeping the engine's chunked prefill and prefix caching
  (:func:`tests.helpers.vllm_engine.mla_scheduling_kept`; vLLM's own MLA backend then runs
  them too): prefill chunks over cached prefixes, prefix-cache hits counted;
- ``mla_one_seq``: ``max_num_seqs=1``.

A negative control shortens one refilled row of the pool by one key: the tokens change.

(vLLM's CPU rotary kernel misreads the 3-D ``[T, H, rope]`` query slice DeepSeek's MLA layer
hands it, so vLLM's DeepSeek tokens on a CPU depend on how requests are batched; both backends
receive the same queries, so the comparisons here stay exact.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from attnpool.integrations.vllm import MLA_PREFILL

from tests.helpers import vllm_engine as ve
from tests.integrations.vllm.test_vllm_tokens import _record

MODELS = ("deepseek_v2", "deepseek_v3", "deepseek_v3_moe")
#: blocks of 16 tokens (the block size vLLM's CPU platform sets for MLA): 640 tokens for 11
#: requests of up to 248 tokens, one 512-token request fits
BLOCKS = 40
NEW = 48
PREFILLS = ("vllm", "attnpool")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("vllm_mla_models")


def _hits(metrics: Any) -> int:
    return int(sum(getattr(m, "value", 0) for m in metrics
                   if m.name == "vllm:prefix_cache_hits"))


def _compare(model: Path, name: str, setting: str, reqs: list[dict[str, list[int]]],
             monkeypatch: pytest.MonkeyPatch, **kw: Any) -> list[tuple[int, int]]:
    """Native tokens, then attnpool's with each prefill setting: ``(preemptions,
    prefix-cache hits)`` of every attnpool run."""
    native, pre_n, _ = ve.generate(model, False, reqs, NEW, **kw)
    seen = []
    for prefill in PREFILLS:
        monkeypatch.setenv(MLA_PREFILL, prefill)
        ours, pre_a, metrics = ve.generate(model, True, reqs, NEW, **kw)
        same = sum(a == b for a, b in zip(native, ours, strict=True))
        _record(model=name, setting=f"{setting}/prefill={prefill}", identical=same,
                requests=len(reqs), tokens=sum(map(len, ours)), preemptions=[pre_n, pre_a],
                prefix_cache_hits=_hits(metrics))
        assert ours == native, f"{name}/{setting}/{prefill}: {same}/{len(reqs)} identical"
        seen.append((pre_a, _hits(metrics)))
    return seen


@pytest.mark.parametrize("name", MODELS)
def test_mla_tokens_preempted_mixed_steps(root: Path, name: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _compare(ve.save_tiny(name, root), name, "mla", ve.prompts(), monkeypatch,
                    num_gpu_blocks_override=BLOCKS)
    assert all(pre > 0 for pre, _ in seen), "the small KV cache should have forced preemption"


def test_mla_chunked_prefill_and_prefix_caching(root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with ve.mla_scheduling_kept():
        seen = _compare(ve.save_tiny("deepseek_v2", root), "deepseek_v2", "mla_chunked",
                        ve.prompts(), monkeypatch, num_gpu_blocks_override=BLOCKS)
    assert all(pre > 0 and hits > 0 for pre, hits in seen), seen


def test_mla_one_request_at_a_time(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(ve.save_tiny("deepseek_v2", root), "deepseek_v2", "mla_one_seq",
             ve.prompts(lengths=(1, 77, 200), shared=1), monkeypatch, max_num_seqs=1)


@pytest.mark.parametrize("prefill", PREFILLS)
def test_corrupting_the_mla_pool_changes_the_tokens(root: Path, prefill: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: one row's refilled ``cache_seqlens`` shortened by one (before the
    step's plan reads it): attention drops a key and the tokens differ from vLLM's."""
    from attnpool.integrations.vllm import mla_step

    model, reqs = ve.save_tiny("deepseek_v2", root), ve.prompts(lengths=(40, 90), shared=0)
    native, _, _ = ve.generate(model, False, reqs, 16)
    refill = mla_step.LatentFiller.refill
    calls = []

    def corrupt(self: mla_step.LatentFiller, **kw: Any) -> Any:
        view = refill(self, **kw)
        view.cache_seqlens[0] -= 1
        calls.append(view.bs)
        return view

    monkeypatch.setattr(mla_step.LatentFiller, "refill", corrupt)
    monkeypatch.setenv(MLA_PREFILL, prefill)
    ours, _, _ = ve.generate(model, True, reqs, 16)
    _record(model="deepseek_v2", setting=f"mla_corrupted/prefill={prefill}", identical=sum(
        a == b for a, b in zip(native, ours, strict=True)), requests=len(reqs))
    assert calls, "attnpool's refill never ran"
    assert ours != native

"""vLLM serving DeepSeek (multi-head latent attention) through attnpool gives vLLM's own greedy
tokens (float32, CPU): attnpool's ``CPU_MLA`` against vLLM's.

Tiny random DeepSeek V2 (no query LoRA) and V3 (query LoRA) models, dense, and a V3 with a MoE
layer (:mod:`tests.helpers.vllm_engine`), each run natively and then through attnpool in the
same process with the same engine arguments as the other vLLM comparisons: ``max_num_seqs=8``,
prompts of 1 to 200 tokens, three sharing a 100-token prefix, and a KV cache of 40 blocks of 16
tokens, small enough that the scheduler preempts and recomputes requests (counted). vLLM's CPU
platform itself sets three of those arguments otherwise for every MLA model (CPUs without AMX):
block size 16, chunked prefill and prefix caching off (``max_num_batched_tokens`` raised to a
whole prompt). Steps still mix decode rows (attnpool's pool and absorbed adapter) with prefill
rows (vLLM's prefill).

A negative control shortens one refilled decode row of the pool by one key: the tokens change.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.helpers import vllm_engine as ve
from tests.integrations.vllm.test_vllm_tokens import _record

MODELS = ("deepseek_v2", "deepseek_v3", "deepseek_v3_moe")
#: blocks of 16 tokens (the block size vLLM's CPU platform sets for MLA): 640 tokens for 11
#: requests of up to 248 tokens, one 512-token request fits
BLOCKS = 40
NEW = 48


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("vllm_mla_models")


def _compare(model: Path, name: str, setting: str, reqs: list[dict[str, list[int]]],
             **kw: Any) -> int:
    native, pre_n, _ = ve.generate(model, False, reqs, NEW, **kw)
    ours, pre_a, _ = ve.generate(model, True, reqs, NEW, **kw)
    same = sum(a == b for a, b in zip(native, ours, strict=True))
    _record(model=name, setting=setting, identical=same, requests=len(reqs),
            tokens=sum(map(len, ours)), preemptions=[pre_n, pre_a])
    assert ours == native, f"{name}/{setting}: {same}/{len(reqs)} requests identical"
    return pre_a


@pytest.mark.parametrize("name", MODELS)
def test_mla_tokens_preempted_mixed_steps(root: Path, name: str) -> None:
    pre = _compare(ve.save_tiny(name, root), name, "mla_mixed", ve.prompts(),
                   num_gpu_blocks_override=BLOCKS)
    assert pre > 0, "the small KV cache should have forced a preemption"


def test_mla_one_request_at_a_time(root: Path) -> None:
    _compare(ve.save_tiny("deepseek_v2", root), "deepseek_v2", "mla_one_seq",
             ve.prompts(lengths=(1, 77, 200), shared=1), max_num_seqs=1)


def test_corrupting_the_mla_pool_changes_the_tokens(root: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: one decode row's refilled ``cache_seqlens`` shortened by one (before
    the step's plan reads it): attention drops a key and the tokens differ from vLLM's."""
    from attnpool.integrations.vllm import mla_step

    model, reqs = ve.save_tiny("deepseek_v2", root), ve.prompts(lengths=(40, 90), shared=0)
    native, _, _ = ve.generate(model, False, reqs, 16)
    refill = mla_step.LatentFiller.refill
    calls = []

    def corrupt(self: mla_step.LatentFiller, seq_lens: Any, block_table: Any) -> Any:
        view = refill(self, seq_lens, block_table)
        view.cache_seqlens[0] -= 1
        calls.append(view.bs)
        return view

    monkeypatch.setattr(mla_step.LatentFiller, "refill", corrupt)
    ours, _, _ = ve.generate(model, True, reqs, 16)
    _record(model="deepseek_v2", setting="mla_corrupted", identical=sum(
        a == b for a, b in zip(native, ours, strict=True)), requests=len(reqs))
    assert calls, "attnpool's decode refill never ran"
    assert ours != native

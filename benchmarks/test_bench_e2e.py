"""End to end: a transformers model generating through attnpool vs transformers' own paths.

The methods and the workload come from :mod:`attnpool.tools.bench_e2e` (``attnpool bench --e2e``
measures the same): :class:`~attnpool.integrations.transformers.PagedGenerator`, transformers'
continuous batching (``generate_batch``) and ``model.generate`` on left-padded batches, on the
same tiny random Llama and prompts (the quick case, so the suite stays short; the CLI's default
case is the one in BENCHMARKS.md). Each benchmark times a whole ``generate`` call and records the
new tokens per second (median round) and the metadata-preparation host time per forward in
``extra_info``. One intra-op thread on CPU, as in the CLI. Skipped without transformers.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnpool.tools import bench_e2e

pytest.importorskip("transformers")

CASE = bench_e2e.QUICK


@pytest.fixture(scope="module")
def workload(device: torch.device) -> Iterator[tuple[Any, list[list[int]]]]:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    yield bench_e2e.tiny_model(CASE, device), bench_e2e.make_prompts(CASE)
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", list(bench_e2e.METHODS))
def test_e2e(benchmark: Any, machine: dict[str, Any], method: str,
             workload: tuple[Any, list[list[int]]]) -> None:
    model, prompts = workload
    run = bench_e2e.METHODS[method]
    runs: list[bench_e2e.Run] = []
    benchmark.group = f"e2e {CASE.name}"
    benchmark.pedantic(lambda: runs.append(run(model, prompts, CASE)), rounds=3, iterations=1,
                       warmup_rounds=1)
    timed = runs[1:]  # the first call was the warm-up round
    tokens = timed[0].tokens
    assert tokens == CASE.prompts * CASE.new_tokens
    benchmark.extra_info.update(machine)
    benchmark.extra_info.update({
        "method": method, "case": CASE.name, "tokens": tokens,
        "tokens_per_s_median": statistics.median(r.tokens / r.wall_s for r in timed),
        "metadata_us_per_step": statistics.median(1e6 * r.metadata_s / r.steps for r in timed),
        "forwards": timed[0].steps,
    })

"""End to end: a transformers model generating through attnpool vs transformers' own paths.

The methods and the workloads come from :mod:`attnpool.tools.bench_e2e` and
:mod:`attnpool.tools.bench_e2e_model` (``attnpool bench --e2e [--model smollm2]`` measures the
same): :class:`~attnpool.integrations.transformers.PagedGenerator`, transformers' continuous
batching (``generate_batch``) and ``model.generate`` on left-padded batches.

* ``test_e2e``: the tiny random Llama's quick case (the suite stays short; the CLI's default case
  is the one in BENCHMARKS.md), one intra-op thread.
* ``test_e2e_smollm2``: the trained checkpoint (SmolLM2-135M-Instruct, float32), the
  equal-length and the chat workload at one thread; runs only when ``attnpool fetch smollm2``
  has cached the checkpoint (and the ``gguf`` package is installed).

Each benchmark times a whole ``generate`` call and records the new tokens per second (median
round), the metadata-preparation host time per forward and whether the tokens equal
``model.generate``'s in ``extra_info``. Skipped without transformers.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnpool.tools import bench_e2e

pytest.importorskip("transformers")

CASE = bench_e2e.QUICK


@pytest.fixture(scope="module")
def workload(device: torch.device) -> Iterator[tuple[Any, bench_e2e.Workload]]:
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    yield bench_e2e.tiny_model(CASE, device), CASE.workload()
    torch.set_num_threads(threads)


def _bench(benchmark: Any, machine: dict[str, Any], method: str, model: Any,
           wl: bench_e2e.Workload, rounds: int) -> list[bench_e2e.Run]:
    run = bench_e2e.METHODS[method]
    runs: list[bench_e2e.Run] = []
    benchmark.group = f"e2e {wl.name}"
    benchmark.pedantic(lambda: runs.append(run(model, wl)), rounds=rounds, iterations=1,
                       warmup_rounds=1)
    timed = runs[1:]  # the first call was the warm-up round
    benchmark.extra_info.update(machine)
    benchmark.extra_info.update({
        "method": method, "case": wl.name, "tokens": timed[0].tokens,
        "tokens_per_s_median": statistics.median(r.tokens / r.wall_s for r in timed),
        "metadata_us_per_step": statistics.median(1e6 * r.metadata_s / r.steps for r in timed),
        "forwards": timed[0].steps, "threads": torch.get_num_threads(),
    })
    return timed


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", list(bench_e2e.METHODS))
def test_e2e(benchmark: Any, machine: dict[str, Any], method: str,
             workload: tuple[Any, bench_e2e.Workload]) -> None:
    model, wl = workload
    timed = _bench(benchmark, machine, method, model, wl, rounds=3)
    assert timed[0].tokens == CASE.prompts * CASE.new_tokens


@pytest.fixture(scope="module")
def smollm2(device: torch.device) -> Iterator[tuple[Any, list[bench_e2e.Workload]]]:
    from attnpool.tools import bench_e2e_model, checkpoint, fetch

    if fetch.cached("smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("SmolLM2 is not cached (python -m attnpool fetch smollm2) or gguf is missing")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    loaded = checkpoint.load("smollm2", device)
    yield loaded.model, bench_e2e_model.workloads(loaded)
    torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", list(bench_e2e.METHODS))
@pytest.mark.parametrize("which", ["equal", "chat"])
def test_e2e_smollm2(benchmark: Any, machine: dict[str, Any], method: str, which: str,
                     smollm2: tuple[Any, list[bench_e2e.Workload]]) -> None:
    model, wls = smollm2
    (wl,) = [w for w in wls if w.name == which]
    timed = _bench(benchmark, machine, method, model, wl, rounds=2)
    if which not in _REFERENCE:  # model.generate's tokens, once per workload
        _REFERENCE[which] = (timed[0] if method == "hf-generate"
                             else bench_e2e.run_hf_generate(model, wl)).outputs
    same = sum(a == b for a, b in zip(timed[0].outputs, _REFERENCE[which], strict=True))
    benchmark.extra_info["same_tokens_as_hf_generate"] = f"{same}/{len(wl.prompts)}"


_REFERENCE: dict[str, list[list[int]]] = {}

"""``attnpool bench --e2e``: a real transformers model generating, three ways, in one run.

Same tiny random Llama (built from a config, never downloaded), same prompts, same greedy
settings:

* ``attnpool``: :class:`attnpool.integrations.transformers.PagedGenerator` (continuous batching,
  paged KV cache and metadata from a pool; SDPA adapter on CPU, CUDA graphs on a GPU).
* ``hf-continuous-batching``: transformers' own continuous batching (``model.generate_batch``
  with its paged cache; it refuses custom attention names, so it runs its own path).
* ``hf-generate``: ``model.generate`` on left-padded batches of ``max_bs`` prompts with a
  ``DynamicCache`` (static batching: a batch runs until its longest request is done).

Every method runs once to warm up, then ``rounds`` times, interleaved (a, b, c, a, b, c, ...) so
machine load hits all of them alike. Reported: new tokens per second of wall-clock time (best
round and median), CPU seconds of the best round (``time.process_time``: insensitive to waiting
for a core on a shared machine), and the metadata-preparation host time per forward, measured
where each method prepares its attention inputs:

* ``attnpool``: page/slot bookkeeping, the step's input tensors, the pool's ``update_``, the KV
  slot mapping and the SDPA gather plan (:class:`~attnpool.integrations.hf_state.GenerationStats`).
* ``hf-generate``: ``prepare_inputs_for_generation`` plus the model's ``create_causal_mask``
  (timed by wrapping them for the run).
* ``hf-continuous-batching``: ``ContinuousBatchProcessor.prepare_next_batch`` (scheduling, block
  tables and batch tensors; timed by wrapping it).

CPU runs use one intra-op thread for every method: the ops are small and, on a shared machine, an
op that wakes a second thread waits for it whenever the other core is busy.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..integrations.tiny import random_prompts, tiny_llama
from .bench import device_of, machine_info


@dataclass(frozen=True)
class E2ECase:
    """A model and a workload. Prompt lengths are uniform in ``[lo, hi]`` (seeded)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    prompts: int
    lo: int
    hi: int
    new_tokens: int
    max_bs: int
    page_size: int = 16


FULL = E2ECase("llama-l4-h256-gqa8:2", layers=4, hidden=256, heads=8, kv_heads=2,
               intermediate=512, vocab=2048, prompts=32, lo=8, hi=256, new_tokens=64, max_bs=8)
QUICK = E2ECase("llama-l2-h64-gqa4:2", layers=2, hidden=64, heads=4, kv_heads=2,
                intermediate=128, vocab=256, prompts=8, lo=1, hi=40, new_tokens=12, max_bs=4)
ROUNDS = 5


def tiny_model(case: E2ECase, device: torch.device, dtype: torch.dtype = torch.float32,
               seed: int = 0) -> Any:
    """A random Llama of ``case``'s sizes (:func:`attnpool.integrations.tiny.tiny_llama`)."""
    return tiny_llama(layers=case.layers, hidden=case.hidden, heads=case.heads,
                      kv_heads=case.kv_heads, intermediate=case.intermediate, vocab=case.vocab,
                      max_positions=case.hi + case.new_tokens + 8, device=device, dtype=dtype,
                      seed=seed)


def make_prompts(case: E2ECase, seed: int = 0) -> list[list[int]]:
    return random_prompts(case.prompts, case.lo, case.hi, case.vocab, seed)


@dataclass
class Timer:
    """Accumulates host time of wrapped calls (``calls`` counts them)."""

    seconds: float = 0.0
    calls: int = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # wraps: transformers inspects prepare_inputs_for_generation's signature
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


@contextlib.contextmanager
def _patched(obj: Any, name: str, timer: Timer) -> Iterator[None]:
    """Time every call of ``obj.name`` for the duration (restored afterwards)."""
    had = name in vars(obj)
    orig = getattr(obj, name)
    setattr(obj, name, timer.wrap(orig))
    try:
        yield
    finally:
        if had:
            setattr(obj, name, orig)
        else:
            delattr(obj, name)


@dataclass
class Run:
    """One timed run: outputs, wall and CPU seconds, metadata time and the forwards it covers."""

    outputs: list[list[int]]
    wall_s: float
    cpu_s: float
    metadata_s: float
    steps: int

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


Method = Callable[[Any, list[list[int]], E2ECase], Run]


def _clock(fn: Callable[[], tuple[list[list[int]], float, int]]) -> Run:
    w, c = time.perf_counter(), time.process_time()
    outs, meta, steps = fn()
    return Run(outs, time.perf_counter() - w, time.process_time() - c, meta, steps)


#: one generator per (model, case), built outside the timed runs: an engine builds its pool and
#: KV cache once at start-up, as it loads the model (transformers' paths build nothing lasting).
_GENERATORS: dict[tuple[int, E2ECase], tuple[Any, Any]] = {}


def run_attnpool(model: Any, prompts: list[list[int]], case: E2ECase) -> Run:
    from ..integrations.transformers import PagedGenerator

    key = (id(model), case)
    if key not in _GENERATORS or _GENERATORS[key][0] is not model:
        _GENERATORS[key] = (model, PagedGenerator(
            model, max_bs=case.max_bs, max_context_len=case.hi + case.new_tokens,
            page_size=case.page_size))
    gen = _GENERATORS[key][1]

    def go() -> tuple[list[list[int]], float, int]:
        outs = gen.generate(prompts, max_new_tokens=case.new_tokens)
        st = gen.stats
        return outs, st.metadata_s, st.metadata_calls

    return _clock(go)


def run_hf_generate(model: Any, prompts: list[list[int]], case: E2ECase) -> Run:
    dev = next(model.parameters()).device
    timer = Timer()
    mod = sys.modules[type(model.model).__module__]

    def go() -> tuple[list[list[int]], float, int]:
        outs: list[list[int]] = []
        for s in range(0, len(prompts), case.max_bs):
            chunk = prompts[s : s + case.max_bs]
            width = max(map(len, chunk))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=dev)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                                device=dev)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=case.new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outs += out[:, width:].tolist()
        return outs, timer.seconds, timer.calls

    masks = Timer()
    with torch.no_grad(), _patched(model, "prepare_inputs_for_generation", timer), \
            _patched(mod, "create_causal_mask", masks):
        run = _clock(go)
    run.metadata_s += masks.seconds
    return run


def run_hf_continuous(model: Any, prompts: list[list[int]], case: E2ECase) -> Run:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api

    gc = GenerationConfig(max_new_tokens=case.new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    pages = case.max_bs * -(-(case.hi + case.new_tokens) // case.page_size) + 8
    cbc = ContinuousBatchingConfig(max_requests_per_batch=case.max_bs, page_size=case.page_size,
                                   num_blocks=pages, max_batch_tokens=4 * case.hi)
    timer = Timer()

    def go() -> tuple[list[list[int]], float, int]:
        res = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cbc,
                                   warmup=False)
        outs = [list(res[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
        return outs, timer.seconds, timer.calls

    quiet = logging.getLogger("ContinuousBatchingLogger")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # it logs CPU-only warnings (no psutil, no GPU) per call
    try:
        with _patched(continuous_api.ContinuousBatchProcessor, "prepare_next_batch", timer):
            return _clock(go)
    finally:
        quiet.setLevel(level)


METHODS: dict[str, Method] = {
    "attnpool": run_attnpool,
    "hf-continuous-batching": run_hf_continuous,
    "hf-generate": run_hf_generate,
}


@dataclass
class Summary:
    method: str
    runs: list[Run] = field(default_factory=list)

    @property
    def best(self) -> Run:
        return min(self.runs, key=lambda r: r.wall_s)

    def as_dict(self, reference: list[list[int]] | None) -> dict[str, Any]:
        b = self.best
        same = None if reference is None else sum(
            o == r for o, r in zip(b.outputs, reference, strict=True))
        return {
            "method": self.method, "tokens": b.tokens, "rounds": len(self.runs),
            "wall_s_best": b.wall_s, "tokens_per_s_best": b.tokens / b.wall_s,
            "tokens_per_s_median": statistics.median(r.tokens / r.wall_s for r in self.runs),
            "cpu_s_best": min(r.cpu_s for r in self.runs),
            "cpu_tokens_per_s_best": b.tokens / min(r.cpu_s for r in self.runs),
            "metadata_us_per_step": 1e6 * b.metadata_s / b.steps if b.steps else None,
            "steps": b.steps, "same_tokens_as_hf_generate": same,
        }


def run_e2e(case: E2ECase, device: torch.device, rounds: int = ROUNDS,
            methods: Sequence[str] = tuple(METHODS), progress: bool = True) -> dict[str, Any]:
    """Warm up every method, then ``rounds`` interleaved timed runs; a JSON-able report."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        model = tiny_model(case, device)
        prompts = make_prompts(case)
        sums = {m: Summary(m) for m in methods}
        for m in methods:  # warm-up (first-call allocations, lazy imports)
            METHODS[m](model, prompts[: min(2, len(prompts))], case)
        for r in range(rounds):
            for m in methods:
                if progress:
                    print(f"  e2e round {r + 1}/{rounds}: {m}", file=sys.stderr, flush=True)
                sums[m].runs.append(METHODS[m](model, prompts, case))
    finally:
        torch.set_num_threads(threads)
    ref = sums["hf-generate"].best.outputs if "hf-generate" in sums else None
    import transformers

    info = machine_info(device) | {"transformers": transformers.__version__,
                                   "threads": 1 if device.type == "cpu" else threads}
    return {"machine": info, "case": vars(case) | {"dtype": "float32"},
            "results": [s.as_dict(ref) for s in sums.values()]}


def format_e2e(rep: dict[str, Any]) -> str:
    """A Markdown table of the report, with the case and machine above it."""
    c = rep["case"]
    head = (f"e2e: {c['name']} float32, {c['prompts']} prompts of {c['lo']}-{c['hi']} tokens, "
            f"{c['new_tokens']} new tokens each, max_bs {c['max_bs']}, page {c['page_size']}\n"
            f"machine: {json.dumps(rep['machine'])}")
    rows = ["| method | tokens/s (best) | tokens/s (median) | CPU s (best) | metadata per "
            "forward | forwards | same tokens as hf-generate |", "|---|---|---|---|---|---|---|"]
    for r in rep["results"]:
        meta = r["metadata_us_per_step"]
        rows.append(f"| {r['method']} | {r['tokens_per_s_best']:.0f} | "
                    f"{r['tokens_per_s_median']:.0f} | {r['cpu_s_best']:.2f} | "
                    f"{'-' if meta is None else f'{meta:.0f} us'} | {r['steps']} | "
                    f"{r['same_tokens_as_hf_generate']}/{c['prompts']} |")
    return head + "\n" + "\n".join(rows)


def run_cli(quick: bool, json_path: str | None, device: str) -> int:
    """``attnpool bench --e2e``: needs the ``hf`` extra (transformers >= 5)."""
    if importlib.util.find_spec("transformers") is None:
        print("attnpool bench --e2e needs transformers: pip install 'attnpool[hf]'",
              file=sys.stderr)
        return 2
    rep = run_e2e(QUICK if quick else FULL, device_of(device), rounds=ROUNDS)
    rep["quick"] = quick
    print(format_e2e(rep))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=2)
    return 0

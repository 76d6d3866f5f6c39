"""``attnpool bench --e2e``: a real transformers model generating, three ways, in one run.

Same model, same prompts, same greedy settings (a :class:`Workload`): a tiny random Llama built
from a config (:class:`E2ECase`, never downloaded), or a local checkpoint
(``--model``, :mod:`attnpool.tools.bench_e2e_model`):

* ``attnpool``: :class:`attnpool.integrations.transformers.PagedGenerator` (continuous batching,
  paged KV cache and metadata from a pool; SDPA adapter on CPU, CUDA graphs on a GPU).
* ``hf-continuous-batching``: transformers' own continuous batching (``model.generate_batch``
  with its paged cache; it refuses custom attention names, so it runs its own path).
* ``hf-generate``: ``model.generate`` on left-padded batches of ``max_bs`` prompts with a
  ``DynamicCache`` (static batching: a batch runs until its longest request is done; rows that
  ended at the end-of-sequence token keep being computed until then).

With an end-of-sequence token every method stops a request at it (kept in the output, as
``generate`` keeps it): each output is cut after its first one before the comparison.

Every method runs once to warm up, then ``rounds`` times, interleaved (a, b, c, a, b, c, ...) so
machine load hits all of them alike. Reported: new tokens per second of wall-clock time (best
round and median), CPU seconds of the best round (``time.process_time``: insensitive to waiting
for a core on a shared machine), and the metadata-preparation host time per forward, measured
where each method prepares its attention inputs:

* ``attnpool``: page/slot bookkeeping, the step's input tensors, the pool's ``update_``, the KV
  slot mapping and the SDPA gather plan (:class:`~attnpool.integrations.transformers.GenerationStats`).
* ``hf-generate``: ``prepare_inputs_for_generation`` plus the model's ``create_causal_mask``
  (timed by wrapping them for the run).
* ``hf-continuous-batching``: ``ContinuousBatchProcessor.prepare_next_batch`` (scheduling, block
  tables and batch tensors; timed by wrapping it).

CPU runs of the tiny cases use one intra-op thread for every method: the ops are small and, on a
shared machine, an op that wakes a second thread waits for it whenever the other core is busy.
A checkpoint's matrix products are large enough for more: it runs at both counts.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ceil_div
from .bench import device_of, machine_info
from .words import plural, span


@dataclass(frozen=True)
class Workload:
    """What one comparison runs: prompts, greedy settings, the batch limit.

    ``eos``: the end-of-sequence token every method stops a request at (None: every request
    runs to ``new_tokens``). ``about``: one line for the report (how the prompts were made).
    """

    name: str
    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int
    max_bs: int
    page_size: int = 16
    eos: int | None = None
    about: str = ""

    @property
    def context(self) -> int:
        """The longest request: prompt + new tokens (the generators are sized by it)."""
        return max(map(len, self.prompts)) + self.new_tokens

    def lists(self) -> list[list[int]]:
        return [list(p) for p in self.prompts]

    def describe(self) -> dict[str, Any]:
        lens = [len(p) for p in self.prompts]
        return {"name": self.name, "prompts": len(lens), "lo": min(lens), "hi": max(lens),
                "new_tokens": self.new_tokens, "max_bs": self.max_bs,
                "page_size": self.page_size, "eos": self.eos, "about": self.about}


@dataclass(frozen=True)
class E2ECase:
    """A tiny random model and its workload. Prompt lengths are uniform in ``[lo, hi]``
    (seeded)."""

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

    def workload(self, seed: int = 0) -> Workload:
        from ..integrations.transformers.tiny import random_prompts  # imports transformers

        ps = random_prompts(self.prompts, self.lo, self.hi, self.vocab, seed)
        return Workload(self.name, tuple(map(tuple, ps)), self.new_tokens, self.max_bs,
                        self.page_size, about=f"random token ids, lengths uniform in "
                        f"[{self.lo}, {self.hi}]")


FULL = E2ECase("llama-l4-h256-gqa8:2", layers=4, hidden=256, heads=8, kv_heads=2,
               intermediate=512, vocab=2048, prompts=32, lo=8, hi=256, new_tokens=64, max_bs=8)
QUICK = E2ECase("llama-l2-h64-gqa4:2", layers=2, hidden=64, heads=4, kv_heads=2,
                intermediate=128, vocab=256, prompts=8, lo=1, hi=40, new_tokens=12, max_bs=4)
ROUNDS = 5


def tiny_model(case: E2ECase, device: torch.device, dtype: torch.dtype = torch.float32,
               seed: int = 0) -> Any:
    """A random Llama of ``case``'s sizes
    (:func:`attnpool.integrations.transformers.tiny.tiny_llama`)."""
    from ..integrations.transformers.tiny import tiny_llama

    return tiny_llama(layers=case.layers, hidden=case.hidden, heads=case.heads,
                      kv_heads=case.kv_heads, intermediate=case.intermediate, vocab=case.vocab,
                      max_positions=case.hi + case.new_tokens + 8, device=device, dtype=dtype,
                      seed=seed)


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
def patched(obj: Any, name: str, timer: Timer) -> Iterator[None]:
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


Method = Callable[[Any, Workload], Run]


def _clock(fn: Callable[[], tuple[list[list[int]], float, int]]) -> Run:
    w, c = time.perf_counter(), time.process_time()
    outs, meta, steps = fn()
    return Run(outs, time.perf_counter() - w, time.process_time() - c, meta, steps)


def cut(out: list[int], eos: int | None) -> list[int]:
    """``out`` up to and including its first ``eos`` (what every method returns for it)."""
    return out[: out.index(eos) + 1] if eos is not None and eos in out else out


#: one generator per (model, sizes), built outside the timed runs: an engine builds its pool and
#: KV cache once at start-up, as it loads the model (transformers' paths build nothing lasting).
_GENERATORS: dict[tuple[int, int, int, int], tuple[Any, Any]] = {}


def generator(model: Any, wl: Workload) -> Any:
    """The :class:`~attnpool.integrations.transformers.PagedGenerator` of ``model`` sized for
    ``wl`` (built once, reused by every round)."""
    from ..integrations.transformers import PagedGenerator

    key = (id(model), wl.max_bs, wl.context, wl.page_size)
    if key not in _GENERATORS or _GENERATORS[key][0] is not model:
        _GENERATORS[key] = (model, PagedGenerator(
            model, max_bs=wl.max_bs, max_context_len=wl.context, page_size=wl.page_size))
    return _GENERATORS[key][1]


def run_attnpool(model: Any, wl: Workload) -> Run:
    gen = generator(model, wl)

    def go() -> tuple[list[list[int]], float, int]:
        outs = gen.generate(wl.lists(), max_new_tokens=wl.new_tokens, eos_token_id=wl.eos)
        st = gen.stats
        return outs, st.metadata_s, st.metadata_calls

    return _clock(go)


def run_hf_generate(model: Any, wl: Workload, streamer: Any = None) -> Run:
    """``model.generate`` in left-padded batches of ``max_bs`` (``streamer``: generate's own,
    e.g. a progress counter)."""
    dev = next(model.parameters()).device
    timer = Timer()
    mod = sys.modules[type(model.model).__module__]
    prompts, pad = wl.lists(), 0 if wl.eos is None else wl.eos

    def go() -> tuple[list[list[int]], float, int]:
        outs: list[list[int]] = []
        for s in range(0, len(prompts), wl.max_bs):
            chunk = prompts[s : s + wl.max_bs]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=dev)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk],
                                device=dev)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=wl.new_tokens,
                                 do_sample=False, pad_token_id=pad, eos_token_id=wl.eos,
                                 streamer=streamer)
            outs += [cut(o, wl.eos) for o in out[:, width:].tolist()]
        return outs, timer.seconds, timer.calls

    masks = Timer()
    with torch.no_grad(), patched(model, "prepare_inputs_for_generation", timer), \
            patched(mod, "create_causal_mask", masks):
        run = _clock(go)
    run.metadata_s += masks.seconds
    return run


def run_hf_continuous(model: Any, wl: Workload) -> Run:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api

    gc = GenerationConfig(max_new_tokens=wl.new_tokens, do_sample=False, eos_token_id=wl.eos,
                          pad_token_id=0 if wl.eos is None else wl.eos)
    pages = wl.max_bs * ceil_div(wl.context, wl.page_size) + 8
    hi = max(map(len, wl.prompts))
    # transformers 5.24 names the page size page_size; earlier 5.x releases (5.17 among them)
    # take block_size or neither: pass it under the name the config takes, and say when none
    params = inspect.signature(ContinuousBatchingConfig).parameters
    key = next((k for k in ("page_size", "block_size") if k in params), None)
    size = {} if key is None else {key: wl.page_size}
    if key is None:
        print(f"note: this transformers' ContinuousBatchingConfig takes no page size; "
              f"generate_batch runs with its own, not {wl.page_size}", file=sys.stderr)
    cbc = ContinuousBatchingConfig(max_requests_per_batch=wl.max_bs, num_blocks=pages,
                                   max_batch_tokens=4 * hi, **size)
    timer = Timer()

    def go() -> tuple[list[list[int]], float, int]:
        res = model.generate_batch(wl.lists(), generation_config=gc,
                                   continuous_batching_config=cbc, warmup=False)
        outs = [cut(list(res[f"req_{i}"].generated_tokens), wl.eos)
                for i in range(len(wl.prompts))]
        return outs, timer.seconds, timer.calls

    quiet = logging.getLogger("ContinuousBatchingLogger")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # it logs CPU-only warnings (no psutil, no GPU) per call
    try:
        with patched(continuous_api.ContinuousBatchProcessor, "prepare_next_batch", timer):
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
            "tokens_per_s_each": [r.tokens / r.wall_s for r in self.runs],
            "cpu_s_best": min(r.cpu_s for r in self.runs),
            "cpu_tokens_per_s_best": b.tokens / min(r.cpu_s for r in self.runs),
            "metadata_us_per_step": 1e6 * b.metadata_s / b.steps if b.steps else None,
            "steps": b.steps, "same_tokens_as_hf_generate": same,
        }


@contextlib.contextmanager
def threads_set(device: torch.device, n: int | None) -> Iterator[int]:
    """``torch.set_num_threads(n)`` for a CPU run (``None``: leave the count), restored after;
    yields the count in force."""
    before = torch.get_num_threads()
    if device.type == "cpu" and n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def run_workload(model: Any, wl: Workload, rounds: int = ROUNDS,
                 methods: Sequence[str] = tuple(METHODS), progress: bool = True,
                 warmup: Workload | None = None) -> list[dict[str, Any]]:
    """Warm up every method (on ``warmup``, default: ``wl``'s first two prompts), then
    ``rounds`` interleaved timed runs of ``wl``; one result dict per method."""
    sums = {m: Summary(m) for m in methods}
    small = warmup or Workload(wl.name, wl.prompts[:2], wl.new_tokens, wl.max_bs, wl.page_size,
                               wl.eos)
    for m in methods:  # warm-up (first-call allocations, lazy imports)
        METHODS[m](model, small)
    for r in range(rounds):
        for m in methods:
            if progress:
                print(f"  e2e {wl.name} round {r + 1}/{rounds}: {m}", file=sys.stderr,
                      flush=True)
            sums[m].runs.append(METHODS[m](model, wl))
    ref = sums["hf-generate"].best.outputs if "hf-generate" in sums else None
    return [s.as_dict(ref) for s in sums.values()]


def run_e2e(case: E2ECase, device: torch.device, rounds: int = ROUNDS,
            methods: Sequence[str] = tuple(METHODS), progress: bool = True) -> dict[str, Any]:
    """The tiny random model of ``case``: warm-up, then ``rounds`` interleaved timed runs of
    every method; a JSON-able report."""
    with threads_set(device, 1) as threads:
        model = tiny_model(case, device)
        results = run_workload(model, case.workload(), rounds, methods, progress)
    import transformers

    info = machine_info(device) | {"transformers": transformers.__version__,
                                   "threads": threads}
    return {"machine": info, "case": vars(case) | {"dtype": "float32"}, "results": results}


def results_table(results: list[dict[str, Any]], prompts: int) -> str:
    """The Markdown table of one workload's results."""
    rows = ["| method | tokens/s (best) | tokens/s (median) | CPU s (best) | metadata per "
            "forward | forwards | same tokens as hf-generate |", "|---|---|---|---|---|---|---|"]
    for r in results:
        meta = r["metadata_us_per_step"]
        rows.append(f"| {r['method']} | {r['tokens_per_s_best']:.0f} | "
                    f"{r['tokens_per_s_median']:.0f} | {r['cpu_s_best']:.2f} | "
                    f"{'-' if meta is None else f'{meta:.0f} us'} | {r['steps']} | "
                    f"{r['same_tokens_as_hf_generate']}/{prompts} |")
    return "\n".join(rows)


def format_e2e(rep: dict[str, Any]) -> str:
    """A Markdown table of the report, with the case and machine above it."""
    c = rep["case"]
    head = (f"e2e: {c['name']} float32, {plural(c['prompts'], 'prompt')} of "
            f"{span((c['lo'], c['hi']), 'token')}, {plural(c['new_tokens'], 'new token')} each, "
            f"max_bs {c['max_bs']}, page {c['page_size']}\n"
            f"machine: {json.dumps(rep['machine'])}")
    return head + "\n" + results_table(rep["results"], c["prompts"])


def run_cli(quick: bool, json_path: str | None, device: str) -> int:
    """``attnpool bench --e2e``: needs the ``hf`` extra (transformers >= 5). With ``--model``
    the command line runs :func:`attnpool.tools.bench_e2e_model.run_model_cli` instead."""
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

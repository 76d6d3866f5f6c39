"""``attnpool bench --e2e --model M``: a trained checkpoint, the three methods of
:mod:`attnpool.tools.bench_e2e`, two workloads, two thread counts, in one run.

Workloads (float32, greedy, ``max_bs = 8``, page size 16):

* **equal**: 8 plain-text prompts of 32 tokens each (windows of one passage), 64 new tokens, no
  end-of-sequence token: every request runs every step, so continuous batching has nothing to
  reorder and the comparison is the cost of a step.
* **chat**: the 16 questions of :data:`attnpool.tools.checkpoint.QUESTIONS` through the chat
  template, up to 128 new tokens, stopping at the model's end-of-turn token: answers end at
  different steps, more prompts than ``max_bs``. Static batching keeps computing a finished row
  until its batch's longest answer ends; continuous batching fills the row with the next prompt.

Each runs at one intra-op thread and at the default count (``torch.get_num_threads()`` at
start). After the timed rounds, one more run of ``attnpool`` and of ``hf-generate`` is
instrumented to show where a decode step's time goes (:func:`breakdown`); the timers cost a
little, so those runs are not among the timed ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .bench import device_of, machine_info
from .bench_e2e import (
    METHODS,
    Timer,
    Workload,
    patched,
    results_table,
    run_workload,
    threads_set,
)
from .checkpoint import QUESTIONS, Loaded, equal_prompts, load, note, prompts_of
from .words import plural, span

#: Timed rounds per method (after one warm-up run).
ROUNDS = 3


def workloads(loaded: Loaded, quick: bool = False) -> list[Workload]:
    """The equal-length and the chat workload of the module docstring (``quick``: smaller)."""
    n, length, new_eq = (4, 16, 16) if quick else (8, 32, 64)
    equal = Workload("equal", tuple(map(tuple, equal_prompts(loaded, n, length))), new_eq,
                     max_bs=n,
                     about=f"{plural(n, 'plain-text prompt')} of {plural(length, 'token')}, no EOS")
    qs = QUESTIONS[:6] if quick else QUESTIONS
    chat = Workload("chat", tuple(map(tuple, prompts_of(loaded, qs))), 32 if quick else 128,
                    max_bs=4 if quick else 8, eos=loaded.eos,
                    about=f"{plural(len(qs), 'chat-template question')}, stop at token {loaded.eos}")
    return [equal, chat]


# ---- where a decode step's time goes -----------------------------------------------------------
class _Parts:
    """Host time per category, split by phase: decode forwards (told apart by the attnpool view,
    or by transformers' one-token decode inputs) and the rest."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.decoding = False
        self.steps = 0
        self.rows = 0  # rows the decode forwards computed, all steps together

    def add(self, key: str, dt: float) -> None:
        k = ("d:" if self.decoding else "p:") + key
        self.t[k] = self.t.get(k, 0.0) + dt

    def get(self, key: str) -> float:
        return self.t.get(key, 0.0)

    def timed(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(key, time.perf_counter() - t0)

        return call

    def per_step(self, step_s: float, metadata_s: float, mask_s: float = 0.0) -> dict[str, float]:
        """Microseconds per decode step: ``step`` = ``metadata`` (host preparation of the
        attention inputs; ``mask_s`` of it inside the forward) + ``attention`` + ``kv_store`` +
        ``rest_of_model`` (the forward's other layers: projections, MLPs, norms, LM head) +
        ``other`` (choosing the token, reading it back, the loop)."""
        n = max(1, self.steps)
        fwd, att, kv = self.get("d:forward"), self.get("d:attention"), self.get("d:kv_store")
        us = {"step": step_s, "metadata": metadata_s, "attention": att, "kv_store": kv,
              "rest_of_model": fwd - att - kv - mask_s,
              "other": step_s - fwd - (metadata_s - mask_s)}
        return {k: 1e6 * v / n for k, v in us.items()} | {"decode_steps": float(self.steps),
                                                          "rows": self.rows / n}


@contextlib.contextmanager
def _forward_timer(model: Any, parts: _Parts, is_decode: Callable[[dict[str, Any]], bool]
                   ) -> Iterator[None]:
    """Time every forward of ``model`` into ``parts``, tagged decode or not."""
    orig = model.forward

    @functools.wraps(orig)  # generate reads the forward's signature (logits_to_keep)
    def fwd(*a: Any, **k: Any) -> Any:
        parts.decoding = is_decode(k)
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            parts.add("forward", time.perf_counter() - t0)
            parts.decoding = False

    model.forward = fwd
    try:
        yield
    finally:
        del model.forward  # the class's method again


@contextlib.contextmanager
def _set(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name = value`` for the duration; an attribute ``obj`` did not hold itself (a
    method of its class) is deleted again, not shadowed."""
    own = name in vars(obj)
    orig = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, orig)
        else:
            delattr(obj, name)


def _attnpool_parts(model: Any, wl: Workload) -> dict[str, float]:
    from ..integrations.transformers.attention import StepContext
    from ..integrations.transformers.runner import ModelRunner
    from ..views import DecodeView
    from .bench_e2e import generator

    gen, parts = generator(model, wl), _Parts()
    orig_ctx, orig_decode = ModelRunner.context, gen._decode
    step, meta = Timer(), Timer()

    def context(self: ModelRunner, view: object, num_q: int, *a: Any, **k: Any
                ) -> StepContext:
        c = orig_ctx(self, view, num_q, *a, **k)  # whatever options the runner takes
        return dataclasses.replace(c, run=parts.timed("attention", c.run),
                                   store=parts.timed("kv_store", c.store))

    def decode(running: list[Any]) -> None:
        parts.steps += 1
        parts.rows += len(running)
        m0, t0 = gen.stats.metadata_s, time.perf_counter()
        orig_decode(running)
        step.seconds += time.perf_counter() - t0
        meta.seconds += gen.stats.metadata_s - m0

    def is_decode(k: dict[str, Any]) -> bool:
        return isinstance(getattr(k.get("attnpool"), "view", None), DecodeView)

    with _forward_timer(model, parts, is_decode), _set(ModelRunner, "context", context), \
            _set(gen, "_decode", decode):
        gen.generate(wl.lists(), wl.new_tokens, eos_token_id=wl.eos)
    return parts.per_step(step.seconds, meta.seconds)


def _hf_parts(model: Any, wl: Workload) -> dict[str, float]:
    from transformers import cache_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parts, mod = _Parts(), sys.modules[type(model.model).__module__]
    impl = model.config._attn_implementation
    attn, prep = ALL_ATTENTION_FUNCTIONS[impl], Timer()

    def is_decode(k: dict[str, Any]) -> bool:
        ids, cache = k.get("input_ids"), k.get("cache", k.get("past_key_values"))
        if ids is None or cache is None or not cache.get_seq_length():
            return False  # a prefill: nothing cached yet (a one-token prompt included)
        parts.steps += 1
        parts.rows += ids.shape[0]  # every row of the batch, those that already ended included
        return True

    t0 = time.perf_counter()
    with _forward_timer(model, parts, is_decode), \
            _set(cache_utils.DynamicLayer, "update",
                 parts.timed("kv_store", cache_utils.DynamicLayer.update)), \
            _set(mod, "create_causal_mask", parts.timed("mask", mod.create_causal_mask)), \
            patched(model, "prepare_inputs_for_generation", prep):
        ALL_ATTENTION_FUNCTIONS[impl] = parts.timed("attention", attn)
        try:
            METHODS["hf-generate"](model, wl)
        finally:
            ALL_ATTENTION_FUNCTIONS[impl] = attn
    total = time.perf_counter() - t0
    per_prep = prep.seconds / max(1, prep.calls)
    prefills = prep.calls - parts.steps
    # a decode step: the run less its prefill forwards and their input preparation
    step = total - parts.get("p:forward") - prefills * per_prep
    mask = parts.get("d:mask")
    return parts.per_step(step, parts.steps * per_prep + mask, mask)


def breakdown(model: Any, wl: Workload) -> dict[str, dict[str, float]]:
    """Per decode step of one instrumented run of ``attnpool`` and of ``hf-generate``
    (microseconds): see :meth:`_Parts.per_step`."""
    return {"attnpool": _attnpool_parts(model, wl), "hf-generate": _hf_parts(model, wl)}


PARTS = ("step", "metadata", "attention", "kv_store", "rest_of_model", "other")


def breakdown_table(b: dict[str, dict[str, float]]) -> str:
    rows = ["| per decode step | " + " | ".join(b) + " |", "|---|" + "---|" * len(b)]
    for p in PARTS:
        rows.append(f"| {p} | " + " | ".join(f"{v[p] / 1e3:.1f} ms" for v in b.values()) + " |")
    rows.append("| decode steps | " + " | ".join(f"{v['decode_steps']:.0f}"
                                                  for v in b.values()) + " |")
    rows.append("| rows computed per step | " + " | ".join(f"{v['rows']:.1f}"
                                                            for v in b.values()) + " |")
    return "\n".join(rows)


def _ratios(results: list[dict[str, Any]]) -> str:
    """attnpool's tokens/s over each other method's: best rounds, medians, CPU seconds, and the
    median of the per-round ratios (each round runs every method back to back, so a round's
    ratio sees one state of a shared machine: load that comes and goes moves both sides)."""
    by = {r["method"]: r for r in results}
    a = by["attnpool"]
    out = []
    for other in ("hf-generate", "hf-continuous-batching"):
        if other in by:
            o = by[other]
            paired = statistics.median(x / y for x, y in zip(
                a["tokens_per_s_each"], o["tokens_per_s_each"], strict=True))
            out.append(f"attnpool / {other}: {a['tokens_per_s_best'] / o['tokens_per_s_best']:.2f}x "
                       f"(best rounds), {a['tokens_per_s_median'] / o['tokens_per_s_median']:.2f}x "
                       f"(medians), {paired:.2f}x (median of the rounds' ratios), "
                       f"{o['cpu_s_best'] / a['cpu_s_best']:.2f}x (CPU s)")
    return "\n".join(out)


def run_model(loaded: Loaded, device: torch.device, quick: bool = False,
              rounds: int = ROUNDS, thread_counts: tuple[int | None, ...] = (1, None),
              on_run: Callable[[dict[str, Any]], None] | None = None,
              only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every workload (``only``: those named, e.g. ``("equal",)``, to rerun one while the
    machine is quiet) at every thread count (None: the default count): timed rounds, then the
    breakdown; a JSON-able report. ``on_run`` sees each workload's entry as soon as it is done
    (the command line prints it: the whole run takes many minutes)."""
    import transformers

    info = machine_info(device) | {"transformers": transformers.__version__}
    runs: list[dict[str, Any]] = []
    rep = {"machine": info, "model": loaded.name, "dtype": "float32", "rounds": rounds,
           "runs": runs}
    for n in thread_counts:
        with threads_set(device, n) as threads:
            for wl in workloads(loaded, quick):
                if only is not None and wl.name not in only:
                    continue
                note(f"e2e {loaded.name}: workload {wl.name}, {plural(threads, 'thread')}")
                load0 = _load()
                res = run_workload(loaded.model, wl, rounds)
                run = {"workload": wl.describe(), "threads": threads, "results": res,
                       "breakdown": breakdown(loaded.model, wl),
                       "load_average": {"start": load0, "end": _load()}}
                runs.append(run)
                if on_run is not None:
                    on_run(run)
    return rep


def _load() -> list[float] | None:
    """The 1, 5 and 15-minute load averages (None where the OS has none): on a shared machine
    they say how much other work ran beside a measurement."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def format_head(rep: dict[str, Any]) -> str:
    return (f"e2e: {rep['model']} {rep['dtype']}, greedy, {plural(rep['rounds'], 'timed round')}\n"
            f"machine: {json.dumps(rep['machine'])}")


def format_run(r: dict[str, Any]) -> str:
    """One workload at one thread count as Markdown: the results, the speed ratios and the
    decode-step breakdown."""
    w, load = r["workload"], r.get("load_average")
    seen = f"; load average {load['start']} -> {load['end']}" if load else ""
    return (f"\n### {w['name']}, {plural(r['threads'], 'thread')}: {w['about']}; "
            f"{plural(w['prompts'], 'prompt')} of {span((w['lo'], w['hi']), 'token')}, up to "
            f"{plural(w['new_tokens'], 'new token')}, max_bs "
            f"{w['max_bs']}, page {w['page_size']}{seen}\n\n"
            f"{results_table(r['results'], w['prompts'])}"
            f"\n\n{_ratios(r['results'])}\n\n{breakdown_table(r['breakdown'])}")


def run_model_cli(model: str, quick: bool, json_path: str | None, device: str) -> int:
    """``attnpool bench --e2e --model M`` (``--quick``: smaller workloads, one round)."""
    dev = device_of(device)
    loaded = load(model, dev)
    rep = run_model(loaded, dev, quick, rounds=1 if quick else ROUNDS,
                    on_run=lambda r: print(format_run(r), flush=True))
    print(f"\n{format_head(rep)}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rep, f, indent=2)
    return 0

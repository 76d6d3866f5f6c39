"""Speculative decoding inside SGLang's CPU engine: attnpool's verify / draft / draft-extend
refills beside SGLang's own CPU path (``intel_amx``), in one run.

Run in the SGLang environment (``.ci/sglang`` builds one)::

    python benchmarks/sglang_spec_cost.py [--runs STANDALONE-1,EAGLE-2,NGRAM] [--rounds 3]
    python benchmarks/sglang_spec_cost.py --model smollm2 --runs NGRAM

The models, engine arguments and prompts are the speculative tests' (:mod:`tests.helpers.
sglang_spec`: a tiny random Llama target with drafts derived from it, float32, greedy, page 1,
``disable_cuda_graph``); ``--model smollm2`` makes the target SmolLM2-135M-Instruct (30 layers,
float32, chat prompts; NGRAM only, there being no draft model for it), where each forward's
fixed costs weigh less against its layers than in a 2-layer model. Each round starts one
fresh engine process per path, in alternating order (SGLang's own, attnpool, attnpool, SGLang's
own, ...), warms it up, then times
``Engine.generate`` for 1 request and for 8 requests (``--new`` tokens each, EOS ignored) and
reads the host time of each path's attention-backend metadata per forward, by forward kind:

- ``target_verify``: the target's verify batch (attnpool: ``pool.verify``'s refill; SGLang:
  ``IntelAMXAttnBackend._build_extend_metadata`` and its logits scratch);
- ``draft_decode``: one call for all the draft model's decode steps (attnpool: ``pool.draft``;
  SGLang: ``IntelAMXMultiStepDraftBackend``: the expanded request table of
  ``build_draft_decode_metadata_cpu`` plus a scratch per step);
- ``draft_extend_v2``: the draft model's pass over the accepted tokens (attnpool:
  ``pool.draft_extend``);

in microseconds and as a ratio to one small torch op (``torch.add`` of two 8-element tensors)
timed in the same process. The tree itself (``build_tree_kernel_efficient``) is built by the
speculative worker before either backend is called, the same on both paths, so it is not in
either column. SGLang's CPU ops run here as the test stand-ins of
``tests/helpers/sglang_cpu/sgl_kernel`` (pure torch, no C++ kernel): its ``draft_decode``
column times ``build_draft_decode_metadata_cpu``'s stand-in, not SGLang's compiled op. Prints
tokens/s per path and batch (median of the rounds; attnpool / own), whether the tokens are the
same as SGLang's own path's, and the accepted drafts of each; then the layers' host time per
call by forward kind (K/V store and attention: attnpool's SDPA over the pool, SGLang's the
stand-in kernels; ``decode`` is the draft model's steps), and the whole backend's host time
(metadata and layers) per generated token: the part of a step the two paths differ in, which
tokens/s, dominated here by the same model and stand-in speculative ops on both, dilutes.

The metadata calls are timed by ``tests/helpers/sglang_cpu/sitecustomize.py``
(``ATTNPOOL_SGLANG_TIMES``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_unit import small_op_s
from benchmarks.sglang_bench import model_prompts

from tests.helpers import sglang_engine as se
from tests.helpers import sglang_spec as ss

#: the two paths: SGLang's own CPU speculative path, and attnpool's backend
OWN, OURS = "intel_amx", se.NAME
KINDS = ("target_verify", "draft_decode", "draft_extend_v2")


def _read(times: Path) -> dict[str, list[float]]:
    return json.loads(times.read_text()) if times.exists() else {}


def _target(model: str, models: Path) -> tuple[Path, dict[str, Path], list[list[int]]]:
    """The target's folder, the drafts' folders and the prompts of ``--model``: the tests'
    tiny Llama (2 layers) and its drafts, or SmolLM2-135M-Instruct (30 layers, float32; no
    draft model: NGRAM only) with chat prompts."""
    if model == "smollm2":
        folder, prompts = model_prompts("smollm2")
        return folder, {}, prompts
    paths = ss.save_models(models)
    return paths["target"], paths, ss.prompts()


def worker(models: Path, name: str, backend: str, new: int, times: Path, model: str = "tiny"
           ) -> dict[str, Any]:
    """One engine of run ``name`` on ``backend``: a warm-up, then 1 and 8 requests timed."""
    import sglang

    target, paths, prompts = _target(model, models)
    args = {**se.BASE, **ss.COMMON, **ss.RUNS[name], "log_level": "error",
            "attention_backend": backend}
    draft = args.get("speculative_draft_model_path")
    if draft is not None:
        args["speculative_draft_model_path"] = str(paths[draft])
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    engine = sglang.Engine(model_path=str(target), **args)
    out: dict[str, Any] = {}
    try:
        engine.generate(input_ids=prompts[:2], sampling_params=params | {"max_new_tokens": 4})
        for label, batch in (("1", prompts[-1:]), ("8", prompts[-8:])):
            before = _read(times)
            t = time.perf_counter()
            got = engine.generate(input_ids=batch, sampling_params=params)
            dt = time.perf_counter() - t
            after = _read(times)
            spent = {k: [c - before.get(k, [0, 0.0])[0], s - before.get(k, [0, 0.0])[1]]
                     for k, (c, s) in after.items()}
            out[label] = {"s": dt, "tokens": [g["output_ids"] for g in got],
                          "accepted": sum(g["meta_info"].get("spec_num_correct_drafts", 0)
                                          for g in got),
                          "host": {k: v for k, v in spent.items() if v[0]}}
    finally:
        engine.shutdown()
    return out


def _per_call(runs: list[dict[str, Any]], label: str, kind: str, part: str = "metadata"
              ) -> float | None:
    """Median over rounds of one kind's ``part`` (``metadata`` or ``attention``, the layers'
    K/V store and attention) seconds per call (every batch size)."""
    per = []
    for run in runs:
        calls = secs = 0.0
        for key, (c, s) in run[label]["host"].items():
            what, k, _ = key.split(" ")
            if what == part and k == kind:
                calls, secs = calls + c, secs + s
        if calls:
            per.append(secs / calls)
    return statistics.median(per) if per else None


def _backend_per_token(runs: list[dict[str, Any]], label: str) -> float:
    """Median over rounds of the attention backend's host seconds (metadata and attention, every
    forward kind) per generated token."""
    return statistics.median(
        sum(s for _, s in run[label]["host"].values())
        / sum(len(t) for t in run[label]["tokens"]) for run in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="STANDALONE-1,EAGLE-2,NGRAM",
                    help=f"comma-separated, of {', '.join(k for k in ss.RUNS if '-' in k)}, "
                         "NGRAM")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                    help="the target: the tests' tiny Llama, or SmolLM2 (NGRAM only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--worker", nargs=4, metavar=("MODELS", "RUN", "BACKEND", "OUT"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        models, name, backend, out = a.worker
        res = worker(Path(models), name, backend, a.new, Path(out + ".times"), a.model)
        Path(out).write_text(json.dumps(res))
        return 0
    names = a.runs.split(",")
    for name in names:
        if name not in ss.RUNS or not ss.RUNS[name].get("speculative_algorithm"):
            ap.error(f"--runs: {name!r} is not a speculative run of tests.helpers.sglang_spec")
        if a.model != "tiny" and ss.RUNS[name].get("speculative_draft_model_path"):
            ap.error(f"--runs: {name} needs a draft model; --model {a.model} runs NGRAM only")
    tmp = Path(tempfile.mkdtemp())
    _target(a.model, tmp / "models")  # (made once, before the engines start)
    unit = small_op_s()
    print(f"{a.rounds} rounds, {a.new} new tokens per request; "
          f"one small torch op = {unit * 1e6:.2f} us")
    for name in names:
        runs: dict[str, list[dict[str, Any]]] = {OWN: [], OURS: []}
        for r in range(a.rounds):
            for backend in ([OWN, OURS] if r % 2 == 0 else [OURS, OWN]):
                out = tmp / f"{name}-{backend}-{r}.json"
                env = ss.env(amx=backend == OWN, ATTNPOOL_SGLANG_TIMES=str(out) + ".times")
                subprocess.run([sys.executable, __file__, "--new", str(a.new), "--model",
                                a.model, "--worker",
                                str(tmp / "models"), name, backend, str(out)],
                               env=env, check=True, stdout=subprocess.DEVNULL, cwd=se.ROOT)
                runs[backend].append(json.loads(out.read_text()))
        for label in ("1", "8"):
            rate = {b: statistics.median(sum(len(t) for t in run[label]["tokens"]) / run[label]["s"]
                                         for run in rs) for b, rs in runs.items()}
            same = all(run[label]["tokens"] == runs[OWN][0][label]["tokens"]
                       for rs in runs.values() for run in rs)
            accepted = {b: sorted({run[label]["accepted"] for run in rs}) for b, rs in runs.items()}
            cells, layers = [], []
            for kind in KINDS:
                own, ours = (_per_call(runs[b], label, kind) for b in (OWN, OURS))
                if own is None or ours is None:
                    continue
                cells.append(f"{kind} {ours * 1e6:.0f} vs {own * 1e6:.0f} us "
                             f"({ours / unit:.0f} vs {own / unit:.0f} ops, {ours / own:.2f}x)")
            for kind in ("decode", *KINDS):
                own, ours = (_per_call(runs[b], label, kind, "attention") for b in (OWN, OURS))
                if own is not None and ours is not None:
                    layers.append(f"{kind} {ours * 1e6:.0f} vs {own * 1e6:.0f} us "
                                  f"({ours / own:.2f}x)")
            per_tok = {b: _backend_per_token(rs, label) for b, rs in runs.items()}
            print(f"{name}, {label} request(s): attnpool {rate[OURS]:.1f} vs own "
                  f"{rate[OWN]:.1f} tok/s ({rate[OURS] / rate[OWN]:.2f}x); same tokens: {same}; "
                  f"accepted drafts attnpool {accepted[OURS]} own {accepted[OWN]}")
            print(f"    metadata per call, attnpool vs own: {'; '.join(cells)}")
            print(f"    attention per layer call (K/V store included), attnpool vs own: "
                  f"{'; '.join(layers)}")
            print(f"    backend host time per generated token, attnpool vs own: "
                  f"{per_tok[OURS] * 1e6:.0f} vs {per_tok[OWN] * 1e6:.0f} us "
                  f"({per_tok[OURS] / per_tok[OWN]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

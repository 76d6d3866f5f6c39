"""SGLang's ``torch_native`` attention backend against attnpool's, in one run (CPU, float32,
greedy).

Run in the SGLang environment (``.ci/sglang`` builds one)::

    python benchmarks/sglang_bench.py [--model smollm2|llama] [--rounds 3] [--new 48]

Each round starts a fresh engine process per backend, in alternating order (native, attnpool,
attnpool, native, ...), warms it up and then times ``Engine.generate`` for 1 request and for 8
requests (SmolLM2: chat prompts of 30-40 tokens; ``--new`` tokens each, EOS ignored). Prints
tokens/s per backend and batch, the median of the rounds and attnpool / native, whether the
tokens are the same, and each backend's host time per decode forward: its
``init_forward_metadata`` and its layers' K/V store and attention (``forward_decode`` of every
layer), in microseconds and as a ratio to one small torch op (``torch.add`` of two 8-element
tensors) timed in the same process. The scheduler's metadata calls are timed by
``tests/helpers/sglang_cpu/sitecustomize.py`` (``ATTNPOOL_SGLANG_TIMES``).
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

from tests.helpers import sglang_engine as se

ROOT = se.ROOT

QUESTIONS = ("What is the capital of France?", "Name three primary colours.",
             "Write one sentence about the sea.", "What is 12 times 12?", "Who wrote Hamlet?",
             "Give me a synonym for happy.", "What colour is the sky on a clear day?",
             "Count from one to five.")


def model_prompts(name: str) -> tuple[Path, list[list[int]]]:
    """The model's folder and the 8 prompts: SmolLM2 (float32) with chat prompts, or a tiny
    random model of the tests (``tests.helpers.tiny_models``) with prompts of 40-180 tokens."""
    if name == "smollm2":
        from transformers import AutoTokenizer

        from attnpool.tools.vllm_folder import float32_folder

        folder = float32_folder("smollm2")
        tok = AutoTokenizer.from_pretrained(folder)
        return folder, [list(tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False)) for q in QUESTIONS]
    from tests.helpers.tiny_models import prompts, save_tiny

    path = save_tiny(name, Path(tempfile.gettempdir()) / "attnpool-sglang-bench")
    ids = prompts(lengths=(40, 60, 80, 100, 120, 140, 160, 180), shared=0)
    return path, [p["prompt_token_ids"] for p in ids]


def worker(model: Path, backend: str, prompts: list[list[int]], new: int, times: Path
           ) -> dict[str, Any]:
    """One engine of ``backend``: warm-up, then 1 request and 8 requests timed."""
    import sglang

    engine = sglang.Engine(model_path=str(model), attention_backend=backend,
                           **(se.BASE | {"log_level": "error", "max_total_tokens": 8192}))
    params = {"temperature": 0.0, "max_new_tokens": new, "ignore_eos": True}
    out: dict[str, Any] = {}
    try:
        engine.generate(input_ids=prompts[:2], sampling_params=params | {"max_new_tokens": 4})
        for label, batch in (("1", prompts[:1]), ("8", prompts)):
            before = json.loads(times.read_text())
            t = time.perf_counter()
            got = engine.generate(input_ids=batch, sampling_params=params)
            dt = time.perf_counter() - t
            after = json.loads(times.read_text())
            spent = {k: [c - before.get(k, [0, 0.0])[0], s - before.get(k, [0, 0.0])[1]]
                     for k, (c, s) in after.items()}
            out[label] = {"s": dt, "tokens": [g["output_ids"] for g in got],
                          "host": {k: v for k, v in spent.items() if v[0]}}
    finally:
        engine.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--worker", nargs=4, metavar=("MODEL", "BACKEND", "PROMPTS", "OUT"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        model, backend, prompts, out = a.worker
        times = Path(out + ".times")
        res = worker(Path(model), backend, json.loads(Path(prompts).read_text()), a.new, times)
        Path(out).write_text(json.dumps(res))
        return 0
    model, prompts = model_prompts(a.model)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    runs: dict[str, list[dict[str, Any]]] = {"torch_native": [], se.NAME: []}
    for r in range(a.rounds):
        order = ["torch_native", se.NAME] if r % 2 == 0 else [se.NAME, "torch_native"]
        for backend in order:
            out = tmp / f"{backend}-{r}.json"
            env = se.env(ATTNPOOL_SGLANG_TIMES=str(out) + ".times")
            subprocess.run([sys.executable, __file__, "--new", str(a.new), "--worker",
                            str(model), backend, str(tmp / "prompts.json"), str(out)],
                           env=env, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
            runs[backend].append(json.loads(out.read_text()))
    unit = small_op_s()
    print(f"model {a.model}, {a.rounds} rounds, {a.new} new tokens per request; "
          f"one small torch op = {unit * 1e6:.2f} us")
    for label in ("1", "8"):
        rate = {b: [sum(len(t) for t in run[label]["tokens"]) / run[label]["s"] for run in rs]
                for b, rs in runs.items()}
        same = all(run[label]["tokens"] == runs["torch_native"][0][label]["tokens"]
                   for rs in runs.values() for run in rs)
        med = {b: statistics.median(v) for b, v in rate.items()}
        print(f"{label} request(s): " + ", ".join(
            f"{b} {med[b]:.1f} tok/s (rounds {', '.join(f'{x:.1f}' for x in v)})"
            for b, v in rate.items())
            + f"; attnpool / native {med[se.NAME] / med['torch_native']:.2f}x; "
            f"same tokens: {same}")
        for b, rs in runs.items():
            per: dict[str, list[float]] = {}  # seconds per forward, by what and batch
            for run in rs:
                host = run[label]["host"]
                for key, (calls, secs) in host.items():
                    batch = key.split(" ", 1)[1]
                    forwards = host.get(f"metadata {batch}", [calls])[0]
                    per.setdefault(key, []).append(secs / forwards)
            cells = ", ".join(f"{k}: {statistics.median(v) * 1e6:.0f} us "
                              f"({statistics.median(v) / unit:.0f} ops)"
                              for k, v in sorted(per.items()) if "decode" in k)
            print(f"    {b}, per decode forward (metadata; attention: K/V store and "
                  f"attention of every layer): {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM's engine start with attnpool's backend against its own, each in a fresh process.

Run in the vLLM environment (``.ci/vllm`` builds one)::

    python benchmarks/vllm_start.py [--rounds 3] [--model smollm2]

Each round starts one engine per backend, alternating which goes first, each in its own
process (``LLM(...)``, eager, the benchmarks' engine arguments), and times the constructor
alone: what a user waits for before the first request. attnpool adds its pools (one
``torch.empty`` per KV-cache group), the views of every batch size (``prepare_views``) and
the load of its C step, built at install time: nothing compiles at start. Prints every
round's seconds, both medians and their difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import os, sys, time, json
sys.path.insert(0, {root!r})
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from tests.helpers import vllm_engine as ve
path = {path!r}
with ve.attnpool_backend({ours}):
    from vllm import LLM
    t = time.perf_counter()
    llm = LLM(model=path, **ve.engine_args(enforce_eager=True, max_model_len=1024,
                                           max_num_seqs=8))
    dt = time.perf_counter() - t
print("START", json.dumps(dt))
"""


def _model(name: str) -> str:
    if name == "smollm2":
        from attnpool.tools.vllm_folder import float32_folder

        return str(float32_folder("smollm2"))
    sys.path.insert(0, str(ROOT))
    from tests.helpers import vllm_engine as ve

    return str(ve.save_tiny(name, Path("/tmp/attnpool-vllm-bench")))


def _start(path: str, ours: bool) -> float:
    code = _CHILD.format(root=str(ROOT), path=path, ours=ours)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=900, check=False, env={**os.environ})
    lines = [x for x in done.stdout.splitlines() if x.startswith("START ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the engine did not start:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return float(json.loads(lines[-1].split(" ", 1)[1]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2")
    a = ap.parse_args()
    path = _model(a.model)
    times: dict[str, list[float]] = {"native": [], "attnpool": []}
    for r in range(a.rounds):
        order = ["native", "attnpool"] if r % 2 == 0 else ["attnpool", "native"]
        for name in order:
            times[name].append(_start(path, name == "attnpool"))
            print(f"round {r + 1}: {name} {times[name][-1]:.2f} s", flush=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"| model | rounds | native start s (median) | attnpool start s (median) | "
          f"difference s |\n|---|---|---|---|---|\n| {a.model} | {a.rounds} | "
          f"{med['native']:.2f} | {med['attnpool']:.2f} | "
          f"{med['attnpool'] - med['native']:+.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

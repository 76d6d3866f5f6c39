"""What LoRA metadata costs: attnpool's arena beside each engine's own path, in one run.

Run in the engine's environment (``.ci/vllm`` / ``.ci/sglang`` build them)::

    .venv-vllm/bin/python benchmarks/lora_cost.py --engine vllm [--rounds 2] [--new 32]
    .venv-sglang/bin/python benchmarks/lora_cost.py --engine sglang [--rounds 2] [--new 32]

**Host time per step.** The engine's own LoRA metadata step and attnpool's, fed the same steps
in one process, alternating which goes first, each call timed with ``time.perf_counter``:
vLLM's ``PunicaWrapperCPU.update_metadata`` against
:class:`attnpool.integrations.vllm.lora.AttnpoolPunicaWrapperCPU`'s; SGLang's ``torch_native``
``prepare_lora_batch`` against :class:`attnpool.integrations.sglang.lora.AttnpoolLoRABackend`'s.
Steps as the engines make them for 1 and 8 requests (base, adapter a, adapter b in turn):
``decode`` (one token per request) and ``prefill`` (prompts of 20-120 tokens). Each side's
figure is position-balanced: the mean of its median when it ran first and its median when it
ran second. Printed in microseconds and in small torch ops (``torch.add`` of two 8-element
tensors, timed in the same process), with attnpool / engine.

**End to end.** Tokens/s of ``generate`` with LoRA (the rows above: 1 request on adapter a, 8
requests over base, a, b; prompts of 20-120 tokens, ``--new`` tokens each, EOS ignored, greedy,
float32, CPU), a tiny random Llama with two adapters on ``q_proj`` / ``v_proj``. Each round
starts one fresh engine process per side, in alternating order, warms it up and times each
workload ``--repeat`` times (their median); the median of the rounds per side, attnpool /
engine, and whether the tokens are the same. SGLang's CPU engine runs with the test
stand-ins (``tests/helpers/sglang_cpu``: its CPU kernel and ``ATTNPOOL_SGLANG_NO_PIN=1``) and
``attention_backend="torch_native"``; its ``torch_native`` LoRA module's ``torch`` is the
stand-in's proxy in the host-time part too (it pins otherwise), which adds a little to that
side's figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_unit import small_op_s

ROOT = Path(__file__).resolve().parents[1]
REQUESTS = (1, 8)
ADAPTERS: tuple[str | None, ...] = (None, "a", "b")
SLOTS, RANK, VOCAB = 3, 8, 512


def _lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(20, 121) for _ in range(n)]


def _which(n: int) -> list[str | None]:
    """The adapter of each of ``n`` requests: adapter a alone, else base, a, b in turn."""
    return ["a"] if n == 1 else [ADAPTERS[i % 3] for i in range(n)]


def _balanced(first: list[float], second: list[float]) -> float:
    return (statistics.median(first) + statistics.median(second)) / 2


def _pairs(steps: list[Any], engine: Callable[[Any], None], ours: Callable[[Any], None],
           reps: int) -> tuple[float, float]:
    """Both sides over ``steps`` ``reps`` times, alternating; balanced seconds per call."""
    t: dict[str, list[list[float]]] = {"engine": [[], []], "ours": [[], []]}
    turn = 0
    for _ in range(reps):
        for s in steps:
            turn ^= 1
            order = (("engine", engine), ("ours", ours)) if turn else (("ours", ours),
                                                                     ("engine", engine))
            for pos, (name, f) in enumerate(order):
                t0 = time.perf_counter()
                f(s)
                t[name][pos].append(time.perf_counter() - t0)
    return _balanced(*t["engine"]), _balanced(*t["ours"])


# ---- host time per step ------------------------------------------------------------------------
def host_vllm(reps: int) -> dict[str, tuple[float, float]]:
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from attnpool.integrations.vllm.lora import AttnpoolPunicaWrapperCPU

    cfg = types.SimpleNamespace(max_loras=SLOTS, max_lora_rank=RANK)
    native = PunicaWrapperCPU(2048, 64, "cpu", lora_config=cfg)
    ours = AttnpoolPunicaWrapperCPU(2048, 64, "cpu", lora_config=cfg)
    ids = {None: 0, "a": 1, "b": 2}
    table: list[int | None] = [1, 2, None]
    out = {}
    for n in REQUESTS:
        w = [ids[a] for a in _which(n)]
        for kind in ("decode", "prefill"):
            lens = [1] * n if kind == "decode" else _lengths(n, n)
            tok = tuple(i for i, k in zip(w, lens, strict=True) for _ in range(k))
            m = LoRAMapping(index_mapping=tok, prompt_mapping=tuple(w),
                            is_prefill=kind == "prefill")
            out[f"{kind} {n}"] = _pairs(
                [m], lambda m: native.update_metadata(m, table, SLOTS + 1, VOCAB),
                lambda m: ours.update_metadata(m, table, SLOTS + 1, VOCAB), reps)
    return out


def host_sglang(reps: int) -> dict[str, tuple[float, float]]:
    import torch
    from sglang.srt.lora.backend import torch_backend
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from attnpool.integrations.sglang.lora import AttnpoolLoRABackend

    from tests.helpers.sglang_cpu import no_pin

    no_pin.unpin_module(torch_backend)  # (its pinned tensors: refused without CUDA)
    args = types.SimpleNamespace(max_lora_rank=RANK, max_running_requests=64,
                                 chunked_prefill_size=2048, max_prefill_tokens=2048,
                                 context_length=None)
    dev = torch.device("cpu")
    native = TorchNativeLoRABackend(SLOTS, dev, server_args=args)
    ours = AttnpoolLoRABackend(SLOTS, dev, server_args=args)
    slot = {None: 0, "a": 1, "b": 2}
    ranks, scal = [0, 8, 4], [0.0, 2.0, 2.0]
    out = {}
    for n in REQUESTS:
        w = [slot[a] for a in _which(n)]
        for kind in ("decode", "prefill"):
            if kind == "decode":
                fb = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=n)
            else:
                lens = _lengths(n, n)
                fb = types.SimpleNamespace(
                    forward_mode=ForwardMode.EXTEND, batch_size=n, extend_seq_lens_cpu=lens,
                    extend_seq_lens=torch.tensor(lens, dtype=torch.int32))
            out[f"{kind} {n}"] = _pairs(
                [fb], lambda fb, w=w: native.prepare_lora_batch(fb, w, ranks, scal, False),
                lambda fb, w=w: ours.prepare_lora_batch(fb, w, ranks, scal, False), reps)
    return out


# ---- end to end --------------------------------------------------------------------------------
def _rows(n: int) -> list[tuple[list[int], str | None]]:
    rng = random.Random(100 + n)
    return [([rng.randrange(1, 500) for _ in range(k)], a)
            for k, a in zip(_lengths(n, 50 + n), _which(n), strict=True)]


def child(engine: str, attnpool: bool, spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: one engine, warmed up, each workload timed once."""
    got: dict[str, Any] = {}
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        from tests.helpers.vllm_engine import engine_args

        llm = LLM(model=spec["model"], **engine_args(
            enable_lora=True, max_lora_rank=RANK, max_loras=SLOTS, max_num_seqs=16,
            max_num_batched_tokens=1024))
        ids = {"a": 1, "b": 2}
        sp = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True)

        def gen(rows: list[tuple[list[int], str | None]]) -> list[list[int]]:
            lora = [None if a is None else LoRARequest(a, ids[a], spec["adapters"][a])
                    for _, a in rows]
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in rows], sp,
                                lora_request=lora, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        import sglang

        from tests.helpers import sglang_engine as se

        eng = sglang.Engine(model_path=spec["model"], lora_backend=se.NAME if attnpool
                            else "torch_native", attention_backend="torch_native",
                            lora_paths=[{"lora_name": k, "lora_path": v}
                                        for k, v in sorted(spec["adapters"].items())],
                            max_loras_per_batch=SLOTS, max_lora_rank=RANK,
                            max_running_requests=16, **se.BASE)
        params = {"temperature": 0.0, "max_new_tokens": spec["new"], "ignore_eos": True}

        def gen(rows: list[tuple[list[int], str | None]]) -> list[list[int]]:
            outs = eng.generate(input_ids=[p for p, _ in rows], sampling_params=params,
                                lora_path=[a for _, a in rows])
            return [list(o["output_ids"]) for o in outs]
    try:
        gen(_rows(8))  # warm-up
        for n in REQUESTS:
            rows = _rows(n)
            times, tokens = [], []
            for _ in range(spec["repeat"]):
                t = time.perf_counter()
                tokens = gen(rows)
                times.append(time.perf_counter() - t)
            got[str(n)] = {"tok_s": sum(map(len, tokens)) / statistics.median(times),
                           "tokens": tokens}
    finally:
        if engine == "sglang":
            eng.shutdown()
    return got


def e2e(engine: str, rounds: int, new: int, repeat: int) -> dict[str, Any]:
    from tests.helpers import vllm_lora as vl
    from tests.helpers.tiny_models import save_tiny

    root = Path(tempfile.mkdtemp(prefix="lora_cost_"))
    model = save_tiny("llama", root)
    adapters = vl.save_adapters(model, root)
    spec = {"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()},
            "new": new, "repeat": repeat}
    if engine == "sglang":
        from tests.helpers import sglang_lora as sl

        env = sl.env()
    else:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_CPU_OMP_THREADS_BIND="nobind")
    runs: dict[str, list[dict[str, Any]]] = {"engine": [], "attnpool": []}
    for r in range(rounds):
        for side in (("engine", "attnpool") if r % 2 == 0 else ("attnpool", "engine")):
            e = dict(env, ATTNPOOL_VLLM="1" if side == "attnpool" else "0")
            out = subprocess.run([sys.executable, __file__, "--child", engine, "--attnpool",
                                  str(int(side == "attnpool")), "--spec", json.dumps(spec)],
                                 cwd=ROOT, env=e, capture_output=True, text=True, check=False)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
            if out.returncode or not lines:
                raise RuntimeError(f"{engine} {side} run failed:\n{out.stderr[-3000:]}")
            runs[side].append(json.loads(lines[-1][len("RESULT"):]))
    res: dict[str, Any] = {}
    for n in map(str, REQUESTS):
        eng = statistics.median(x[n]["tok_s"] for x in runs["engine"])
        ours = statistics.median(x[n]["tok_s"] for x in runs["attnpool"])
        same = all(x[n]["tokens"] == runs["engine"][0][n]["tokens"]
                   for x in runs["engine"] + runs["attnpool"])
        res[n] = (eng, ours, same, [round(x[n]["tok_s"], 1) for x in runs["engine"]],
                  [round(x[n]["tok_s"], 1) for x in runs["attnpool"]])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=("vllm", "sglang"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="timed generate calls per workload "
                    "and engine process (their median)")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--child", choices=("vllm", "sglang"))
    ap.add_argument("--attnpool", type=int, default=0)
    ap.add_argument("--spec")
    a = ap.parse_args()
    if a.child:
        print("RESULT" + json.dumps(child(a.child, bool(a.attnpool), json.loads(a.spec))))
        return
    if a.engine is None:
        ap.error("--engine is required")
    unit = small_op_s()
    own = "update_metadata" if a.engine == "vllm" else "torch_native prepare_lora_batch"
    host = host_vllm(a.reps) if a.engine == "vllm" else host_sglang(a.reps)
    print(f"{a.engine}: LoRA metadata host time per step (small op = {unit * 1e6:.2f} us)")
    print(f"  {'step':<12}{own:>34}{'attnpool':>22}{'ratio':>8}")
    for k, (eng, ours) in host.items():
        print(f"  {k:<12}{eng * 1e6:>14.1f} us {eng / unit:>8.1f} ops"
              f"{ours * 1e6:>11.1f} us {ours / unit:>6.1f} ops{ours / eng:>8.2f}")
    if a.skip_e2e:
        return
    res = e2e(a.engine, a.rounds, a.new, a.repeat)
    print(f"{a.engine}: end to end with LoRA, tokens/s (median of {a.rounds} rounds of "
          f"{a.repeat} calls, {a.new} new tokens each)")
    for n, (eng, ours, same, eng_rounds, our_rounds) in res.items():
        print(f"  {n} request(s): engine {eng:8.1f}  attnpool {ours:8.1f}  ratio "
              f"{ours / eng:5.2f}  same tokens: {same}  (rounds: engine {eng_rounds}, "
              f"attnpool {our_rounds})")


if __name__ == "__main__":
    main()

"""vLLM's native CPU attention backend against attnpool's, in one run (float32, greedy).

Run in the vLLM environment (``.ci/vllm`` builds one)::

    python benchmarks/vllm_bench.py [--model smollm2|llama] [--rounds 2] [--compiled] [--long]

Prints, per engine mode (eager, and compiled with ``--compiled``) and batch (1 request, 8
requests), the tokens/s of ``LLM.generate`` for each variant (``--variants``: vLLM's native
backend; attnpool's with vLLM's CPU kernel over the pool's buffers; attnpool's with its torch
paths), rounds interleaved (native, kernel, torch, native, ...), and whether each gave the
native tokens. Each round starts one engine per variant and times ``--repeats`` calls of
``generate`` per batch on it (after a warm-up call), its median being the round's figure: one
call of a few seconds on a shared machine is one draw of its load, and the rounds' engines
start anew (compiled mode compiles each). The best ratio is the best rounds' ratio, the
median ratio the ratio of the rounds' medians, and the paired ratio the median of each round's
own ratio (attnpool's engine over the native one started just before it, so a load that moves
over minutes weighs on both sides of each ratio). Then the host time of the
metadata builder's ``build`` per step, by number of requests in the step, for vLLM's
``CPUAttentionMetadataBuilder.build`` and attnpool's, as microseconds and as a ratio to one
small torch op (``torch.add`` of two 8-element tensors) timed in the same process.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from benchmarks.host_unit import small_op_s

from tests.helpers import vllm_engine as ve

#: per variant (see VARIANTS): num_reqs -> list of seconds
BUILD: dict[str, dict[int, list[float]]] = collections.defaultdict(
    lambda: collections.defaultdict(list))
#: the variant whose engine runs now
RUNNING = ["native"]


def _time_builds() -> None:
    """Wrap both builders' ``build`` to record its host time per step (the engine runs in
    this process: the ``uni`` executor)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from attnpool.integrations.vllm.backend import AttnpoolMetadataBuilder

    for cls in (CPUAttentionMetadataBuilder, AttnpoolMetadataBuilder):
        orig = cls.build

        def build(self: Any, common_prefix_len: int, cm: Any, fast_build: bool = False,
                  _orig: Any = orig) -> Any:
            t = time.perf_counter()
            out = _orig(self, common_prefix_len, cm, fast_build)
            BUILD[RUNNING[0]][cm.num_reqs].append(time.perf_counter() - t)
            return out

        cls.build = build  # type: ignore[method-assign]


def _model(name: str) -> tuple[Path, list[dict[str, list[int]]], list[dict[str, list[int]]]]:
    if name == "smollm2":
        from transformers import AutoTokenizer

        from attnpool.tools.vllm_folder import float32_folder

        folder = float32_folder("smollm2")
        tok = AutoTokenizer.from_pretrained(folder)
        qs = ["What is the capital of France?", "Name three primary colours.",
              "Write one sentence about the sea.", "What is 12 times 12?",
              "Who wrote Hamlet?", "Give me a synonym for happy.",
              "What colour is the sky on a clear day?", "Count from one to five."]
        ids = [{"prompt_token_ids": list(tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
            return_dict=False))} for q in qs]
        return folder, ids[:1], ids
    path = ve.save_tiny(name, Path("/tmp/attnpool-vllm-bench"))
    ids = ve.prompts(lengths=(40, 60, 80, 100, 120, 140, 160, 180), shared=0)
    return path, ids[:1], ids


#: what runs attention in each variant: vLLM's native backend, or attnpool's with vLLM's CPU
#: kernel over the pool's buffers (``kernel``, the default) or attnpool's torch paths (``torch``)
VARIANTS = {"native": None, "kernel": "vllm", "torch": "attnpool"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed generate calls per engine and batch (their median counts)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--long", action="store_true",
                    help="the long-prompt workload instead: 8 prompts of 300-900 tokens, "
                         "max_num_batched_tokens=256 (chunked prefill), --new 32 by default")
    ap.add_argument("--variants", default="native,kernel,torch",
                    help="comma-separated, from " + ", ".join(VARIANTS))
    args = ap.parse_args()
    variants = args.variants.split(",")
    if "native" not in variants or not set(variants) <= set(VARIANTS):
        ap.error(f"--variants must include native and name only {sorted(VARIANTS)}")
    _time_builds()
    path, one, eight = _model(args.model)
    batched = 1024
    if args.long:  # prompts of 300-900 token ids, prefilled in chunks of 256 tokens
        import random

        rng = random.Random(0)
        eight = [{"prompt_token_ids": [rng.randrange(100, 20000)
                                       for _ in range(rng.randint(300, 900))]}
                 for _ in range(8)]
        one, batched = eight[:1], 256
        if args.new == 64:
            args.new = 32
    modes = [True] + ([False] if args.compiled else [])
    rows = []
    from attnpool.integrations.vllm import CPU_KERNEL

    for eager in modes:
        kw = {"enforce_eager": eager, "max_model_len": 1024, "max_num_batched_tokens": batched,
              "max_num_seqs": 8}
        from vllm import LLM, SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
        rates: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
        toks: dict[tuple[str, int], list[list[int]]] = {}
        unstable: set[tuple[str, int]] = set()
        for _ in range(args.rounds):
            for name in variants:
                kernel = VARIANTS[name]
                RUNNING[0] = name
                if kernel is not None:
                    os.environ[CPU_KERNEL] = kernel
                with ve.attnpool_backend(kernel is not None):
                    llm = LLM(model=str(path), **ve.engine_args(**kw))
                    for reqs in (one, eight):
                        llm.generate(reqs[:1], sp, use_tqdm=False)  # warm
                        got = []
                        for _ in range(args.repeats):
                            t = time.perf_counter()
                            outs = llm.generate(reqs, sp, use_tqdm=False)
                            dt = time.perf_counter() - t
                            got.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                            now = [list(o.outputs[0].token_ids) for o in outs]
                            if toks.setdefault((name, len(reqs)), now) != now:
                                unstable.add((name, len(reqs)))  # (not the same twice: a NO)
                        rates[(name, len(reqs))].append(sorted(got)[len(got) // 2])
                    del llm
                    import gc

                    gc.collect()
        for b in (1, len(eight)):
            nat = rates[("native", b)]
            for name in variants[1:] if variants[0] == "native" else variants:
                if name == "native":
                    continue
                ours = rates[(name, b)]
                rows.append((("eager" if eager else "compiled"), name, b, max(nat), max(ours),
                             max(ours) / max(nat), sorted(ours)[len(ours) // 2]
                             / sorted(nat)[len(nat) // 2],
                             sorted(o / n for o, n in zip(ours, nat, strict=True))[len(ours) // 2],
                             toks[("native", b)] == toks[(name, b)]
                             and not {("native", b), (name, b)} & unstable, nat, ours))
    print("| mode | attnpool attends with | batch | native tok/s (best) | attnpool tok/s (best) "
          "| best ratio | median ratio | paired ratio | same tokens |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.2f}x | "
              f"{r[6]:.2f}x | {r[7]:.2f}x | {'yes' if r[8] else 'NO'} |")
    print()
    for r in rows:  # each round's tokens/s, the spread the ratios come from
        print(f"rounds, {r[0]} {r[1]} {r[2]}: native " + " ".join(f"{x:.1f}" for x in r[9])
              + ", attnpool " + " ".join(f"{x:.1f}" for x in r[10]))
    op = small_op_s()
    print(f"\none small torch op (torch.add, 8 elements): {op * 1e6:.2f} us\n")
    print("| requests in the step | variant | steps | build us (median) | in small ops |\n"
          "|---|---|---|---|---|")
    for n in sorted(set.intersection(*(set(BUILD[v]) for v in variants))):
        for v in variants:
            got = sorted(BUILD[v][n])
            med = got[len(got) // 2]
            print(f"| {n} | {v} | {len(got)} | {med * 1e6:.0f} | {med / op:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Command line: ``attnpool plan | demo | bench`` (also ``python -m attnpool ...``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence

from .arena import plan_arena
from .config import Layout, PoolConfig
from .errors import PoolError

_LAYOUTS = {"flash_attn": Layout.FLASH_ATTN, "flashinfer": Layout.FLASHINFER, "both": Layout.BOTH}


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-bs", type=int, default=160, help="largest captured batch size")
    p.add_argument("--context", type=int, default=131072, help="max_context_len in tokens")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--draft-tokens", type=int, default=0, help="num_draft_tokens (N)")
    p.add_argument("--topk", type=int, default=1, help="draft branches per step (K)")
    p.add_argument("--spec-steps", type=int, default=0, help="draft steps per round (S)")
    p.add_argument("--encoder-len", type=int, default=0, help="max_encoder_len")
    p.add_argument("--chunk", type=int, default=None, help="attention_chunk_size")
    p.add_argument("--extend-tokens", type=int, default=0,
                   help="max_extend_tokens (packed prefill tokens per extend step)")
    p.add_argument("--layout", choices=sorted(_LAYOUTS), default="flash_attn")


def _config(a: argparse.Namespace, device: str) -> PoolConfig:
    return PoolConfig(
        max_bs=a.max_bs, max_context_len=a.context, page_size=a.page_size, device=device,
        num_draft_tokens=a.draft_tokens, topk=a.topk, spec_steps=a.spec_steps,
        max_encoder_len=a.encoder_len, attention_chunk_size=a.chunk, layout=_LAYOUTS[a.layout],
        max_extend_tokens=a.extend_tokens,
    )


def _plan(a: argparse.Namespace) -> int:
    plan = plan_arena(_config(a, "cpu"))  # arithmetic only: nothing is allocated
    print(json.dumps(plan.as_dict(), indent=2) if a.json else plan.report())
    return 0


def _demo(a: argparse.Namespace) -> int:
    # the demos pull in more of the library (and transformers); keep `plan` light
    if not a.toy and importlib.util.find_spec("transformers") is not None:
        from .demo_hf import run_hf_demo

        return run_hf_demo(device=a.device, steps=a.steps, seed=a.seed)
    from .demo import run_demo

    return run_demo(device=a.device, steps=a.steps, seed=a.seed)


def _bench(a: argparse.Namespace) -> int:
    if a.e2e:
        from .bench_e2e import run_cli as run_e2e  # needs transformers (the hf extra)

        if a.plot:
            print("attnpool bench: --plot draws the update benchmark, not --e2e", file=sys.stderr)
            return 2
        return run_e2e(quick=a.quick, json_path=a.json, device=a.device)
    if a.host:
        from .bench import device_of
        from .bench_host import run_cli as run_host

        if a.plot or a.json:
            print("attnpool bench: --host prints its table only (no --plot / --json)",
                  file=sys.stderr)
            return 2
        return run_host(device_of(a.device), quick=a.quick)
    from .bench import run_cli  # benchmarks build pools and baselines; keep `plan` light

    return run_cli(quick=a.quick, json_path=a.json, plot_path=a.plot, device=a.device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnpool", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="print the memory plan of a config (allocates nothing)")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(fn=_plan)
    d = sub.add_parser("demo", help="generate with a tiny transformers model through a pool "
                       "(the toy decode loop without transformers, or with --toy)")
    d.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    d.add_argument("--steps", type=int, default=40,
                   help="new tokens per prompt (toy demo: decode steps)")
    d.add_argument("--toy", action="store_true",
                   help="run the toy model's decode loop (no transformers needed)")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="time attnpool against the classic per-buffer baseline")
    b.add_argument("--quick", action="store_true", help="fewer, smaller cases (well under a minute)")
    b.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    b.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw update time vs batch size (needs the 'plot' extra: matplotlib)")
    b.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    b.add_argument("--e2e", action="store_true",
                   help="end to end: PagedGenerator vs transformers' continuous batching vs "
                   "model.generate on a tiny random model (needs the 'hf' extra)")
    b.add_argument("--host", action="store_true",
                   help="host cost per update of every phase, in units of one small torch op "
                   "(fused eager and bound with the launch stubbed, reference, classic)")
    b.set_defaults(fn=_bench)
    a = parser.parse_args(argv)
    try:
        return int(a.fn(a))
    except PoolError as e:
        print(f"attnpool: {e}", file=sys.stderr)
        return 2

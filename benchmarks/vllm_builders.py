"""The refill per step: attnpool's metadata builder against vLLM's own, on the same steps.

Run in the vLLM environment (``.ci/vllm`` builds one)::

    python benchmarks/vllm_builders.py [--models smollm2,mistral] [--rounds 3]

One engine per model runs attnpool's backend (vLLM's CPU kernel over the pool's buffers,
``max_num_seqs=64``, eager). Every KV-cache group's attnpool builder gets a twin: vLLM's own
``CPUAttentionMetadataBuilder``, built with the same arguments (and the group's window, which
vLLM's builder reads from vLLM's own layers). Each step's ``CommonAttentionMetadata`` goes to
both, in alternating order, each timed with ``time.perf_counter``; the engine goes on with
attnpool's metadata. So both builders see the same steps, in the same process, with the same
caches in between (the model's forward). Likewise every attnpool layer gets vLLM's own
``CPUAttentionBackendImpl`` as a twin: each layer's K/V store and attention call run both
(the same kernel and store op writing the same bytes), alternating, timed per call, and
each side's figure is position-balanced the same way as the builders' (the second call of a
pair reads the K/V the first just pulled into the caches).

Workloads: 1 request, 8 requests, 64 requests (prompts of 20-120 tokens, 24 new tokens each,
``max_num_batched_tokens=256`` so that prefill chunks share steps with decode rows). A step is
``decode`` (every row one query) or ``mixed`` (any row more: prefill chunks, with or without
decode rows), and is counted under its workload (the requests of its ``generate`` call: a
mixed step of the 8-request workload may hold 3 of them).

Which builder runs first in a step matters as much as the builders do: the first runs on the
caches the forward left (its work split op alone costs 50-70 us there), the second on what the
first warmed. So each builder's figure is the mean of its two medians, over the steps where it
ran first and over those where it ran second (the order alternates step by step): a
position-balanced median, which a handful of mixed steps cannot tilt by their order. Prints,
per model, step kind and workload, both builders' medians by position, their balanced figures
in microseconds and in small torch ops (``torch.add`` of two 8-element tensors, timed in the
same process), and their ratio.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from benchmarks.host_unit import small_op_s

from tests.helpers import vllm_engine as ve

#: (model, kind, workload) -> [native first, native second, attnpool first, attnpool second]
#: seconds per build (first / second: which builder ran first in the step)
TIMES: dict[tuple[str, str, int], list[list[float]]] = collections.defaultdict(
    lambda: [[], [], [], []])
MODEL = [""]
#: the requests of the ``generate`` call running now (the workload a step is counted under)
WORKLOAD = [0]
#: layer name -> (vLLM's own metadata of the layer's group this step, step kind)
TWIN_MD: dict[str, tuple[Any, str]] = {}
#: (model, kind, "store" | "attention") -> [native first, native second, attnpool first,
#: attnpool second] seconds per layer call (first / second: which ran first in the pair)
LAYER_TIMES: dict[tuple[str, str, str], list[list[float]]] = \
    collections.defaultdict(lambda: [[], [], [], []])
REQUESTS = (1, 8, 64)


def _twin_builders() -> None:
    """Give every attnpool builder vLLM's own builder as a twin, and time both per step."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from attnpool.integrations.vllm.backend import AttnpoolMetadataBuilder

    init, build = AttnpoolMetadataBuilder.__init__, AttnpoolMetadataBuilder.build

    def twin_init(self: Any, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                  device: Any) -> None:
        init(self, kv_cache_spec, layer_names, vllm_config, device)
        twin = CPUAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)
        window = self.filler.sizes.sliding_window
        twin.window_size = -1 if window is None else window  # (vLLM reads its own layers')
        self._twin, self._turn = twin, 0

    def timed_build(self: Any, common_prefix_len: int, cm: Any, fast_build: bool = False
                    ) -> Any:
        kind = "decode" if cm.max_query_len == 1 else "mixed"
        times = TIMES[(MODEL[0], kind, WORKLOAD[0])]
        self._turn ^= 1
        if self._turn:
            t = time.perf_counter()
            twin_md = self._twin.build(common_prefix_len, cm, fast_build)
            t1 = time.perf_counter()
            out = build(self, common_prefix_len, cm, fast_build)
            t2 = time.perf_counter()
            times[0].append(t1 - t)
            times[3].append(t2 - t1)
        else:
            t = time.perf_counter()
            out = build(self, common_prefix_len, cm, fast_build)
            t1 = time.perf_counter()
            twin_md = self._twin.build(common_prefix_len, cm, fast_build)
            t2 = time.perf_counter()
            times[2].append(t1 - t)
            times[1].append(t2 - t1)
        for name in self.layer_names:  # (what each layer's twin reads this step)
            TWIN_MD[name] = (twin_md, kind)
        return out

    AttnpoolMetadataBuilder.__init__ = twin_init  # type: ignore[method-assign]
    AttnpoolMetadataBuilder.build = timed_build  # type: ignore[method-assign,assignment]


def _twin_layers() -> None:
    """Give every attnpool layer vLLM's own ``CPUAttentionBackendImpl`` as a twin (made with
    the same arguments while vLLM builds the model), and time both layers' K/V store and
    attention per call, alternating which goes first. Both write the same bytes (the same
    kernel and store op over the same values), so the engine's output is unchanged."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from attnpool.integrations.vllm.backend import AttnpoolImpl

    init, forward, store = (AttnpoolImpl.__init__, AttnpoolImpl.forward,
                            AttnpoolImpl.do_kv_cache_update)

    def twin_init(self: Any, num_heads: int, head_size: int, scale: float,
                  num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None,
                  sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                  logits_soft_cap: float | None = None, attn_type: str = "decoder",
                  kv_sharing_target_layer_name: str | None = None, sinks: Any = None,
                  **extra: Any) -> None:
        init(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
             kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name, sinks,
             **extra)
        self._twin = CPUAttentionBackendImpl(
            num_heads, head_size, scale, num_heads if num_kv_heads is None else num_kv_heads,
            alibi_slopes, sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
            kv_sharing_target_layer_name, sinks)
        self._turn = {"store": 0, "attention": 0}  # (one per part: a step calls both)

    def timed(label: str, ours: Any, theirs: Any, self: Any, layer: Any) -> Any:
        got = TWIN_MD.get(getattr(layer, "layer_name", ""))
        if got is None:
            return ours()
        times = LAYER_TIMES[(MODEL[0], got[1], label)]
        self._turn[label] ^= 1
        if self._turn[label]:
            t = time.perf_counter()
            theirs(got[0])
            t1 = time.perf_counter()
            out = ours()
            t2 = time.perf_counter()
            times[0].append(t1 - t)
            times[3].append(t2 - t1)
        else:
            t = time.perf_counter()
            out = ours()
            t1 = time.perf_counter()
            theirs(got[0])
            t2 = time.perf_counter()
            times[2].append(t1 - t)
            times[1].append(t2 - t1)
        return out

    def timed_forward(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                      attn_metadata: Any, output: Any, output_scale: Any = None,
                      output_block_scale: Any = None) -> Any:
        if attn_metadata is None:
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, output)
        return timed("attention", lambda: forward(self, layer, query, key, value, kv_cache,
                                                  attn_metadata, output),
                     lambda md: self._twin.forward(layer, query, key, value, kv_cache, md,
                                                   output), self, layer)

    def timed_store(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any,
                    slot_mapping: Any) -> None:
        timed("store", lambda: store(self, layer, key, value, kv_cache, slot_mapping),
              lambda md: self._twin.do_kv_cache_update(layer, key, value, kv_cache,
                                                       slot_mapping), self, layer)

    AttnpoolImpl.__init__ = twin_init  # type: ignore[method-assign]
    AttnpoolImpl.forward = timed_forward  # type: ignore[method-assign]
    AttnpoolImpl.do_kv_cache_update = timed_store  # type: ignore[method-assign]


#: piece -> seconds per call, with ``--pieces`` (:func:`_time_pieces`)
PIECES: dict[str, list[float]] = collections.defaultdict(list)


def _time_pieces() -> None:
    """Wrap the pieces of attnpool's build with ``perf_counter`` (``--pieces``): the pool's
    updates, the Python path of ``host_step`` (a size's first step, or a call the C step
    declines; later ones are one C call, not wrapped), the host route's C step, the work
    split, and a probe of two ``torch.add`` calls and a small list comprehension at the start
    of each build (what the same code costs right after a forward, on cold caches). The
    wrappers cost a little themselves, so the build's own figures come from a run without
    them."""
    import torch

    from attnpool.integrations.vllm import step as step_module
    from attnpool.integrations.vllm.backend import AttnpoolMetadataBuilder
    from attnpool.integrations.vllm.cpu_kernel import CPUKernel
    from attnpool.integrations.vllm.step import StepFiller
    from attnpool.phases.decode import DecodePhase
    from attnpool.phases.extend import ExtendPhase
    from attnpool.phases.host_lane import HostLane

    def wrap(cls: Any, name: str, label: str) -> None:
        orig = getattr(cls, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = orig(*a, **k)
            PIECES[label].append(time.perf_counter() - t)
            return out

        setattr(cls, name, timed)

    for cls, name, label in ((DecodePhase, "_host_step", "pool.decode.host_step's Python path"),
                             (ExtendPhase, "_host_step", "pool.extend.host_step's Python path"),
                             (DecodePhase, "update_", "pool.decode.update_"),
                             (ExtendPhase, "update_", "pool.extend.update_"),
                             (HostLane, "native", "host route: the C step (its checks, "
                                                 "the C call)"),
                             (CPUKernel, "step", "work split (CPUKernel.step)"),
                             (step_module, "query_lens_", "query lengths (query_lens_)"),
                             (StepFiller, "step", "the whole refill (StepFiller.step)")):
        wrap(cls, name, label)
    build = AttnpoolMetadataBuilder.build
    a, b = torch.ones(8), torch.ones(8)

    def probed(self: Any, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        torch.add(a, b)
        t1 = time.perf_counter()
        torch.add(a, b)
        t2 = time.perf_counter()
        _ = [i for i in range(50)]
        t3 = time.perf_counter()
        PIECES["probe: first torch.add"].append(t1 - t0)
        PIECES["probe: second torch.add"].append(t2 - t1)
        PIECES["probe: 50-element list comprehension"].append(t3 - t2)
        return build(self, *args, **kw)

    AttnpoolMetadataBuilder.build = probed  # type: ignore[method-assign]


def _model(name: str) -> Path:
    if name == "smollm2":
        from attnpool.tools.vllm_folder import float32_folder

        return float32_folder("smollm2")
    return ve.save_tiny(name, Path("/tmp/attnpool-vllm-bench"))


def _median(xs: list[float]) -> float:
    """The median (the mean of the middle two of an even count)."""
    ys, k = sorted(xs), len(xs) // 2
    return ys[k] if len(ys) % 2 else (ys[k - 1] + ys[k]) / 2


def _balanced(table: dict[Any, list[list[float]]]
              ) -> Iterator[tuple[Any, list[list[float]], list[float], float, float]]:
    """Per key of ``table`` (sorted) whose lists ``[native first, native second, attnpool
    first, attnpool second]`` all hold a time: the key, the lists, their medians and each
    side's position-balanced figure (the mean of its two medians). A kind seen in one position
    only is left out."""
    for key, times in sorted(table.items()):
        if min(len(t) for t in times) == 0:
            continue
        m = [_median(t) for t in times]
        yield key, times, m, (m[0] + m[1]) / 2, (m[2] + m[3]) / 2


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,mistral")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pieces", action="store_true",
                    help="also time the pieces of attnpool's build (see _time_pieces)")
    args = ap.parse_args()
    if args.pieces:
        _time_pieces()
    _twin_builders()
    _twin_layers()
    from vllm import LLM, SamplingParams

    from attnpool.integrations.vllm import CPU_KERNEL

    os.environ[CPU_KERNEL] = "vllm"
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for name in args.models.split(","):
        MODEL[0] = name
        with ve.attnpool_backend(True):
            llm = LLM(model=str(_model(name)), **ve.engine_args(
                max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=64,
                skip_tokenizer_init=True))
            for _ in range(args.rounds):
                for reqs in REQUESTS:
                    WORKLOAD[0] = reqs
                    prompts = [{"prompt_token_ids": [rng.randrange(1, 400)
                                                     for _ in range(rng.randint(20, 120))]}
                               for _ in range(reqs)]
                    llm.generate(prompts, sp, use_tqdm=False)
            del llm
    op = small_op_s()
    print(f"one small torch op (torch.add, 8 elements): {op * 1e6:.2f} us\n")
    print("| model | step | requests | steps | vLLM's builder us, first / second | attnpool "
          "us, first / second | vLLM's builder us | attnpool us | vLLM's in small ops | "
          "attnpool in small ops | attnpool / vLLM |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, kind, n), times, m, a, b in _balanced(TIMES):
        print(f"| {model} | {kind} | {n} | {sum(len(t) for t in times[:2])} | "
              f"{m[0] * 1e6:.0f} / {m[1] * 1e6:.0f} | {m[2] * 1e6:.0f} / {m[3] * 1e6:.0f} | "
              f"{a * 1e6:.0f} | {b * 1e6:.0f} | {a / op:.0f} | {b / op:.0f} | {b / a:.2f}x |")
    print("\nper layer call (position-balanced medians over every layer of every step):\n\n"
          "| model | step | part | calls | vLLM's impl us, first / second | attnpool us, first "
          "/ second | vLLM's impl us | attnpool us | attnpool / vLLM |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for (model, kind, part), times, m, a, b in _balanced(LAYER_TIMES):
        print(f"| {model} | {kind} | {part} | {len(times[2]) + len(times[3])} | "
              f"{m[0] * 1e6:.1f} / {m[1] * 1e6:.1f} | {m[2] * 1e6:.1f} / {m[3] * 1e6:.1f} | "
              f"{a * 1e6:.1f} | {b * 1e6:.1f} | {b / a:.2f}x |")
    if PIECES:
        print("\npieces of attnpool's build (medians, every model and step; --pieces):\n\n"
              "| piece | calls | us |\n|---|---|---|")
        for label, times in PIECES.items():
            print(f"| {label} | {len(times)} | {_median(times) * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``attnpool demo`` with transformers installed: a model generating through a pool.

With a checkpoint (``--model``, or SmolLM2 when ``attnpool fetch smollm2`` has cached it):
questions go through the model's chat template, :class:`~attnpool.integrations.transformers.
PagedGenerator` answers them all (continuous batching over ``max_bs = 8`` slots, prefill through
``pool.extend``, decode steps through ``pool.decode``, a paged KV cache whose pages return to the
free list as answers end at the end-of-turn token), then ``model.generate`` answers the same
prompts the usual way (left-padded batches of 8). The demo prints each question and answer, the
attention kernel that ran, both speeds, and whether the tokens are identical. Each half runs for
minutes on a small CPU, so stderr shows the tokens generated so far and the rate while it runs
(:class:`~attnpool.tools.progress.TokenProgress`).

Without a checkpoint, a tiny random Llama (GQA, built from a config: nothing is downloaded)
serves a dozen prompts; the demo checks its output against ``model.generate`` run per prompt,
then runs the same prompts with speculative decoding (``pool.draft``, ``pool.verify``,
``pool.draft_extend``) and checks it returns the same tokens. Its tokens are noise: the demo
says how to get the trained model.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..adapters.backends import Backend
from ..config import Layout
from ..errors import InputError
from ..integrations.transformers.tiny import random_prompts, tiny_llama
from . import fetch
from .bench import device_of
from .progress import GenerateCounter, TokenProgress
from .words import numbers, plural, span

#: the model: 2 layers, 4 query / 2 KV heads of 32, vocabulary 512
LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 128, 4, 2, 512
PROMPTS, LONGEST, MAX_BS, PAGE = 12, 60, 4, 16
DRAFT_TOKENS = 3


def kernel_name(backend: Backend, layout: Layout) -> str:
    """What really computes attention in the demo: the resolved backend (never ``AUTO``, so
    never a library that is not installed) and the pool layout it reads."""
    where = f"reading the pool's {layout.name} layout"
    if backend is Backend.FA3:
        return f"flash-attn 3 (flash_attn_interface) {where}"
    if backend is Backend.FA4:
        return f"flash-attn 4 (flash_attn.cute) {where}"
    if backend is Backend.FA2:
        return f"flash-attn 2 (flash_attn) {where}; prefill and draft extend through PyTorch SDPA"
    return f"PyTorch SDPA (attnpool.adapters.sdpa) {where}"


def batch_sizes(sizes: Sequence[int]) -> str:
    """``"batch sizes 1-8"``, or ``"batch size 8"`` when every step ran 8 rows."""
    text = numbers(sizes)
    return f"batch {'size' if text.isdigit() else 'sizes'} {text}"


@contextlib.contextmanager
def counting(gen: Any, progress: TokenProgress) -> Iterator[None]:
    """Feed ``progress`` the tokens a :class:`PagedGenerator` run produces, from a forward hook
    on its target model: every eager forward returns one logits row per token it generates (a
    prefill keeps each new request's last position, a decode step one row per running
    request). A generator that replays CUDA graphs never calls the model's Python forward
    for its decode steps, so there the hook would undercount: no progress is shown (and a GPU
    runs the demo in seconds)."""
    if gen.use_graphs:
        yield
        return
    hook = gen.target.model.register_forward_hook(
        lambda _m, _a, out: progress.add(int(out.logits.shape[-2])))
    try:
        yield
    finally:
        hook.remove()
        progress.close()


#: Questions the demo asks a checkpoint by default (``--prompt`` replaces them).
DEMO_QUESTIONS = 8
#: New tokens per prompt: the tiny model's, and the most a checkpoint's answer gets (the
#: command line's help names the same two: ``cli.DEMO_STEPS``, ``cli.DEMO_STEPS_CHECKPOINT``).
TINY_STEPS, CHECKPOINT_STEPS = 40, 128
#: Requests decoded together with a checkpoint.
CHECKPOINT_BS = 8


def run_hf_demo(device: str = "auto", steps: int | None = None, seed: int = 0,
                model: str | None = None, questions: Sequence[str] | None = None) -> int:
    """The checkpoint demo when there is one (``model``, else the cached SmolLM2), else the
    tiny random model's; returns 0, or 1 when a check fails."""
    dev = device_of(device)
    if model is None and fetch.cached("smollm2") is not None:
        model = "smollm2"
    if model is not None:
        return run_checkpoint_demo(model, dev, steps or CHECKPOINT_STEPS, questions)
    if questions:
        raise InputError("--prompt needs a trained model: fetch one with `python -m attnpool "
                         "fetch smollm2` (or pass --model PATH)")
    print("no trained checkpoint is cached, so this runs a tiny random model (its tokens are "
          "noise). For a trained one: python -m attnpool fetch smollm2, then python -m "
          "attnpool demo")
    return run_tiny_demo(dev, steps or TINY_STEPS, seed)


def run_checkpoint_demo(model: str, dev: torch.device, steps: int,
                        questions: Sequence[str] | None = None) -> int:
    """Answer ``questions`` (default: the first :data:`DEMO_QUESTIONS` of
    :data:`attnpool.tools.checkpoint.QUESTIONS`) with a checkpoint, through attnpool and
    through ``model.generate``; 0 when the tokens are identical, else 1."""
    from ..integrations.transformers import PagedGenerator
    from .bench_e2e import Workload, run_hf_generate
    from .checkpoint import QUESTIONS, load, note, prompts_of

    for i, q in enumerate(questions or ()):
        if not q.strip():
            raise InputError(f"--prompt {i + 1} is empty: expected a question")
    loaded = load(model, dev)
    qs = list(questions or QUESTIONS[:DEMO_QUESTIONS])
    prompts = prompts_of(loaded, qs)
    cfg, tok = loaded.model.config, loaded.tokenizer
    bs = min(CHECKPOINT_BS, len(prompts))
    kind = "chat prompt" if loaded.chat else "text prompt"
    print(f"attnpool demo (transformers) on {dev}: {loaded.name}, {cfg.num_hidden_layers} "
          f"layers, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, "
          f"float32, {plural(torch.get_num_threads(), 'thread')}; "
          f"{plural(len(prompts), kind)} of {span(map(len, prompts), 'token')}, up to "
          f"{plural(steps, 'new token')}, "
          f"{'no end token' if loaded.eos is None else f'stop at token {loaded.eos}'}, "
          f"max_bs={bs}, page_size={PAGE}")
    wl = Workload("demo", tuple(map(tuple, prompts)), steps, bs, PAGE, loaded.eos)
    # at least one page: a short question with few --steps is still a valid run
    gen = PagedGenerator(loaded.model, max_bs=bs, max_context_len=max(wl.context, PAGE),
                         page_size=PAGE)
    print(f"attention: {kernel_name(gen.target.backend, gen.pool.cfg.layout)}")
    warm = Workload("warm-up", wl.prompts[:1], 2, 1, PAGE, loaded.eos)
    gen.generate(wl.lists()[:1], 2)  # first-call allocations, for both methods alike
    run_hf_generate(loaded.model, warm)
    most = len(prompts) * steps
    note(f"answering {plural(len(prompts), 'prompt')} through attnpool (PagedGenerator) ...")
    with counting(gen, TokenProgress("attnpool", most)):
        out = gen.generate(wl.lists(), steps, eos_token_id=loaded.eos)
    st = gen.stats
    groups = plural(-(-len(prompts) // bs), "left-padded batch", "left-padded batches")
    upto = "" if len(prompts) % bs == 0 else "up to "
    note(f"answering them again with model.generate ({groups} of {upto}"
         f"{plural(bs, 'prompt')}) ...")
    hf = TokenProgress("model.generate", most)
    ref = run_hf_generate(loaded.model, wl, streamer=GenerateCounter(hf, loaded.eos))
    hf.close()
    for i, (q, o) in enumerate(zip(qs, out, strict=True)):
        text = tok.decode(o, skip_special_tokens=True).strip()
        print(f"\nQ{i + 1}: {q}\nA{i + 1}: {text}")
    same = [a == b for a, b in zip(out, ref.outputs, strict=True)]
    hf_tps = ref.tokens / ref.wall_s
    print(f"\nattnpool (PagedGenerator): {st.tokens_per_s:.1f} tokens/s "
          f"({plural(st.new_tokens, 'token')} in {st.wall_s:.2f}s, "
          f"{plural(st.decode_steps, 'decode step')} + {plural(st.prefill_forwards, 'prefill')}, "
          f"{batch_sizes(st.batch_sizes)}, metadata {st.metadata_us_per_step:.0f} us per forward)")
    print(f"model.generate (batched): {hf_tps:.1f} tokens/s ({plural(ref.tokens, 'token')} in "
          f"{ref.wall_s:.2f}s); attnpool / generate = {st.tokens_per_s / hf_tps:.2f}x")
    if all(same):
        print(f"tokens identical to model.generate (do_sample=False): {len(same)}/"
              f"{plural(len(same), 'prompt')}")
        return 0
    bad = [i + 1 for i, ok in enumerate(same) if not ok]
    print(f"tokens identical to model.generate: {sum(same)}/{plural(len(same), 'prompt')}; "
          f"{'answer' if len(bad) == 1 else 'answers'} {bad} "
          f"{'differs' if len(bad) == 1 else 'differ'} (float32: a near-tie of two logits can "
          "resolve either way)")
    return 1


def run_tiny_demo(dev: torch.device, steps: int = TINY_STEPS, seed: int = 0) -> int:
    """Generate ``steps`` new tokens per prompt with the tiny random model; returns 0, or exits
    when a check fails."""
    from ..integrations.transformers import PagedGenerator

    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # tiny tensors: extra threads only contend (see demo.py)
    try:
        new = max(1, steps)
        ctx = LONGEST + new
        model = tiny_llama(layers=LAYERS, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                           intermediate=2 * HIDDEN, vocab=VOCAB, max_positions=ctx, device=dev,
                           seed=seed)
        prompts = random_prompts(PROMPTS, 1, LONGEST, VOCAB, seed=seed)
        print(f"attnpool demo (transformers) on {dev}: random Llama, {LAYERS} layers, "
              f"{HEADS} query / {KV_HEADS} KV heads, vocab {VOCAB}, float32; "
              f"{plural(len(prompts), 'prompt')} of {span(map(len, prompts), 'token')}, "
              f"{plural(new, 'new token')} each, max_bs={MAX_BS}, page_size={PAGE}")
        gen = PagedGenerator(model, max_bs=MAX_BS, max_context_len=ctx, page_size=PAGE)
        kv_bytes = sum(kv.nbytes for kv in gen.target.caches_used)
        print(f"pool: {gen.pool.nbytes} bytes of metadata (one allocation), phases "
              f"{[p.value for p in gen.pool.phases]}; KV cache: {kv_bytes} bytes, "
              f"{gen.alloc.usable_pages} usable pages")
        print(f"attention: {kernel_name(gen.target.backend, gen.pool.cfg.layout)}")
        t0 = time.perf_counter()
        out = gen.generate(prompts, max_new_tokens=new)
        wall = time.perf_counter() - t0
        st = gen.stats
        for i in range(3):
            print(f"  prompt {i} ({plural(len(prompts[i]), 'token')}) -> {out[i][:10]}...")
        steps_run = st.decode_steps + st.prefill_forwards
        print(f"{plural(st.decode_steps, 'decode step')} + "
              f"{plural(st.prefill_forwards, 'prefill')} in {wall:.2f}s "
              f"({steps_run / wall:.1f} steps/s), {st.tokens_per_s:.0f} tokens/s, "
              f"metadata {st.metadata_us_per_step:.0f} us per forward, "
              f"{batch_sizes(st.batch_sizes)}")
        check = 3
        with torch.no_grad():
            for i in range(check):
                ids = torch.tensor([prompts[i]], device=dev)
                want = model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=new, do_sample=False, pad_token_id=0,
                                      eos_token_id=None)[0, len(prompts[i]):].tolist()
                if want != out[i]:
                    raise SystemExit(f"prompt {i}: PagedGenerator differs from model.generate")
        print(f"matches model.generate (do_sample=False) on the first {check} prompts: ok")
        spec = PagedGenerator(model, max_bs=MAX_BS, max_context_len=ctx, page_size=PAGE,
                              draft_model=model, num_draft_tokens=DRAFT_TOKENS)
        t0 = time.perf_counter()
        out2 = spec.generate(prompts, max_new_tokens=new)
        wall2 = time.perf_counter() - t0
        s2 = spec.stats
        same = sum(a == b for a, b in zip(out, out2, strict=True))
        print(f"speculative, N={DRAFT_TOKENS} (the draft is the target itself, so every "
              f"proposal is accepted; a real draft is a smaller model): acceptance "
              f"{s2.acceptance_rate:.2f}, {plural(s2.decode_steps, 'verify step')}, "
              f"{s2.tokens_per_s:.0f} tokens/s in {wall2:.2f}s, same tokens as plain decoding "
              f"on {same}/{len(out)}")
        if same != len(out):
            raise SystemExit("speculative decoding changed the output")
        return 0
    finally:
        torch.set_num_threads(threads)

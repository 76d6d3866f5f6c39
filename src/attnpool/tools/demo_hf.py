"""``attnpool demo`` with transformers installed: a real model generating through a pool.

A tiny random Llama (GQA, built from a config: nothing is downloaded) serves a dozen prompts with
:class:`~attnpool.integrations.transformers.PagedGenerator`: continuous batching over ``max_bs``
slots, prefill through ``pool.extend``, decode steps through ``pool.decode``, a paged KV cache
whose pages return to the free list as requests finish. The demo checks its output against
``model.generate`` run per prompt, then runs the same prompts with speculative decoding
(``pool.draft``, ``pool.verify``, ``pool.draft_extend``) and checks it returns the same tokens.
"""

from __future__ import annotations

import time

import torch

from ..config import Layout
from ..integrations.hf_attention import Backend
from ..integrations.tiny import random_prompts, tiny_llama
from .bench import device_of

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
    if backend is Backend.FA2:
        return f"flash-attn 2 (flash_attn) {where}; prefill and draft extend through PyTorch SDPA"
    return f"PyTorch SDPA (attnpool.adapters.sdpa) {where}"


def run_hf_demo(device: str = "auto", steps: int = 40, seed: int = 0) -> int:
    """Generate ``steps`` new tokens per prompt; returns 0, or exits when a check fails."""
    from ..integrations.transformers import PagedGenerator

    dev = device_of(device)
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
              f"{HEADS} query / {KV_HEADS} KV heads, vocab {VOCAB}, float32; {len(prompts)} "
              f"prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {new} new "
              f"tokens each, max_bs={MAX_BS}, page_size={PAGE}")
        gen = PagedGenerator(model, max_bs=MAX_BS, max_context_len=ctx, page_size=PAGE)
        print(f"pool: {gen.pool.nbytes} bytes of metadata (one allocation), phases "
              f"{[p.value for p in gen.pool.phases]}; KV cache: {gen.target.kv.nbytes} bytes, "
              f"{gen.alloc.usable_pages} usable pages")
        print(f"attention: {kernel_name(gen.target.backend, gen.pool.cfg.layout)}")
        t0 = time.perf_counter()
        out = gen.generate(prompts, max_new_tokens=new)
        wall = time.perf_counter() - t0
        st = gen.stats
        for i in range(3):
            print(f"  prompt {i} ({len(prompts[i])} tokens) -> {out[i][:10]}...")
        steps_run = st.decode_steps + st.prefill_forwards
        print(f"{st.decode_steps} decode steps + {st.prefill_forwards} prefills in {wall:.2f}s "
              f"({steps_run / wall:.1f} steps/s), {st.tokens_per_s:.0f} tokens/s, "
              f"metadata {st.metadata_us_per_step:.0f} us per forward, batch sizes "
              f"{min(st.batch_sizes)}-{max(st.batch_sizes)}")
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
              f"{s2.acceptance_rate:.2f}, {s2.decode_steps} verify steps, {s2.tokens_per_s:.0f} "
              f"tokens/s in {wall2:.2f}s, same tokens as plain decoding on {same}/{len(out)}")
        if same != len(out):
            raise SystemExit("speculative decoding changed the output")
        return 0
    finally:
        torch.set_num_threads(threads)

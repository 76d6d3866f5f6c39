"""Sliding windows: the window part's memory and what it adds to an update.

* Memory (arithmetic on :func:`attnpool.plan_arena`, the bytes the pool allocates): the decode
  window page table against the full one, B = 160 rows, C = 128K, W = 4096 and 1024, page sizes
  1 and 16. The timed call is the planning itself.
* Update time, in one run: the same decode / chain verify refill of a pool without and with a
  window part (``sliding_window=4096``, the window rows written by the same update), bs 64 of
  a 32K context, on the default update path of the device (fused on CUDA, reference on CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import BufferPool, Impl, Phase, PoolConfig, plan_arena
from attnpool.tools import bench

B, CONTEXT = 160, 131072


def _bytes(cfg: PoolConfig, name: str) -> int:
    return next(p.nbytes for p in plan_arena(cfg).placements
                if p.spec.phase is Phase.DECODE and p.spec.name == name)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [4096, 1024])
def test_window_table_bytes(record: Callable[..., None], timed: Callable[..., None],
                            page: int, window: int) -> None:
    cfg = PoolConfig(max_bs=B, max_context_len=CONTEXT, page_size=page, device="cpu",
                     sliding_window=window)
    full, win = _bytes(cfg, "page_table"), _bytes(cfg, "window_page_table")
    record("window-memory", f"W{window}-p{page}", "plan", cfg, full_page_table_bytes=full,
           window_page_table_bytes=win, window_over_full=win / full,
           window_columns=cfg.window_pages(Phase.DECODE), full_columns=cfg.max_pages)
    timed(lambda: plan_arena(cfg))


CASES = [bench.UpdateCase(ph, 16, 64, 32768, max_bs=64) for ph in ("decode", "verify")]


@pytest.mark.parametrize("window", [None, 4096], ids=["full-only", "with-window"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_update_with_a_window_part(record: Callable[..., None], timed: Callable[..., None],
                                   device: torch.device, case: bench.UpdateCase,
                                   window: int | None) -> None:
    cfg = dataclasses.replace(case.config(device), impl=Impl.AUTO, sliding_window=window)
    pool = BufferPool(cfg)
    x = bench.make_inputs(case, device)
    phase = pool.phase(case.phase)

    def fn() -> object:
        return phase.update_(case.bs, seq_lens=x.seq_lens, req_pool_indices=x.req_pool_indices,
                             req_to_token=x.req_to_token, seq_lens_cpu=x.seq_lens_cpu)

    fn()
    record("window-update", case.name, "with-window" if window else "full-only", cfg,
           baseline="full-only", update_path=phase.impl.value)
    timed(fn)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [128, 1024])
def test_window_pages_held_after_a_long_generation(benchmark: Any, record: Callable[..., None],
                                                   page: int, window: int) -> None:
    """KV pages one request holds after 2,000 generated tokens (plus a 32-token prompt), in one
    run of a model with one sliding-window layer and one full layer: the full layer keeps every
    page of the request (what a window layer would hold without freeing), the window layer's
    cache only what a future window can still read
    (:mod:`attnpool.integrations.transformers.window_paging`)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Cohere2Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        initializer_range=0.3, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], eos_token_id=None,
        bos_token_id=None, pad_token_id=None)
    model = transformers.Cohere2ForCausalLM(cfg).eval()
    from attnpool.integrations.transformers import PagedGenerator

    new, prompt = 2000, list(range(32))
    gen = PagedGenerator(model, max_bs=1, max_context_len=len(prompt) + new, page_size=page)
    benchmark.pedantic(lambda: gen.generate([prompt], max_new_tokens=new), rounds=1,
                       iterations=1)
    st, window_alloc = gen.stats, gen.window_alloc
    assert window_alloc is not None and st.new_tokens == new
    record("window-pages", f"W{window}-p{page}", "freeing", gen.pool.cfg,
           full_layer_pages=st.full_pages_peak, window_layer_pages=st.window_pages_peak,
           window_span_pages=window_alloc.span, held_ratio=st.window_pages_peak / st.full_pages_peak)
    print(f"\nW={window} page={page}: after {new} tokens the full layer holds "
          f"{st.full_pages_peak} pages, the window layer {st.window_pages_peak} "
          f"(span {window_alloc.span}); {st.tokens_per_s:.0f} tokens/s")

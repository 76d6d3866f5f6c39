"""attnpool's vLLM MLA backend without vLLM: the latent cache view and store, and a decode step
refilled from vLLM-shaped decode rows, checked against the expanded (per-head) attention.
(tests/integrations/vllm/test_vllm_mla.py runs vLLM itself.)"""

from __future__ import annotations

import math

import pytest
import torch

from attnpool import CapacityError, InputError
from attnpool.adapters.mla.absorb import absorb_q, expand_kv, split_kv_b_proj, unabsorb_out
from attnpool.integrations.vllm.mla_step import (
    LatentFiller,
    MLAPrefill,
    SlotStaging,
    latent_cache,
    prefill_mode,
    store_latent_,
)
from attnpool.integrations.vllm.step import EngineSizes
from attnpool.kv.mla_shape import MLAShape

from tests.helpers.dense import dense_attention

SHAPE = MLAShape(num_heads=4, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                 kv_lora_rank=16)
P, ROW, L = 16, 24, 16


def _cache(blocks: int) -> torch.Tensor:
    """vLLM's latent cache of one layer ``[blocks, P, L + R]``: NaN where nothing was written
    (rows past a request's length must be masked out), block 0 (the null block) zero."""
    kv = torch.full((blocks, P, ROW), float("nan"), dtype=torch.float64)
    kv[0] = 0
    return kv


def test_store_writes_vllms_rows_and_sends_padding_to_the_null_block() -> None:
    kv = _cache(6)
    view = latent_cache(kv, SHAPE)
    assert view.shape == (6, P, 1, ROW) and view.data_ptr() == kv.data_ptr()
    slots = torch.tensor([17, 3, -1, 95, 40], dtype=torch.int64)
    c, pe = torch.randn(5, L, dtype=torch.float64), torch.randn(5, 1, 8, dtype=torch.float64)
    staging = SlotStaging(8, P, torch.device("cpu"))
    store_latent_(view, c, pe, *staging.index(slots))
    flat = kv.view(-1, ROW)  # vLLM's own store writes row ``slot`` of this flat view
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(flat[max(s, 0)], torch.cat((c[t], pe[t, 0])))
    assert torch.isnan(flat[18]).all()  # nothing else written (slot 17 is its neighbour)
    # the head axis vLLM may still carry is accepted; other shapes are refused
    assert latent_cache(kv.unsqueeze(1), SHAPE).shape == (6, P, 1, ROW)
    with pytest.raises(InputError, match=r"\[num_blocks, block_size, 24\]"):
        latent_cache(torch.zeros(6, P, 32), SHAPE)
    with pytest.raises(CapacityError, match="more than the 8"):
        staging.index(torch.zeros(9, dtype=torch.int64))


def _filler() -> LatentFiller:
    sizes = EngineSizes(max_num_seqs=4, max_num_batched_tokens=56, max_model_len=128,
                        block_size=P, sliding_window=None, num_blocks=24,
                        device=torch.device("cpu"))
    return LatentFiller(sizes, SHAPE, torch.float64)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 9, 40]], ids=["decode", "mixed"])
def test_step_equals_the_expanded_attention(q_lens: list[int]) -> None:
    """Rows refilled from vLLM's lengths and block table (rows past them: padding): three
    decode rows (a decode update), or a decode row, a prefill chunk over a cached prefix and a
    fresh prompt (one extend update); absorbed attention over the latent cache, then ``W_UV``:
    the per-head causal attention over the expanded keys and values, in float64."""
    torch.manual_seed(0)
    lens = [5, 17, 40]
    table = torch.zeros(6, 8, dtype=torch.int32)
    nxt = 1
    for r, n in enumerate(lens):
        pages = math.ceil(n / P)
        table[r, :pages] = torch.arange(nxt, nxt + pages)
        nxt += pages
    kv = _cache(24)
    slots = [[int(table[r, p // P]) * P + p % P for p in range(n)] for r, n in enumerate(lens)]
    flat = kv.view(-1, ROW)
    for row in slots:
        flat[row] = torch.randn(len(row), ROW, dtype=torch.float64)
    t = sum(q_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    step = _filler().fill(seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=table,
                          num_tokens=t, query_start_loc=None if max(q_lens) == 1 else qsl)
    assert type(step.view).__name__ == ("DecodeView" if max(q_lens) == 1 else "ExtendView")
    assert step.view.cache_seqlens[:3].tolist() == lens
    w_uk, w_uv = split_kv_b_proj(torch.randn(4 * 16, L, dtype=torch.float64), SHAPE)
    q_nope, q_pe = torch.randn(t, 4, 8, dtype=torch.float64), torch.randn(t, 4, 8,
                                                                          dtype=torch.float64)
    scale = SHAPE.softmax_scale
    out = unabsorb_out(step.run(absorb_q(q_nope, w_uk), kv, scale, q_pe=q_pe), w_uv)
    keys = [row[: n - q + j + 1] for row, n, q in zip(slots, lens, q_lens, strict=True)
            for j in range(q)]
    k, v = expand_kv(flat[:, :L].nan_to_num(), flat[:, L:].nan_to_num(), w_uk, w_uv)
    # one slot per page: slot s is row s of the expanded [tokens, H, D] keys and values
    ref, _ = dense_attention(torch.cat((q_nope, q_pe), dim=-1), k.view(-1, 1, 4, 16),
                             v.view(-1, 1, 4, 8), keys, scale)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_prefill_setting() -> None:
    assert prefill_mode(" ATTNPOOL ") is MLAPrefill.ATTNPOOL
    assert prefill_mode("vllm") is MLAPrefill.VLLM
    with pytest.raises(InputError, match="'vllm' or 'attnpool', got 'auto'"):
        prefill_mode("auto")


def test_more_rows_or_tokens_than_the_pool_holds_are_refused() -> None:
    with pytest.raises(CapacityError, match="max_num_batched_tokens=56"):
        _filler().fill(seq_lens=torch.ones(1, dtype=torch.int32),
                       block_table=torch.ones(1, 8, dtype=torch.int32), num_tokens=57)
    with pytest.raises(CapacityError, match="max_num_seqs=4"):
        _filler().fill(seq_lens=torch.ones(5, dtype=torch.int32),
                       block_table=torch.ones(5, 8, dtype=torch.int32), num_tokens=5)

"""The classic extend baseline writes what ``pool.extend.update_`` writes for real rows and
tokens (like-for-like device-time benchmarks of prefill and mixed steps)."""

from __future__ import annotations

import random

import pytest
import torch

from attnpool import BufferPool, PoolConfig
from attnpool.errors import InputError
from attnpool.tools.baseline_extend import ClassicExtend

from tests.helpers.batches import make_batch

T = 96


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize(("n", "bs"), [(1, 1), (3, 8), (8, 8), (5, 6)])
def test_classic_extend_equals_attnpool_on_real_rows(page: int, n: int, bs: int) -> None:
    cfg = PoolConfig(max_bs=8, max_context_len=256, page_size=page, device="cpu",
                     max_extend_tokens=T)
    pool, classic = BufferPool(cfg, poison=True), ClassicExtend(cfg)
    rng = random.Random(page * 100 + n * 10 + bs)
    for _ in range(3):  # consecutive steps: the baseline reuses its buffers
        b = make_batch(cfg, n, rng)
        # a mixed step: decode rows (one new token) and prefill chunks within T
        left, ext = T, []
        for s in b.seq_lens:
            e = 1 if rng.random() < 0.5 else rng.randint(1, max(1, min(s, left - (n - len(ext)))))
            e = max(1, min(e, s, left - (n - len(ext) - 1)))
            ext.append(e)
            left -= e
        seq, rpi, table = b.tensors()
        ext_t = torch.tensor(ext)
        slots = torch.empty(T, dtype=torch.int64)
        got = pool.extend.update_(bs, seq_lens=seq, extend_lens=ext_t, req_pool_indices=rpi,
                                  req_to_token=table, seq_lens_cpu=torch.tensor(b.seq_lens),
                                  extend_lens_cpu=ext_t, out_slots=slots)
        want, pos, out = classic.replay(bs, seq, ext_t, rpi, table, torch.tensor(b.seq_lens),
                                        ext_t)
        total = sum(ext)
        assert torch.equal(want.cache_seqlens[:n], got.cache_seqlens[:n])
        assert torch.equal(want.cu_seqlens_k[: n + 1], got.cu_seqlens_k[: n + 1])
        assert torch.equal(want.cu_seqlens_q[: n + 1], got.cu_seqlens_q[: n + 1])
        for i, s in enumerate(b.seq_lens):
            w = -(-s // page)
            assert torch.equal(want.page_table[i, :w], got.page_table[i, :w]), i
        assert torch.equal(pos, got.positions[:total].to(pos.dtype))
        assert torch.equal(out, slots[:total])
        assert want.max_seqlen_q == max(ext)


def test_classic_extend_refusals() -> None:
    with pytest.raises(InputError, match="max_extend_tokens > 0"):
        ClassicExtend(PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu"))
    cfg = PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu",
                     max_extend_tokens=8)
    b = make_batch(cfg, 2, random.Random(1))
    seq, rpi, table = b.tensors()
    c = ClassicExtend(cfg)
    with pytest.raises(InputError, match="max_extend_tokens=8, got 10"):
        c.replay(2, seq, torch.tensor([5, 5]), rpi, table, torch.tensor(b.seq_lens),
                 torch.tensor([5, 5]))

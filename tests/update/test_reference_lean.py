"""The reference path's lean part (:mod:`attnpool.update.reference.lean`) writes the general
part's bytes: the whole arena, byte for byte, over random engine steps (decode and extend,
padded batches, rows in table order or picked by ``req_pool_indices``, int32 and int64 inputs,
host copies that are the inputs themselves or separate, ``out_slots``), and it is the part a
block-table step binds."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from attnpool import BufferPool, Impl, Layout, PoolConfig
from attnpool.update import reference
from attnpool.update.reference.lean import LeanPaged

P, C, T, MAX_BS, ROWS = 16, 512, 96, 8, 12


def _pool(window: int | None = None, layout: Layout = Layout.FLASH_ATTN) -> BufferPool:
    cfg = PoolConfig(max_bs=MAX_BS, max_context_len=C, page_size=P, device="cpu",
                     layout=layout, max_extend_tokens=T, pad_page=0,
                     num_pages=ROWS * (C // P) + 1, impl=Impl.REFERENCE, sliding_window=window)
    return BufferPool(cfg, poison=True)


def _step(rng: random.Random, kind: str, dtype: torch.dtype, window: int | None
          ) -> tuple[int, dict[str, Any]]:
    n = rng.randint(1, MAX_BS)
    bs = rng.randint(n, MAX_BS)
    ext = [1] * n if kind == "decode" else [rng.randint(1, 12) for _ in range(n)]
    seq = [rng.randint(e, C) for e in ext]
    ids = list(range(1, ROWS * (C // P) + 1))
    rng.shuffle(ids)
    table = torch.tensor(ids, dtype=dtype).view(ROWS, C // P)
    kw: dict[str, Any] = {"seq_lens": torch.tensor(seq, dtype=dtype)}
    if rng.random() < 0.5:
        kw["block_table"] = table[:n] if rng.random() < 0.5 else table
    else:
        kw["block_table"] = table
        kw["req_pool_indices"] = torch.tensor(rng.sample(range(ROWS), n), dtype=dtype)
    if window and rng.random() < 0.5:  # the sliding-window group's own table
        other = list(range(1, ROWS * (C // P) + 1))
        rng.shuffle(other)
        kw["window_block_table"] = torch.tensor(other, dtype=dtype).view(ROWS, C // P)
    host = rng.random()
    if host < 0.7:  # the inputs themselves as host copies (a CPU engine's step)
        kw["seq_lens_cpu"] = kw["seq_lens"]
    elif host < 0.85:
        kw["seq_lens_cpu"] = list(seq)
    if kind == "extend":
        kw["extend_lens"] = torch.tensor(ext, dtype=dtype)
        if "seq_lens_cpu" in kw:
            kw["extend_lens_cpu"] = kw["extend_lens"] if host < 0.7 else list(ext)
        if rng.random() < 0.3:
            kw["out_slots"] = torch.empty(T, dtype=torch.int64)
    return bs, kw


def _bytes(pool: BufferPool) -> torch.Tensor:
    return pool.arena.storage.clone()


@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window", [None, 40, 64])
def test_lean_part_writes_the_general_parts_bytes(kind: str, dtype: torch.dtype,
                                                  window: int | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    lean, general = _pool(window), _pool(window)
    rng = random.Random(f"{kind}{dtype}{window}")
    for _ in range(60):
        bs, kw = _step(rng, kind, dtype, window)
        other = {k: v.clone() if isinstance(v, torch.Tensor) and k == "out_slots" else v
                 for k, v in kw.items()}
        view = getattr(lean, kind).update_(bs, **kw)
        with monkeypatch.context() as m:  # (the general part binds for every shape)
            m.setattr(reference, "lean_fits", lambda b, part: False)
            getattr(general, kind).update_(bs, **other)
        assert torch.equal(_bytes(lean), _bytes(general))
        if "out_slots" in kw:
            assert torch.equal(kw["out_slots"], other["out_slots"])
        lean.check(view)  # (poison mode: the read region is written and in range)


def test_block_table_steps_bind_the_lean_part() -> None:
    """An engine's step binds the lean part (with its window part too); a token-level table or
    FlashInfer's CSR does not."""
    def bound(pool: BufferPool, **kw: Any) -> list[object]:
        pool.decode.update_(2, seq_lens=torch.tensor([5, 40], dtype=torch.int32), **kw)
        return [r.fn for parts in pool.decode._launches.parts.values() for r in parts]

    table = torch.arange(1, 1 + 2 * (C // P), dtype=torch.int32).view(2, C // P)
    assert all(isinstance(f, LeanPaged) for f in bound(_pool(), block_table=table))
    tokens = (table[:, :, None] * P + torch.arange(P, dtype=torch.int32)).view(2, C)
    assert not any(isinstance(f, LeanPaged) for f in bound(
        _pool(), req_to_token=tokens, req_pool_indices=torch.tensor([0, 1])))
    assert all(isinstance(f, LeanPaged) for f in bound(_pool(window=64), block_table=table))
    assert not any(isinstance(f, LeanPaged) for f in bound(
        _pool(layout=Layout.FLASHINFER | Layout.FLASH_ATTN), block_table=table))

"""Random engine-side inputs: a req_to_token table with paged slots, and batches over it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attnpool import PoolConfig


@dataclass
class Batch:
    seq_lens: list[int]
    slots: list[int]
    req_to_token: torch.Tensor

    def tensors(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.int64
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.tensor(self.seq_lens, dtype=dtype, device=device),
                torch.tensor(self.slots, dtype=dtype, device=device),
                self.req_to_token.to(device))

    def inputs(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.int64
               ) -> dict[str, torch.Tensor]:
        """:meth:`tensors` as the keywords every phase's ``update_`` takes."""
        seq, rpi, table = self.tensors(device, dtype)
        return {"seq_lens": seq, "req_pool_indices": rpi, "req_to_token": table}


def tree_mask(n: int, nd: int, rng: random.Random | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, nd, nd]`` bool tree masks for verify / draft trees: ``mask[i, j, k]`` is True when
    draft ``k`` is draft ``j`` or one of its ancestors. With ``rng``, random trees (each draft's
    parent an earlier draft or the root); without, the chain (each draft's parent the one before
    it: the lower triangle)."""
    mask = torch.zeros(n, nd, nd, dtype=torch.bool)
    for i in range(n):
        parent = [-1] + [rng.randrange(-1, j) if rng is not None else j - 1 for j in range(1, nd)]
        for j in range(nd):
            k = j
            while k >= 0:
                mask[i, j, k] = True
                k = parent[k]
    return mask.to(device)


def shuffled_table(rng: random.Random, rows: int, context: int, page: int) -> torch.Tensor:
    """``[rows, context]`` int32 token slots over whole pages in shuffled order (page 0 unused)."""
    cols = context // page
    ids = list(range(1, rows * cols + 1))
    rng.shuffle(ids)
    bt = torch.tensor(ids, dtype=torch.int64).view(rows, cols)
    return (bt.repeat_interleave(page, 1) * page + torch.arange(context) % page).to(torch.int32)


def make_table(cfg: PoolConfig, num_slots: int, rng: random.Random,
               dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Each request row maps positions to slots on shuffled pages; page 0 is never used."""
    p, pages = cfg.page_size, cfg.max_pages
    ids = list(range(1, num_slots * pages + 1))
    rng.shuffle(ids)
    page_ids = torch.tensor(ids, dtype=torch.int64).view(num_slots, pages)
    tok = page_ids.repeat_interleave(p, dim=1) * p + torch.arange(p).repeat(pages)
    return tok[:, : cfg.max_context_len].to(dtype).contiguous()


def make_batch(cfg: PoolConfig, n: int, rng: random.Random, extra: int = 0,
               num_slots: int | None = None, table: torch.Tensor | None = None) -> Batch:
    """n requests with lengths in [1, C - extra], some at the limit, on distinct slots."""
    slots_total = num_slots or max(2 * cfg.max_bs, n)
    if table is None:
        table = make_table(cfg, slots_total, rng)
    hi = cfg.max_context_len - extra
    lens = [rng.choice([1, hi, rng.randint(1, hi)]) for _ in range(n)]
    slots = rng.sample(range(table.shape[0]), n)
    return Batch(lens, slots, table)

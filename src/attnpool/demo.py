"""``attnpool demo``: a continuous-batching decode loop driven through a pool.

Requests join and finish, each decode step grows every live request by one token (a new KV page
when it crosses a page boundary), the batch is padded to the next captured size, and
``pool.decode.update_`` refills the view. The pool runs in poison mode, and every step is checked
twice: the read region holds no sentinel (``pool.check``) and each real row's pages equal the pages
the toy allocator handed that request.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from .config import Layout, PoolConfig
from .pool import BufferPool

CAPTURE_SIZES = (1, 2, 4, 8, 16)


@dataclass
class _Request:
    slot: int
    length: int
    pages: list[int] = field(default_factory=list)


class _ToyKV:
    """A page allocator and the engine-side ``req_to_token`` table (page 0 is the pad page)."""

    def __init__(self, cfg: PoolConfig, num_slots: int, rng: random.Random) -> None:
        self.cfg, self.rng = cfg, rng
        self.free_pages = list(range(1, num_slots * cfg.max_pages + 1))
        rng.shuffle(self.free_pages)
        self.free_slots = list(range(num_slots))
        self.req_to_token = torch.zeros(num_slots, cfg.max_context_len, dtype=torch.int32)

    def grow(self, r: _Request, new_len: int) -> None:
        p = self.cfg.page_size
        while len(r.pages) * p < new_len:
            page = self.free_pages.pop()
            base = len(r.pages) * p
            r.pages.append(page)
            self.req_to_token[r.slot, base : base + p] = torch.arange(page * p, page * p + p)
        r.length = new_len

    def release(self, r: _Request) -> None:
        self.free_pages.extend(r.pages)
        self.free_slots.append(r.slot)


def run_demo(device: str = "auto", steps: int = 40, seed: int = 0) -> int:
    rng = random.Random(seed)
    cfg = PoolConfig(max_bs=max(CAPTURE_SIZES), max_context_len=512, page_size=16,
                     device=device, layout=Layout.BOTH)
    pool = BufferPool(cfg, poison=True)
    dev = cfg.torch_device
    kv = _ToyKV(cfg, num_slots=2 * cfg.max_bs, rng=rng)
    print(f"attnpool demo on {dev}: max_bs={cfg.max_bs} context={cfg.max_context_len} "
          f"page_size={cfg.page_size} layout=BOTH, pool {pool.nbytes} bytes (poison mode)")
    for bs in CAPTURE_SIZES:  # what an engine does before capturing each graph
        pool.check(pool.decode.view(bs))
    live: list[_Request] = []
    table = kv.req_to_token.to(dev)
    update_s = 0.0
    t_all = time.perf_counter()
    for step in range(steps):
        keep: list[_Request] = []
        for r in live:  # ~10% finish each step; a request at the context limit always does
            if r.length < cfg.max_context_len - 1 and rng.random() > 0.1:
                keep.append(r)
            else:
                kv.release(r)
        live = keep
        while len(live) < cfg.max_bs and rng.random() < 0.6:
            r = _Request(kv.free_slots.pop(), 0)
            kv.grow(r, rng.randint(1, cfg.max_context_len // 2))
            live.append(r)
        for r in live:
            kv.grow(r, r.length + 1)
        if not live:
            continue
        bs = next(b for b in CAPTURE_SIZES if b >= len(live))
        lens = [r.length for r in live]
        table.copy_(kv.req_to_token)
        seq_lens = torch.tensor(lens, dtype=torch.int64).to(dev)
        rpi = torch.tensor([r.slot for r in live], dtype=torch.int64).to(dev)
        t0 = time.perf_counter()
        view = pool.decode.update_(bs, seq_lens, rpi, table, seq_lens_cpu=lens)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        update_s += time.perf_counter() - t0
        pool.check(view)
        rows = view.page_table
        if rows is None:
            raise SystemExit("the demo pool was built without a page table")
        for i, r in enumerate(live):
            got = rows[i, : len(r.pages)].tolist()
            if got != r.pages:
                raise SystemExit(f"step {step}: row {i} pages {got} != allocator's {r.pages}")
        print(f"step {step:3d}: n={len(live):2d} bs={bs:2d} max_seqlen_k={view.max_seqlen_k:3d} ok")
        pool.poison_()  # the next update must rewrite every element a kernel may read
    total = time.perf_counter() - t_all
    print(f"{steps} steps in {total:.2f}s ({steps / total:.1f} steps/s), "
          f"mean update_ {1e6 * update_s / max(steps, 1):.1f} us")
    return 0


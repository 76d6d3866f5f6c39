"""``attnpool demo``: a small continuous-batching decode loop with paged KV, through a pool.

A toy model (a few attention layers with GQA) keeps its keys and values in a paged KV cache of its
own. Requests join (their prompt's KV is written as a prefill would) and finish; every step grows
the live requests, pads the batch to the next captured size, refills the pool's view in place
(``update_``, the only part an engine would replay a graph around) and runs attention with the
SDPA adapter, switching between the pool's two layouts. Every few steps is a speculative
*verify* step instead: each request appends ``N`` draft tokens, attends causally over them through
``pool.verify``, and keeps a random number of them.

The pool runs in poison mode and is re-poisoned after every step, and each step is checked twice:
the view's read region holds no sentinel (``pool.check``), and every layer's attention output for
the real requests equals dense attention computed without pages, from the token slots the toy
allocator gave each request.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..adapters.sdpa import attention
from ..config import Layout, PoolConfig
from ..pool import BufferPool
from .words import plural

CAPTURE_SIZES = (1, 2, 4, 8, 16)
LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 3, 4, 2, 16, 64
DRAFT_TOKENS, VERIFY_EVERY = 2, 4
# float32 adapter vs float64 dense over <= 512 keys of O(1) values: rounding stays ~1e-6.
TOLERANCE = 1e-4


@dataclass
class _Request:
    slot: int
    length: int
    pages: list[int] = field(default_factory=list)


class _ToyKV:
    """A page allocator, the engine-side ``req_to_token`` table (page 0 is the pad page) and one
    paged K and V cache ``[pages, P, H_kv, D]`` per layer."""

    def __init__(self, cfg: PoolConfig, num_slots: int, rng: random.Random) -> None:
        self.cfg, self.rng = cfg, rng
        num_pages = num_slots * cfg.max_pages + 1
        self.free_pages = list(range(1, num_pages))
        rng.shuffle(self.free_pages)
        self.free_slots = list(range(num_slots))
        # The toy engine's own state (host table, KV cache), made once at start-up.
        self.req_to_token = torch.zeros(  # ok: toy engine
            num_slots, cfg.max_context_len, dtype=torch.int32)
        shape = (num_pages, cfg.page_size, KV_HEADS, HEAD_DIM)
        dev = cfg.torch_device
        self.k = [torch.zeros(shape, device=dev) for _ in range(LAYERS)]  # ok: toy engine
        self.v = [torch.zeros(shape, device=dev) for _ in range(LAYERS)]  # ok: toy engine

    def grow(self, r: _Request, new_len: int) -> None:
        """Give ``r`` pages for ``new_len`` tokens (pages it already has are kept)."""
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

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store the new tokens' K/V at their token slots (what an engine's store kernel does)."""
        self.k[layer].view(-1, KV_HEADS, HEAD_DIM)[slots] = k
        self.v[layer].view(-1, KV_HEADS, HEAD_DIM)[slots] = v


def _dense(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> Tensor:
    """Plain softmax attention of ``q [m, H, D]`` over the token slots ``slots`` (float64)."""
    k = k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
    v = v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
    s = torch.einsum("mhd,lhd->mhl", q.double(), k) / HEAD_DIM**0.5
    if q.shape[0] > 1:  # causal over the trailing queries (verify's draft tokens)
        lk, m = k.shape[0], q.shape[0]
        keep = torch.arange(lk)[None, :] <= torch.arange(lk - m, lk)[:, None]
        s = s.masked_fill(~keep[:, None, :].to(s.device), float("-inf"))
    return torch.einsum("mhl,lhd->mhd", torch.softmax(s, -1), v)


class _Model:
    """Attention layers: ``h += Wo(attn(Wq h, cache))`` with the new tokens' K/V stored first."""

    def __init__(self, dev: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        scale = HIDDEN**-0.5

        def w(a: int, b: int) -> Tensor:
            return torch.randn(a, b, generator=g).mul_(scale).to(dev)

        self.layers = [(w(HIDDEN, HEADS * HEAD_DIM), w(HIDDEN, KV_HEADS * HEAD_DIM),
                        w(HIDDEN, KV_HEADS * HEAD_DIM), w(HEADS * HEAD_DIM, HIDDEN))
                       for _ in range(LAYERS)]

    def forward(self, kv: _ToyKV, view: object, h: Tensor, new_slots: Tensor,
                keys: list[Tensor], q_per_req: int, layout: Layout) -> float:
        """Run every layer on ``h [bs * q_per_req, HIDDEN]``; return the largest deviation of a
        real query's attention from dense attention over ``keys[i]`` (request ``i``'s slots)."""
        worst = 0.0
        real = new_slots.shape[0]
        for li, (wq, wk, wv, wo) in enumerate(self.layers):
            q = (h @ wq).view(-1, HEADS, HEAD_DIM)
            k = (h[:real] @ wk).view(-1, KV_HEADS, HEAD_DIM)
            v = (h[:real] @ wv).view(-1, KV_HEADS, HEAD_DIM)
            kv.write(li, new_slots, k, v)
            out = attention(view, q, kv.k[li], kv.v[li], layout=layout).out
            for i, slots in enumerate(keys):
                rows = slice(i * q_per_req, (i + 1) * q_per_req)
                want = _dense(q[rows], kv.k[li], kv.v[li], slots)
                worst = max(worst, float((out[rows].double() - want).abs().max()))
            h = h + out.reshape(h.shape[0], -1) @ wo
        return worst


def run_demo(device: str = "auto", steps: int = 40, seed: int = 0) -> int:
    """Run ``steps`` steps; returns 0, or exits with a message when a check fails."""
    threads = torch.get_num_threads()
    # The demo's tensors are tiny: on CPU, intra-op threads only contend with each other (and
    # with whatever else the machine runs), so it runs single-threaded and restores the setting.
    torch.set_num_threads(1)
    try:
        return _run(device, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _run(device: str, steps: int, seed: int) -> int:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    nd = DRAFT_TOKENS
    cfg = PoolConfig(max_bs=max(CAPTURE_SIZES), max_context_len=512, page_size=16,
                     device=device, layout=Layout.BOTH, num_draft_tokens=nd)
    pool = BufferPool(cfg, poison=True)
    dev = cfg.torch_device
    kv = _ToyKV(cfg, num_slots=2 * cfg.max_bs, rng=rng)
    model = _Model(dev, seed)
    print(f"attnpool demo on {dev}: {LAYERS} layers, {HEADS} query / {KV_HEADS} KV heads, "
          f"max_bs={cfg.max_bs} context={cfg.max_context_len} page_size={cfg.page_size} "
          f"layout=BOTH, verify of {nd} drafts every {VERIFY_EVERY} steps; pool {pool.nbytes} "
          f"bytes (poison mode)")
    print("attention: PyTorch SDPA (attnpool.adapters.sdpa), reading the pool's FLASH_ATTN and "
          f"FLASHINFER layouts in turn every {VERIFY_EVERY} steps (no flash-attn or FlashInfer "
          "kernel runs here)")
    for bs in CAPTURE_SIZES:  # what an engine does before capturing each graph
        pool.check(pool.decode.view(bs))
        pool.check(pool.verify.view(bs))
    live: list[_Request] = []
    table = kv.req_to_token.to(dev)
    update_s, t_all = 0.0, time.perf_counter()
    for step in range(steps):
        keep: list[_Request] = []
        for r in live:  # ~10% finish each step; a request near the context limit always does
            if r.length < cfg.max_context_len - nd - 1 and rng.random() > 0.1:
                keep.append(r)
            else:
                kv.release(r)
        live = keep
        while len(live) < cfg.max_bs and rng.random() < 0.6:  # joins, with a prefilled prompt
            r = _Request(kv.free_slots.pop(), 0)
            kv.grow(r, rng.randint(1, cfg.max_context_len // 2))
            for li in range(LAYERS):
                slots = kv.req_to_token[r.slot, : r.length].to(dev, torch.int64)
                kv.write(li, slots, torch.randn(r.length, KV_HEADS, HEAD_DIM, device=dev),
                         torch.randn(r.length, KV_HEADS, HEAD_DIM, device=dev))
            live.append(r)
        if not live:
            continue
        verify = step % VERIFY_EVERY == VERIFY_EVERY - 1
        committed = [r.length for r in live]
        for r in live:  # decode appends one token; verify appends N drafts
            kv.grow(r, r.length + (nd if verify else 1))
        bs = next(b for b in CAPTURE_SIZES if b >= len(live))
        table.copy_(kv.req_to_token)
        req_pool_indices = torch.tensor([r.slot for r in live], dtype=torch.int64, device=dev)
        lens = committed if verify else [r.length for r in live]
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=dev)
        t0 = time.perf_counter()
        view: object
        if verify:
            view = pool.verify.update_(bs, seq_lens=seq_lens, req_pool_indices=req_pool_indices,
                                       req_to_token=table, seq_lens_cpu=lens)
        else:
            view = pool.decode.update_(bs, seq_lens=seq_lens, req_pool_indices=req_pool_indices,
                                       req_to_token=table, seq_lens_cpu=lens)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        update_s += time.perf_counter() - t0
        pool.check(view)
        q_per = nd if verify else 1
        new = torch.cat([table[r.slot, r.length - q_per : r.length] for r in live]).long()
        keys = [table[r.slot, : r.length].long() for r in live]
        # both layouts for both kinds of step: switch every VERIFY_EVERY steps
        layout = Layout.FLASH_ATTN if (step // VERIFY_EVERY) % 2 == 0 else Layout.FLASHINFER
        h = torch.randn(bs * q_per, HIDDEN, device=dev)
        err = model.forward(kv, view, h, new, keys, q_per, layout)
        if not err <= TOLERANCE:
            raise SystemExit(f"step {step}: attention differs from dense by {err:.3g}")
        if verify:  # keep a random number of drafts; the rest are overwritten later
            for r, c in zip(live, committed, strict=True):
                r.length = c + rng.randint(0, nd)
        kind = "verify" if verify else "decode"
        print(f"step {step:3d}: {kind} n={len(live):2d} bs={bs:2d} "
              f"max_seqlen_k={max(lens) + (nd if verify else 0):3d} SDPA reading {layout.name:10s} "
              f"max|attn - dense|={err:.1e} ok")
        pool.poison_()  # the next update must rewrite every element a kernel may read
    total = time.perf_counter() - t_all
    print(f"{plural(steps, 'step')} in {total:.2f}s ({steps / total:.1f} steps/s, dense checks "
          "included), "
          f"mean update_ {1e6 * update_s / max(steps, 1):.1f} us per step")
    return 0

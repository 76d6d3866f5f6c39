"""KV cache allocation and LoRA metadata updates: attnpool against the classic baseline, one run.

* ``kv-alloc``: a paged KV cache allocated as engines do it, one ``torch.zeros`` per layer for K
  and for V (``per-buffer zeros``, the baseline), the same with ``torch.empty``, and
  :class:`attnpool.kv.KVCachePool` (one ``torch.empty`` for every layer and the slot mapping,
  plus zeroing the pad page). Shapes are a Llama-3-8B-like MHA cache (32 layers, 8 KV heads,
  head dim 128, fp16, 128 KiB per token) and a DeepSeek-like MLA cache (61 layers, latent 512 +
  rope 64, bf16), scaled from the usual 1-16 GiB to 64 MiB - 1 GiB so they fit this machine.
  The timed call allocates and returns; the memory is freed between rounds.
* ``lora-update``: one step's LoRA metadata. ``classic`` creates a tensor per field from the host
  lists each step (pinned and copied non-blocking on CUDA), computes the cumsum and the
  adapter-grouped permutation with device ops, then copies each into static graph buffers;
  ``attnpool`` is :meth:`attnpool.lora.LoRABatchPool.update_` (on the CPU written in place; on
  CUDA one pinned image and one copy); ``attnpool-staged`` forces the staging image and its one
  copy on the CPU too. Both are checked to produce the same metadata before timing. These run
  with one intra-op CPU thread: the ops are tiny, and on a shared 2-core machine an op that wakes
  the second thread (``repeat_interleave`` does, even for 28 elements) waits up to a scheduler
  tick (8-12 ms measured here) whenever the other core is busy, which would time the machine's
  load rather than either side. Allocation keeps torch's default threads (memset uses them).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from attnpool.kv import KVCacheConfig, KVCachePool, KVKind
from attnpool.lora import LoRABatchPool, LoRABatchView, LoRAConfig

MiB = 1 << 20


def _mha(total: int) -> dict[str, Any]:
    # 32 layers x (K, V) x 8 heads x 128 x fp16 = 128 KiB per token; page 16 = 2 MiB per page
    return {"num_pages": total // (2 * MiB), "page_size": 16, "num_layers": 32,
            "num_kv_heads": 8, "head_dim": 128, "dtype": torch.float16}


KV_CASES: dict[str, dict[str, Any]] = {
    "mha-l32-h8-d128-64MiB": _mha(64 * MiB),
    "mha-l32-h8-d128-256MiB": _mha(256 * MiB),
    "mha-l32-h8-d128-1GiB": _mha(1024 * MiB),
    # 61 layers x (512 + 64) x bf16 = 68.6 KiB per token; page 64
    "mla-l61-576-512MiB": {"num_pages": 512 * MiB // (61 * 576 * 2 * 64), "page_size": 64,
                           "num_layers": 61, "kind": KVKind.MLA, "kv_lora_rank": 512,
                           "rope_dim": 64, "dtype": torch.bfloat16},
}


def _per_buffer(cfg: KVCacheConfig, fill: Callable[..., torch.Tensor]) -> Callable[[], object]:
    """Engine style: one tensor per layer and part, ``[num_pages, page, heads, dim]`` each."""
    shape = (cfg.num_pages, *cfg.page_shape())
    n = cfg.num_layers * cfg.parts
    dev = cfg.torch_device

    def alloc() -> object:
        return [fill(shape, dtype=cfg.dtype, device=dev) for _ in range(n)]
    return alloc


KV_IMPLS: dict[str, Callable[[KVCacheConfig], Callable[[], object]]] = {
    "per-buffer zeros": lambda c: _per_buffer(c, torch.zeros),
    "per-buffer empty": lambda c: _per_buffer(c, torch.empty),
    "attnpool arena": lambda c: lambda: KVCachePool(c),
}


@pytest.fixture
def label(benchmark: Any, machine: dict[str, Any]) -> Callable[..., None]:
    def rec(group: str, case: str, impl: str, **extra: Any) -> None:
        benchmark.group = f"{group} {case}"
        benchmark.extra_info.update(machine)
        benchmark.extra_info.update({"group_name": group, "case": case, "impl": impl,
                                     "baseline": impl in ("per-buffer zeros", "classic"), **extra})
    return rec


@pytest.mark.parametrize("impl", list(KV_IMPLS))
@pytest.mark.parametrize("case", list(KV_CASES))
def test_kv_alloc(label: Callable[..., None], timed: Callable[..., None], device: torch.device,
                  case: str, impl: str) -> None:
    cfg = KVCacheConfig(max_tokens=8192, device=device, **KV_CASES[case])
    label("kv-alloc", case, impl, cache_nbytes=cfg.num_pages * cfg.bytes_per_page,
          threads=torch.get_num_threads(),
          bytes_per_token=cfg.bytes_per_token, bytes_per_page=cfg.bytes_per_page)
    timed(KV_IMPLS[impl](cfg), budget_s=0.5)


# ---- LoRA -------------------------------------------------------------------------------------
LORA_CFG = {"max_bs": 256, "max_loras_per_batch": 8, "max_lora_rank": 64,
            "max_tokens_per_req": 1}
LORA_BS = (1, 32, 160, 256)


class Classic:
    """Per-step tensor creation into zero-initialised static graph buffers."""

    def __init__(self, c: LoRAConfig) -> None:
        dev, self.c = c.torch_device, c
        z = torch.zeros
        self.seg_lens = z(c.max_bs, dtype=torch.int32, device=dev)
        self.seg_indptr = z(c.max_bs + 1, dtype=torch.int32, device=dev)
        self.weight_indices = z(c.max_bs, dtype=torch.int32, device=dev)
        self.lora_ranks = z(c.max_loras_per_batch, dtype=torch.int32, device=dev)
        self.scalings = z(c.max_loras_per_batch, dtype=torch.float32, device=dev)
        self.permutation = z(c.max_tokens, dtype=torch.int64, device=dev)
        self.iota = torch.arange(c.max_tokens, device=dev)

    def step(self, bs: int, w: list[int], lens: list[int], ranks: list[int],
             scal: list[float]) -> None:
        dev, pin = self.c.torch_device, self.c.torch_device.type == "cuda"

        def t(x: list[Any], dt: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dt, pin_memory=pin).to(dev, non_blocking=True)

        n = len(w)
        wi, sl = t(w, torch.int32), t(lens, torch.int32)
        self.weight_indices[:n].copy_(wi)
        self.weight_indices[n:bs].zero_()
        self.seg_lens[:n].copy_(sl)
        self.seg_lens[n:bs].zero_()
        torch.cumsum(self.seg_lens[:bs], 0, out=self.seg_indptr[1 : bs + 1])
        self.lora_ranks.copy_(t(ranks, torch.int32))
        self.scalings.copy_(t(scal, torch.float32))
        total = sum(lens)  # host lists: no sync
        tok = torch.repeat_interleave(wi, sl, output_size=total)
        self.permutation[:total].copy_(torch.argsort(tok, stable=True))
        self.permutation[total : bs * self.c.max_tokens_per_req].copy_(
            self.iota[total : bs * self.c.max_tokens_per_req])


def _inputs(bs: int, seed: int = 0) -> tuple[list[int], list[int], list[int], list[float]]:
    rng = random.Random(seed)
    n = max(1, bs - bs // 8)
    return ([rng.randrange(4) for _ in range(n)], [1] * n, [8, 16, 64, 32, 0, 0, 0, 0],
            [1.0, 0.5, 2.0, 0.25, 0.0, 0.0, 0.0, 0.0])


def _same(view: LoRABatchView, c: Classic) -> bool:
    bs, nt = view.bs, view.num_tokens
    return all(torch.equal(a, b) for a, b in (
        (view.seg_lens, c.seg_lens[:bs]), (view.seg_indptr, c.seg_indptr[: bs + 1]),
        (view.weight_indices, c.weight_indices[:bs]), (view.lora_ranks, c.lora_ranks),
        (view.scalings, c.scalings), (view.permutation, c.permutation[:nt])))


@pytest.fixture
def one_thread() -> Iterator[int]:
    """One intra-op thread for the duration of a test (see the module docstring)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(before)


@pytest.mark.parametrize("impl", ["classic", "attnpool", "attnpool-staged"])
@pytest.mark.parametrize("bs", LORA_BS)
def test_lora_update(label: Callable[..., None], timed: Callable[..., None],
                     device: torch.device, one_thread: int, bs: int, impl: str) -> None:
    cfg = LoRAConfig(device=device, **LORA_CFG)
    w, lens, ranks, scal = _inputs(bs)
    pool = LoRABatchPool(cfg, staging=True if impl == "attnpool-staged" else None)
    classic = Classic(cfg)
    view = pool.update_(bs, w, lens, ranks, scal)
    classic.step(bs, w, lens, ranks, scal)
    assert _same(view, classic)  # like for like: the same metadata
    label("lora-update", f"bs{bs}", impl, n=len(w), threads=one_thread, **LORA_CFG)
    if impl == "classic":
        timed(lambda: classic.step(bs, w, lens, ranks, scal), budget_s=0.25)
    else:
        timed(lambda: pool.update_(bs, w, lens, ranks, scal), budget_s=0.25)

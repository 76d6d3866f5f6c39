"""Workloads for compute-sanitizer's initcheck: the ``torch.empty`` contract on a real GPU.

initcheck reports every read of device memory that nothing wrote since it was allocated. The pools
here are built without poison (``torch.empty`` arenas, as in production), so an update or capture
state that leaves part of a read region unwritten, or a kernel that reads past it, is reported.
Only readers that stay inside the read region run on the views: :func:`touch_read_region` (index
reads of exactly the elements the contract names) and the kernels (FlashInfer's wrappers, FA3).
The SDPA adapter is not used: it gathers whole page-table rows and masks afterwards.

``.ci/gpu`` runs them twice (see it for the commands):

* eager, with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``: every allocation is its own ``cudaMalloc``, so
  initcheck sees exactly which arena bytes each capture state and update wrote, for the reference
  and the fused update paths and every phase;
* graph replays, with the caching allocator on (PyTorch refuses to capture without it): the
  kernels replayed from graphs read only written bytes of the arena (allocated first, from an
  emptied cache, so it is fresh memory), the FlashInfer workspace and the graphs' own buffers.

Without a GPU they skip; with ``ATTNPOOL_REQUIRE_KERNELS=1`` a missing kernel library fails the
graph test instead of skipping it (the sanitizer step would otherwise prove nothing).
"""

from __future__ import annotations

import gc
import os
import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import Impl, PagedView
from attnpool.adapters import flashinfer as fi

from tests.core.test_graph_phases import (
    CASES,
    H_KV,
    HEAD_DIM,
    Case,
    H,
    inputs,
    make_pool,
    parts_of,
    replay_stream,
)
from tests.helpers.batches import make_table

pytestmark = pytest.mark.cuda
STEPS = int(os.environ.get("ATTNPOOL_INITCHECK_STEPS", "20"))


def touch_read_region(part: PagedView) -> Tensor:
    """A device sum of every element of ``part``'s read region, and of nothing else."""
    bs, p = part.bs, part.page_size
    lens = part.cache_seqlens[:bs].to(torch.int64)
    total = lens.sum() + part.cu_seqlens_q[: bs + 1].sum() + part.cu_seqlens_k[: bs + 1].sum()
    npages = torch.div(lens + p - 1, p, rounding_mode="floor")
    if part.page_table is not None:
        cols = torch.arange(part.page_table.shape[1], device=lens.device)
        live = cols[None, :] < npages[:, None]
        total = total + part.page_table[:bs][live].sum()  # boolean index: reads live cells only
    if part.kv_indptr is not None and part.kv_indices is not None:
        assert part.kv_last_page_len is not None
        indptr = part.kv_indptr[: bs + 1]
        total = total + indptr.sum() + part.kv_last_page_len[:bs].sum()
        total = total + part.kv_indices[: int(indptr[-1])].sum()
    return total


def _flashinfer(dev: torch.device) -> fi.GraphWrappers | None:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return None
    return fi.GraphWrappers(torch.empty(128 << 20, dtype=torch.uint8, device=dev))


@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.AUTO], ids=["reference", "fused"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_eager_updates_write_every_read_region(case: Case, impl: Impl) -> None:
    dev = torch.device("cuda")
    pool = make_pool(case, dev, impl, poison=False)
    ph: Any = pool.phase(case.phase)
    vk = case.view_kwargs or {}
    rng = random.Random(7)
    table = make_table(pool.cfg, 48, rng).to(dev)
    d = HEAD_DIM["flashinfer"]
    wrappers = None if case.name == "draft-chain" else _flashinfer(dev)  # no CSR in chain rounds
    pages = int(table.max()) // pool.cfg.page_size + 2
    k, v = (torch.randn(pages, pool.cfg.page_size, H_KV, d, device=dev, dtype=torch.bfloat16)
            for _ in range(2))
    sums: list[Tensor] = []

    def read(view: Any, plan_first: bool) -> None:
        for p in parts_of(view):
            sums.append(touch_read_region(p))
            if wrappers is None:
                continue
            if plan_first:
                wrappers.wrapper(p)
            wrappers.plan(p, num_qo_heads=H, num_kv_heads=H_KV, head_dim=d,
                          q_dtype=torch.bfloat16)
            rows = max(int(p.cu_seqlens_q[p.bs]), p.bs)
            q = torch.randn(rows, H, d, device=dev, dtype=torch.bfloat16)
            sums.append(wrappers.run(p, q, k, v).out.float().sum())

    for bs in (1, 5, 16):  # capture states first (they fix each wrapper's most rows)
        read(ph.view(bs, **vk), plan_first=True)
    for _ in range(STEPS):
        n = rng.randint(1, 16)
        bs = rng.choice([b for b in (1, 5, 16) if b >= n])
        read(ph.update_(bs, **inputs(case, pool.cfg, n, rng, table, dev), **vk), plan_first=False)
    torch.cuda.synchronize()
    assert all(bool(torch.isfinite(s.float())) for s in sums)


@pytest.mark.parametrize("case", [c for c in CASES if c.name != "draft-chain"],
                         ids=[c.name for c in CASES if c.name != "draft-chain"])
def test_graph_replays_read_written_memory(case: Case) -> None:
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        if os.environ.get("ATTNPOOL_REQUIRE_KERNELS") == "1":
            pytest.fail(f"flashinfer is required here: {e}")
        pytest.skip(f"flashinfer not installed: {e}")
    gc.collect()
    torch.cuda.empty_cache()  # the arena comes from fresh device memory
    # memory is checked by the kernels-graphs run of the same replays: under the sanitizer the
    # caching allocator's count grows by megabytes per step, so it is not checked here
    replay_stream(case, torch.device("cuda"), steps=STEPS, backend="flashinfer", poison=False,
                  check_memory=False)

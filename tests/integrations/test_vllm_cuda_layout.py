"""vLLM's CUDA KV cache layouts read by the real kernels through attnpool's views.

vLLM allocates every layer's cache itself, zeroed, block 0 being its null block (no request owns
it; padded tokens are stored there). Its FlashAttention backend allocates ``[2, num_blocks,
block_size, H_kv, D]`` per layer, which :func:`attnpool.integrations.vllm.cache.cuda_views` splits
into the NHD caches ``k_cache, v_cache [num_blocks, block_size, H_kv, D]`` (contiguous, no copy);
its FlashInfer backend allocates ``[num_blocks, 2, block_size, H_kv, D]``, whose ``kv[:, 0]`` /
``kv[:, 1]`` are strided views (a page stride of twice a page). The engine's store
(``slot_index_`` + ``store_``) writes a batch's K/V at the slots of its ``req_to_token`` rows; then
a decode step (``pool.decode.update_``) and a mixed extend step (decode rows, a prefill chunk on a
cached prefix, a whole prompt: ``pool.extend.update_``) are read by flash-attn 4 and FlashInfer
over those views and compared with the SDPA adapter on the same views in float32 (bf16 cache).
If an adapter refuses the strided FlashInfer-layout views, the refusal must be a clear
:class:`attnpool.PoolError`, not a kernel failure.

On CUDA each kernel library is used when it loads (else the case skips with the import error);
on CPU the same logic runs against the fakes (``fakes_fa4.py``, ``fakes_flashinfer.py``), which
assert the real interfaces' checks.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Layout, PagedView, PoolConfig, PoolError
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import sdpa
from attnpool.integrations.vllm.cache import cuda_views, slot_index_, store_

from tests.helpers import fakes_flashinfer
from tests.helpers.batches import make_table
from tests.helpers.fakes_fa4 import FA4

H, H_KV, P = 4, 2, 16
BF16 = torch.bfloat16
ROWS = 8  # req_to_token rows
TOL = 2e-2  # bf16 cache and queries, float32 accumulation in both
LAYOUTS = ["flash_attn", "flashinfer"]  # vLLM backend whose cache shape is used
BACKENDS = ["fa4", "flashinfer"]
PHASES = ["decode", "extend"]


@dataclass(frozen=True)
class Dims:
    """head dim, max_context_len, T = max_extend_tokens, max_bs."""

    d: int
    c: int
    t: int
    max_bs: int


CUDA_DIMS = Dims(d=128, c=512, t=256, max_bs=4)
CPU_DIMS = Dims(d=64, c=128, t=64, max_bs=4)


@dataclass
class Setup:
    """One pool, one vLLM-shaped cache and its (k_cache, v_cache) views, and the table."""

    pool: BufferPool
    kv: Tensor
    k: Tensor
    v: Tensor
    table: Tensor


def setup(layout: str, dims: Dims, dev: torch.device, seed: int) -> Setup:
    """A pool whose pad page is vLLM's null block 0, and a zeroed cache of the given layout."""
    cfg = PoolConfig(max_bs=dims.max_bs, max_context_len=dims.c, page_size=P, device=dev,
                     layout=Layout.BOTH, pad_page=0, max_extend_tokens=dims.t)
    pool = BufferPool(cfg, poison=True)
    table = make_table(cfg, ROWS, random.Random(seed)).to(dev)  # pages 1..: block 0 unused
    blocks = int(table.max()) // P + 1
    if layout == "flash_attn":
        kv = torch.zeros(2, blocks, P, H_KV, dims.d, dtype=BF16, device=dev)
        k, v = cuda_views(kv)
        assert k.is_contiguous() and v.is_contiguous()
    else:
        kv = torch.zeros(blocks, 2, P, H_KV, dims.d, dtype=BF16, device=dev)
        k, v = kv[:, 0], kv[:, 1]
        assert not k.is_contiguous() and k.stride(0) == 2 * P * H_KV * dims.d
    for t in (k, v):  # views of the cache's own memory, no copy
        assert t.shape == (blocks, P, H_KV, dims.d)
        assert t.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
        assert kv.data_ptr() <= t.data_ptr() < kv.data_ptr() + kv.nbytes
    return Setup(pool, kv, k, v, table)


def store_batch(s: Setup, seq: list[int], rpi: list[int], g: torch.Generator) -> None:
    """vLLM's store of every token of the batch's requests (their whole sequences, the new
    tokens included: the caller stores before attention) at their ``req_to_token`` slots."""
    dev = s.kv.device
    slots = torch.cat([s.table[r, :n] for r, n in zip(rpi, seq, strict=True)])
    total = slots.shape[0]
    blocks = torch.empty(total + 3, dtype=torch.int64, device=dev)  # staging: longer is fine
    offsets = torch.empty_like(blocks)
    slot_index_(slots, P, blocks, offsets)
    d = s.k.shape[-1]
    key = torch.randn(total, H_KV, d, generator=g).to(dev, BF16)
    value = torch.randn(total, H_KV, d, generator=g).to(dev, BF16)
    store_(s.k, s.v, key, value, blocks, offsets)
    assert torch.equal(s.k[blocks[:total], offsets[:total]], key)
    assert torch.equal(s.v[blocks[:total], offsets[:total]], value)
    assert not s.k[0].any() and not s.v[0].any(), "block 0 is vLLM's null block: never stored"


def mixed(n: int, dims: Dims, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(seq_lens, extend_lens)``: a decode row, a chunk on a cached prefix, a whole prompt,
    then random rows of those kinds; new tokens sum to at most T."""
    seq: list[int] = []
    ext: list[int] = []
    for i in range(n):
        kind = ["decode", "chunk", "whole"][i] if i < 3 else rng.choice(["decode", "chunk"])
        budget = dims.t - sum(ext) - (n - i - 1)
        e = 1 if kind == "decode" else rng.randint(1, min(budget, dims.c // 2))
        seq.append(e if kind == "whole" else e + rng.randint(1, dims.c - e))
        ext.append(e)
    return seq, ext


def _close(got: Tensor, want: Tensor, where: str) -> None:
    """``assert_close`` at :data:`TOL` whose message says which case failed."""
    def msg(m: str) -> str:
        return f"{where}: {m}"

    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=msg)


def _fi_plan(w: Any, view: PagedView, d: int) -> None:
    w.plan(view, num_qo_heads=H, num_kv_heads=H_KV, head_dim=d, q_dtype=BF16)


def check_layout(layout: str, phase: str, backend: str, dims: Dims, dev: torch.device,
                 kernel: fa.FlashKernel | None) -> tuple[Tensor, Tensor] | None:
    """Store a batch, update the phase, run ``backend`` over the cache views and compare with
    SDPA (the same views, float32). Returns the (k, v) views given to the kernel, or None when
    the adapter refused the layout (with a clear :class:`PoolError`)."""
    seed = LAYOUTS.index(layout) * 4 + PHASES.index(phase) * 2 + BACKENDS.index(backend)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    s = setup(layout, dims, dev, seed)
    bs = dims.max_bs
    ph = s.pool.decode if phase == "decode" else s.pool.extend
    wrappers = None
    if backend == "flashinfer":
        from attnpool.adapters import flashinfer as fi

        ws = torch.empty(128 << 20 if dev.type == "cuda" else 1 << 10, dtype=torch.uint8,
                         device=dev)
        wrappers = fi.GraphWrappers(ws)
        cap = ph.view(bs)  # a graph's wrapper sits on the capture view, planned first
        wrappers.wrapper(cap)
        _fi_plan(wrappers, cap, dims.d)
    # decode: a padded batch; extend: a padded one (first padded row takes the slack up to T),
    # then bs requests (cu_seqlens_q[bs] < T, fewer rows than the capture's plan)
    for n in ([bs - 1] if phase == "decode" else [bs - 1, bs]):
        rpi = rng.sample(range(ROWS), n)
        if phase == "decode":
            seq = [rng.choice([1, dims.c, rng.randint(1, dims.c)]) for _ in range(n)]
            ext = [1] * n
        else:
            seq, ext = mixed(n, dims, rng)
        store_batch(s, seq, rpi, g)
        kw: dict[str, Any] = {"seq_lens": torch.tensor(seq, device=dev),
                              "req_pool_indices": torch.tensor(rpi, device=dev),
                              "req_to_token": s.table}
        view: PagedView
        if phase == "decode":
            view = s.pool.decode.update_(bs, **kw)
            q_rows, rows = bs, n
        else:
            view = s.pool.extend.update_(bs, extend_lens=torch.tensor(ext, device=dev), **kw)
            q_rows, rows = dims.t, sum(ext)
        q = torch.zeros(q_rows, H, dims.d, dtype=BF16, device=dev)
        q[:rows] = torch.randn(rows, H, dims.d, generator=g).to(dev, BF16)
        try:
            if wrappers is not None:
                _fi_plan(wrappers, view, dims.d)
                got = wrappers.attention(view, q, s.k, s.v)
            else:
                got = fa.attention(view, q, s.k, s.v, version=fa.FlashAttnVersion.FA4,
                                   kernel=kernel)
        except PoolError as e:
            if layout == "flash_attn":
                raise  # contiguous NHD pages: every adapter must take them
            msg = str(e).lower()
            assert any(w in msg for w in ("stride", "contiguous", "layout")), msg
            print(f"{backend} refuses vLLM's FlashInfer-layout views: {e}")
            return None
        want = sdpa.attention(view, q.float(), s.k.float(), s.v.float())
        where = f"{layout} {phase} {backend} n={n}"
        for name, a, b in (("out", got.out, want.out), ("lse", got.lse, want.lse)):
            _close(a[:rows].float(), b[:rows], f"{where} {name}")
    return s.k, s.v


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[FA4]:
    """``flash_attn.cute`` and ``flashinfer`` as CPU fakes that enforce the real checks (none
    of the real modules); returns the FA4 fake, whose ``calls`` keep every call's arguments."""
    fake = FA4()
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake.module())
    monkeypatch.setitem(sys.modules, "flashinfer", fakes_flashinfer.module())
    fa.clear_kernel_cache()
    yield fake
    fa.clear_kernel_cache()


def test_cuda_views_refuse_other_shapes() -> None:
    """A cache of vLLM's FlashInfer shape is not the FlashAttention one: refused, not misread."""
    with pytest.raises(PoolError, match=r"\[2, num_blocks"):
        cuda_views(torch.zeros(3, 2, P, H_KV, 8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_cache_layout_cpu(fake_kernels: FA4, layout: str, phase: str, backend: str) -> None:
    kernel = fa.load_fa4() if backend == "fa4" else None
    views = check_layout(layout, phase, backend, CPU_DIMS, torch.device("cpu"), kernel)
    assert views is not None, "the adapters take both layouts' views"
    if backend == "fa4":  # the kernel got the cache views themselves, not copies
        k, v = views
        assert fake_kernels.calls, "FA4 was not called"
        for call in fake_kernels.calls:
            assert call["k"].data_ptr() == k.data_ptr() and call["k"].stride() == k.stride()
            assert call["v"].data_ptr() == v.data_ptr() and call["v"].stride() == v.stride()


def _kernel_or_skip(backend: str) -> fa.FlashKernel | None:
    """The real kernel library of ``backend``; skips with the import error when it is missing."""
    try:
        if backend == "fa4":
            return fa.load_fa4()
        import flashinfer  # noqa: F401
    except ImportError as e:
        pytest.skip(f"{backend} does not load: {e}")
    return None


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_cache_layout_cuda(layout: str, phase: str, backend: str) -> None:
    kernel = _kernel_or_skip(backend)
    check_layout(layout, phase, backend, CUDA_DIMS, torch.device("cuda"), kernel)

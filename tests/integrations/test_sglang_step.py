"""attnpool's SGLang backend without SGLang: the pool sized from a runner, the refill from
SGLang-shaped batches (``req_to_token`` + ``req_pool_indices``, token slots in a
``[slots, H_kv, D]`` KV buffer), checked against dense attention, and its per-batch cost in
allocations. (tests/integrations/sglang/ runs SGLang itself, in its own environment.)"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from attnpool import BufferPool, CapacityError, InputError
from attnpool.adapters.backends import Backend
from attnpool.config import Impl
from attnpool.integrations.sglang.step import BatchFiller, RunnerSizes, kv_pages

from tests.helpers.dense import dense_attention
from tests.helpers.fakes_fa4 import FA4
from tests.helpers.graph_replay import capture
from tests.helpers.opcount import count

H, H_KV, D = 4, 2, 32
REQS, WIDTH = 6, 160


def _filler(page: int, window: int | None = None, impl: Impl = Impl.REFERENCE,
            masked: bool = False) -> BatchFiller:
    sizes = RunnerSizes(max_requests=REQS, max_context_len=WIDTH, max_extend_tokens=96,
                        page_size=page, sliding_window=window, num_pages=1024 // page,
                        device=torch.device("cpu"))
    f = BatchFiller(sizes, Backend.SDPA, H, H_KV, torch.float64, masked=masked)
    if impl is not Impl.REFERENCE:
        f.pool = BufferPool(dataclasses.replace(f.pool.cfg, impl=impl))
    return f


def _table(page: int, lens: list[int], rows: list[int], seed: int = 0) -> torch.Tensor:
    """SGLang's ``req_to_token``: each request's positions on token slots of its own pages,
    pages drawn at random from 1.. (page 0 holds SGLang's padding slot), -1 past them."""
    rng = random.Random(seed)
    table = torch.full((REQS, WIDTH), -1, dtype=torch.int32)
    free = list(range(1, 1024 // page))
    rng.shuffle(free)
    for r, n in zip(rows, lens, strict=True):
        for p in range(-(-n // page)):
            base = free.pop() * page
            hi = min(n, (p + 1) * page)
            table[r, p * page:hi] = torch.arange(base, base + hi - p * page)
    return table


def _check_attention(f: BatchFiller, run: object, table: torch.Tensor, rows: list[int],
                     lens: list[int], q_lens: list[int], window: int | None,
                     softcap: float = 0.0) -> None:
    torch.manual_seed(1)
    k_buf = torch.randn(1024, H_KV, D, dtype=torch.float64)  # SGLang's [slots, H_kv, D]
    v_buf = torch.randn(1024, H_KV, D, dtype=torch.float64)
    q = torch.randn(sum(q_lens), H, D, dtype=torch.float64)
    k, v = kv_pages(k_buf, f.sizes.page_size), kv_pages(v_buf, f.sizes.page_size)
    assert k.data_ptr() == k_buf.data_ptr()  # read in place
    out = run(q, k, v, D ** -0.5, window=window is not None, softcap=softcap)  # type: ignore[operator]
    keys = []
    for r, n, qn in zip(rows, lens, q_lens, strict=True):
        for j in range(qn):
            pos = n - qn + j
            lo = 0 if window is None else max(0, pos - window + 1)
            keys.append(table[r, lo:pos + 1].tolist())
    ref, _ = dense_attention(q, k_buf.unsqueeze(1), v_buf.unsqueeze(1), keys, D ** -0.5,
                             softcap=softcap)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [None, 24])
def test_decode_batch_reads_req_to_token(page: int, window: int | None) -> None:
    rows, lens = [4, 0, 2], [37, 1, 150]
    table = _table(page, lens, rows)
    f = _filler(page, window)
    run = f.fill(decode=True, req_pool_indices=torch.tensor(rows), req_to_token=table,
                 seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens), num_tokens=3)
    view = run.view
    assert view.cache_seqlens[:3].tolist() == lens
    for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
        pages = -(-n // page)
        assert view.page_table[i, :pages].tolist() == (table[r, :n:page] // page).tolist()
    _check_attention(f, run, table, rows, lens, [1, 1, 1], window)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("window", [None, 24])
def test_mixed_extend_batch(page: int, window: int | None) -> None:
    """SGLang's mixed chunk: a prefill chunk over a cached prefix (radix hit or an earlier
    chunk), a fresh prompt and decode rows extending by one, in one extend batch."""
    rows, lens, q_lens = [1, 3, 5, 0], [70, 13, 41, 120], [30, 13, 1, 1]
    table = _table(page, lens, rows, seed=3)
    f = _filler(page, window, masked=True)
    prefix = [n - q for n, q in zip(lens, q_lens, strict=True)]
    run = f.fill(decode=False, req_pool_indices=torch.tensor(rows), req_to_token=table,
                 seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens),
                 num_tokens=sum(q_lens), extend_seq_lens=torch.tensor(q_lens),
                 extend_seq_lens_cpu=q_lens, extend_prefix_lens_cpu=prefix)
    assert run.view.cu_seqlens_q[:5].tolist() == [0, 30, 43, 44, 45]
    _check_attention(f, run, table, rows, lens, q_lens, window, softcap=5.0)


def test_prefill_without_prefix_takes_the_causal_shortcut() -> None:
    """A prefill with nothing cached binds SDPA's own causal mask (no mask built), unless the
    layers need the adapter's mask (softcap, sinks: ``masked``); a cached prefix never does."""
    rows, lens = [0, 2], [20, 9]
    table = _table(1, lens, rows)
    for masked, prefix, shortcut in ((False, [0, 0], True), (True, [0, 0], False),
                                     (False, [4, 0], False)):
        f = _filler(1, masked=masked)
        q_lens = [n - p for n, p in zip(lens, prefix, strict=True)]
        run = f.fill(decode=False, req_pool_indices=torch.tensor(rows), req_to_token=table,
                     seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens),
                     num_tokens=sum(q_lens), extend_seq_lens=torch.tensor(q_lens),
                     extend_seq_lens_cpu=q_lens, extend_prefix_lens_cpu=prefix)
        assert run._args[4] is shortcut
        _check_attention(f, run, table, rows, lens, q_lens, None)


def test_refusals_leave_the_pool_unchanged() -> None:
    f = _filler(16)
    table = _table(16, [10], [0])
    before = f.pool.arena.storage.view(torch.uint8).clone()
    with pytest.raises(CapacityError, match="max_extend_tokens=96"):
        f.fill(decode=False, req_pool_indices=torch.tensor([0]), req_to_token=table,
               seq_lens=torch.tensor([100]), seq_lens_cpu=torch.tensor([100]), num_tokens=100,
               extend_seq_lens=torch.tensor([100]), extend_seq_lens_cpu=[100],
               extend_prefix_lens_cpu=[0])
    with pytest.raises(InputError, match="extend_seq_lens"):
        f.fill(decode=False, req_pool_indices=torch.tensor([0]), req_to_token=table,
               seq_lens=torch.tensor([10]), seq_lens_cpu=torch.tensor([10]), num_tokens=10)
    assert torch.equal(f.pool.arena.storage.view(torch.uint8), before)


def test_kv_pages_refuses_what_is_not_a_token_buffer() -> None:
    buf = torch.zeros(48, H_KV, D)
    assert kv_pages(buf, 16).shape == (3, 16, H_KV, D)
    with pytest.raises(InputError, match="divisible by page_size=32"):
        kv_pages(buf, 32)
    with pytest.raises(InputError, match=r"\[slots, H_kv, D\]"):
        kv_pages(buf.transpose(1, 2), 16)
    with pytest.raises(InputError, match=r"\[slots, H_kv, D\]"):
        kv_pages(buf.view(3, 16, H_KV, D), 16)


def test_refill_allocates_nothing_on_the_fused_path() -> None:
    """Once warm, a decode batch's refill allocates no tensor: SGLang's table is read in
    place and the fused update writes the arena (the adapter's plan is the forward's, made by
    its first layer)."""
    pytest.importorskip("triton")
    rows, lens = [4, 0, 2], [37, 5, 150]
    table = _table(16, lens, rows)
    f = _filler(16, impl=Impl.TRITON)
    kw = {"decode": True, "req_pool_indices": torch.tensor(rows), "req_to_token": table,
          "seq_lens": torch.tensor(lens), "seq_lens_cpu": torch.tensor(lens), "num_tokens": 3}
    f.fill(**kw)  # type: ignore[arg-type]
    c = count(lambda: f.fill(**kw))  # type: ignore[arg-type]
    assert not c.made, c.ops
    assert c.launches == 1


def test_decode_graph_capture_and_replay_refill_the_same_view() -> None:
    """What SGLang's decode graph runner relies on (``init_forward_metadata_out_graph``): the
    captured view's tensors are refilled in place before each replay (the addresses a graph
    bakes in), its host bounds stay the capture's static ones, padded rows (SGLang's fill
    value 1, request row 0) read valid pages, nothing is read back from the device and, on
    the fused path, nothing is allocated."""
    pytest.importorskip("triton")
    from attnpool.adapters.binding import bind

    f = _filler(16, impl=Impl.TRITON)
    captured = f.capture(4).view
    ptrs = [t.data_ptr() for t in (captured.cache_seqlens, captured.page_table,
                                   captured.cu_seqlens_k)]
    rows, lens = [4, 2, 0, 0], [37, 150, 1, 1]  # two real rows, two padded ones
    table = _table(16, [37, 150], [4, 2])
    table[0, 0] = 5 * 16  # (row 0 of the request table: SGLang reserves it; any slot in range)
    kw = {"req_pool_indices": torch.tensor(rows), "req_to_token": table,
          "seq_lens": torch.tensor(lens)}
    f.replay(4, **kw)  # type: ignore[arg-type]
    c = count(lambda: f.replay(4, **kw))  # type: ignore[arg-type]
    view = f.replay(4, **kw)  # type: ignore[arg-type]
    assert [t.data_ptr() for t in (view.cache_seqlens, view.page_table,
                                   view.cu_seqlens_k)] == ptrs
    assert view.max_seqlen_k == captured.max_seqlen_k == WIDTH  # static, not the batch's
    assert view.cache_seqlens[:4].tolist() == lens
    assert view.page_table[2:, 0].tolist() == [5, 5]
    assert not c.host_reads, c.ops
    assert not c.made, c.ops
    # the replayed view attends the real rows as an eager refill would
    run = bind(f.backend, view, 4, H, H_KV, torch.float64)
    _check_real_rows(f, run, table, rows[:2], lens[:2])


def _check_real_rows(f: BatchFiller, run: object, table: torch.Tensor, rows: list[int],
                     lens: list[int]) -> None:
    torch.manual_seed(2)
    k_buf = torch.randn(1024, H_KV, D, dtype=torch.float64)
    v_buf = torch.randn(1024, H_KV, D, dtype=torch.float64)
    q = torch.randn(4, H, D, dtype=torch.float64)
    out = run(q, kv_pages(k_buf, 16), kv_pages(v_buf, 16), D ** -0.5)  # type: ignore[operator]
    keys = [table[r, :n].tolist() for r, n in zip(rows, lens, strict=True)]
    ref, _ = dense_attention(q[:2], k_buf.unsqueeze(1), v_buf.unsqueeze(1), keys, D ** -0.5)
    torch.testing.assert_close(out[:2], ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("decode", [True, False])
def test_flash_attn_reads_sglangs_buffers_in_place(fake_fa4: FA4, decode: bool) -> None:
    """On CUDA with flash-attn 4 (the CPU fake here), a layer's call hands the kernel the KV
    pool's buffers themselves, seen as pages, and agrees with the SDPA adapter on the same
    refilled view (bfloat16 cache, float32 comparison)."""
    from attnpool.adapters.binding import bind

    rows, lens = [1, 3, 5, 0], [70, 13, 41, 120]
    q_lens = [1, 1, 1, 1] if decode else [30, 13, 1, 1]
    table = _table(16, lens, rows, seed=5)
    sizes = RunnerSizes(max_requests=REQS, max_context_len=WIDTH, max_extend_tokens=96,
                        page_size=16, sliding_window=None, num_pages=64,
                        device=torch.device("cpu"))
    f = BatchFiller(sizes, Backend.FA4, H, H_KV, torch.bfloat16)
    kw: dict[str, object] = {"decode": decode, "req_pool_indices": torch.tensor(rows),
                             "req_to_token": table, "seq_lens": torch.tensor(lens),
                             "seq_lens_cpu": torch.tensor(lens), "num_tokens": sum(q_lens)}
    if not decode:
        kw |= {"extend_seq_lens": torch.tensor(q_lens), "extend_seq_lens_cpu": q_lens,
               "extend_prefix_lens_cpu": [n - q for n, q in zip(lens, q_lens, strict=True)]}
    run = f.fill(**kw)  # type: ignore[arg-type]
    torch.manual_seed(3)
    k_buf = torch.randn(1024, H_KV, D).to(torch.bfloat16)  # SGLang's [slots, H_kv, D]
    v_buf = torch.randn(1024, H_KV, D).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), H, D).to(torch.bfloat16)
    k, v = kv_pages(k_buf, 16), kv_pages(v_buf, 16)
    out = run(q, k, v, D ** -0.5)
    assert fake_fa4.calls and all(c["k"].data_ptr() == k_buf.data_ptr()
                                  and c["v"].data_ptr() == v_buf.data_ptr()
                                  for c in fake_fa4.calls)
    want = bind(Backend.SDPA, run.view, sum(q_lens), H, H_KV, torch.float32)(
        q.float(), k.float(), v.float(), D ** -0.5)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_recorded_refill_writes_what_the_replay_refill_writes() -> None:
    """SGLang's in-graph part on the fused path: the capturable refill (``num_real``, recorded
    with the graph) writes the captured view's read region exactly as the ordinary refill
    before a replay does, reads nothing back and, once its count exists, allocates nothing."""
    pytest.importorskip("triton")
    rows, lens = [4, 2, 0, 0], [37, 150, 1, 1]
    table = _table(16, [37, 150], [4, 2])
    kw = {"req_pool_indices": torch.tensor(rows), "req_to_token": table,
          "seq_lens": torch.tensor(lens)}
    fused, ref = _filler(16, impl=Impl.TRITON), _filler(16)
    assert fused.recordable and not ref.recordable
    got = fused.capture(4).view
    fused.replay(4, recorded=True, **kw)  # type: ignore[arg-type]
    c = count(lambda: fused.replay(4, recorded=True, **kw))  # type: ignore[arg-type]
    want = ref.replay(4, **kw)  # type: ignore[arg-type]
    assert torch.equal(got.cache_seqlens[:4], want.cache_seqlens[:4])
    assert torch.equal(got.cu_seqlens_k[:5], want.cu_seqlens_k[:5])
    for i, n in enumerate(lens):
        pages = -(-n // 16)
        assert torch.equal(got.page_table[i, :pages], want.page_table[i, :pages])
    assert not c.host_reads, c.ops
    assert not c.made, c.ops
    assert c.launches == 1


def _flashinfer_filler(dev: torch.device, backend: Backend = Backend.FLASHINFER,
                       d: int = D) -> BatchFiller:
    from attnpool.adapters.flashinfer_step import LayerFacts

    sizes = RunnerSizes(max_requests=REQS, max_context_len=WIDTH, max_extend_tokens=96,
                        page_size=16, sliding_window=24, num_pages=64, device=dev)
    dtype = torch.float32 if backend is Backend.SDPA else torch.bfloat16
    facts = LayerFacts(H, H_KV, d, dtype, d ** -0.5) if backend is Backend.FLASHINFER else None
    return BatchFiller(sizes, backend, H, H_KV, dtype, facts=facts)


def kernel_forwards(dev: torch.device, backend: Backend, d: int = D) -> BatchFiller:
    """``backend`` (FlashInfer or flash-attn) through the filler: an eager decode and a mixed
    extend forward (full and sliding-window layers), then a decode graph captured at 4 rows
    and replayed over refills with padded rows, each against the SDPA filler refilled from the
    same batch (head size ``d``). Returns the filler."""
    f, ref = _flashinfer_filler(dev, backend, d=d), _flashinfer_filler(dev, Backend.SDPA, d=d)
    gen = torch.Generator().manual_seed(4)
    k_buf = torch.randn(1024, H_KV, d, generator=gen).to(dev, torch.bfloat16)
    v_buf = torch.randn(1024, H_KV, d, generator=gen).to(dev, torch.bfloat16)
    k, v = kv_pages(k_buf, 16), kv_pages(v_buf, 16)
    kf, vf = k.float(), v.float()

    def batch(rows: list[int], lens: list[int], q_lens: list[int], seed: int,
              decode: bool) -> dict[str, object]:
        table = _table(16, [n for n, r in zip(lens, rows, strict=True) if r >= 0], rows,
                       seed=seed).to(dev)
        kw: dict[str, object] = {"decode": decode, "req_pool_indices": torch.tensor(rows, device=dev),
                                 "req_to_token": table, "seq_lens": torch.tensor(lens, device=dev),
                                 "seq_lens_cpu": torch.tensor(lens), "num_tokens": sum(q_lens)}
        if not decode:
            kw |= {"extend_seq_lens": torch.tensor(q_lens, device=dev),
                   "extend_seq_lens_cpu": q_lens,
                   "extend_prefix_lens_cpu": [n - q for n, q in zip(lens, q_lens, strict=True)]}
        return kw

    for i, (rows, lens, q_lens) in enumerate([([1, 3, 5], [70, 13, 41], [1, 1, 1]),
                                              ([1, 3, 5, 0], [70, 13, 41, 120], [30, 13, 1, 1])]):
        kw = batch(rows, lens, q_lens, i, decode=i == 0)
        run, want_run = f.fill(**kw), ref.fill(**kw)  # type: ignore[arg-type]
        q = torch.randn(sum(q_lens), H, d, generator=gen).to(dev, torch.bfloat16)
        for window in (False, True):
            out = run(q, k, v, d ** -0.5, window=window)
            want = want_run(q.float(), kf, vf, d ** -0.5, window=window)
            torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    run = f.capture(4)
    q = torch.zeros(4, H, d, dtype=torch.bfloat16, device=dev)
    replay, out = capture(lambda: run(q, k, v, d ** -0.5), dev)
    steps = CUDA_GRAPH_STEPS if dev.type == "cuda" else 3
    rng = random.Random(9)
    for step in range(steps):
        n = rng.randint(1, 4)
        rows = rng.sample(range(1, REQS), n) + [0] * (4 - n)
        lens = [rng.randint(1, WIDTH) for _ in range(n)] + [1] * (4 - n)
        kw = batch(rows[:n], lens[:n], [1] * n, 100 + step, decode=True)
        table = kw["req_to_token"]
        assert isinstance(table, torch.Tensor)
        table[0, 0] = 5 * 16  # (row 0, SGLang's padding row: a slot in range)
        view = f.replay(4, req_pool_indices=torch.tensor(rows, device=dev),
                        req_to_token=table, seq_lens=torch.tensor(lens, device=dev))
        q.copy_(torch.randn(4, H, d, generator=gen).to(dev, torch.bfloat16))
        replay()
        want = ref.fill(**kw)(q[:n].float(), kf, vf, d ** -0.5)  # type: ignore[arg-type]
        torch.testing.assert_close(out[:n].float(), want, rtol=2e-2, atol=2e-2,
                                   msg=f"replay {step}")
    if f.plans is not None:
        assert len(f.plans.graph) == 2  # the 4-row view's two parts
        wrapper = f.plans.graph.wrapper(view)
        if hasattr(wrapper, "plans"):  # (the fakes count plans: one at capture, one per replay)
            assert wrapper.plans == steps + 1
    return f


CUDA_GRAPH_STEPS = min(100, int(os.environ.get("ATTNPOOL_GRAPH_STEPS", "100")))


def test_flashinfer_plans_each_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer (the CPU fakes): the filler plans every part of a forward when it refills,
    the captured size's decode view on its graph wrapper, planned again by every replay; the
    layers' calls agree with SDPA. A recorded refill is refused (its plan is host work)."""
    import sys

    from attnpool import LayoutError

    from tests.helpers import fakes_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fakes_flashinfer.module())
    kernel_forwards(torch.device("cpu"), Backend.FLASHINFER)
    f = _flashinfer_filler(torch.device("cpu"))
    assert not f.recordable
    f.capture(2)
    with pytest.raises(LayoutError, match="recorded refill"):
        f.replay(2, req_pool_indices=torch.tensor([1, 2]), req_to_token=_table(16, [3, 4], [1, 2]),
                 seq_lens=torch.tensor([3, 4]), recorded=True)


def test_flash_attn_forwards_and_decode_graph(fake_fa4: FA4) -> None:
    """The same forwards and decode graph with flash-attn 4 (the CPU fake): every replay's
    kernel call reads the captured view's own tensors."""
    kernel_forwards(torch.device("cpu"), Backend.FA4)
    graph_calls = [c for c in fake_fa4.calls if c["q"].shape[0] == 4]  # (the 4-row graph)
    assert len(graph_calls) >= 3 + 3  # warm-ups, capture, one per replay
    assert len({c["page_table"].data_ptr() for c in graph_calls}) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("backend", [Backend.FLASHINFER, Backend.FA4], ids=["flashinfer", "fa4"])
def test_kernel_forwards_cuda(backend: Backend) -> None:
    if backend is Backend.FLASHINFER:
        pytest.importorskip("flashinfer")
    else:
        from attnpool.adapters import flash_attn as fa

        try:
            fa.load_fa4()
        except ImportError as e:
            pytest.skip(f"flash_attn.cute does not load: {e}")
    kernel_forwards(torch.device("cuda"), backend, d=128)

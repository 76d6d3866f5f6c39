"""FlashMLA's dense decode kernel fed from the pool's scheduler metadata == absorbed SDPA, in
both API forms (the argument layout, and ``DecodingSchedMeta`` rows in a ``FlashMLASchedMeta``).

The kernel is a fake built from FlashMLA's source (``tests/helpers/fakes_flashmla.py``)
that walks the metadata as the kernel does, so a wrong schedule gives NaN or a wrong row; the
reference is :func:`attnpool.adapters.mla.attention` in float32 over the same bf16 inputs. Real
rows are compared (``n`` of ``bs``, padded rows included in every call); padded rows get no work.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys
import types
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import (
    BufferPool,
    FlashMLAConfig,
    Impl,
    InputError,
    LayoutError,
    PoolConfig,
    SchedLayout,
)
from attnpool.adapters import mla
from attnpool.adapters.merge import Attn
from attnpool.adapters.mla import flashmla as fm
from attnpool.kv import KVCachePool
from attnpool.kv.mla_shape import MLAShape

from tests.helpers.batches import make_batch, tree_mask
from tests.helpers.fakes_flashmla import (
    ArgumentAPI,
    FlashMLASchedMeta,
    SchedMetaAPI,
    SglFlashMLASchedMeta,
    SglSchedMetaAPI,
)

N, BS, C = 4, 6, 64 * 6


def _shape(heads: int) -> MLAShape:
    return MLAShape(num_heads=heads, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    kv_lora_rank=512)


class Case:
    """A pool with FlashMLA metadata, a bf16 latent cache filled everywhere but the pad page,
    and a decode or chain verify step of ``n`` requests padded to ``bs``."""

    def __init__(self, phase: str, heads: int, sms: int, seed: int, *, impl: Impl = Impl.REFERENCE,
                 dev: str = "cpu", **flashmla: Any) -> None:
        self.phase, self.shape, self.dev = phase, _shape(heads), torch.device(dev)
        self.rng = random.Random(seed)
        self.cfg = PoolConfig(max_bs=BS, max_context_len=C, page_size=64, device=dev,
                              num_draft_tokens=N, impl=impl,
                              flashmla=FlashMLAConfig(num_sms=sms, num_heads_q=heads, **flashmla))
        self.pool = BufferPool(self.cfg, poison=True)
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = torch.empty(0)
        self.int32 = impl is Impl.TRITON

    def step(self, n: int, bs: int = BS, tree: bool = False) -> tuple[Any, Tensor, int]:
        """``(view, q [bs * s_q, H, 576] bf16, real rows)``; the cache covers the batch."""
        b = make_batch(self.cfg, n, self.rng, extra=N)
        kw = b.inputs(self.dev, torch.int32 if self.int32 else torch.int64)
        if self.phase == "decode":
            view, s_q = self.pool.decode.update_(bs, **kw), 1
        else:
            mask = tree_mask(n, N, self.rng) if tree else None
            view, s_q = self.pool.verify.update_(bs, **kw, tree_mask=mask), N
        pages = int(b.req_to_token.max()) // 64 + 2
        kvp = KVCachePool(self.shape.latent_config(pages, 64, dtype=torch.bfloat16,
                                                   device=self.dev, max_tokens=8))
        slots = torch.arange(64, pages * 64)  # page 0 is the pad page (zeroed)
        lat = torch.randn(len(slots), 512, generator=self.gen)
        pe = torch.randn(len(slots), 64, generator=self.gen)
        kvp.store_mla_(0, lat.to(self.dev, torch.bfloat16), pe.to(self.dev, torch.bfloat16),
                       slots.to(self.dev), impl=Impl.REFERENCE)
        self.kv = kvp.kv_cache(0)
        q = torch.randn(bs * s_q, self.shape.num_heads, 576, generator=self.gen) / 8
        return view, q.to(self.dev, torch.bfloat16), n * s_q

    def check(self, view: Any, q: Tensor, got: Attn, rows: int) -> None:
        want = mla.attention(view, q.float(), self.kv.float(), self.shape)
        assert got.out.shape == (q.shape[0], self.shape.num_heads, 512)
        assert got.lse.shape == (q.shape[0], self.shape.num_heads)
        torch.testing.assert_close(got.out[:rows].float(), want.out[:rows], atol=2e-2,
                                   rtol=2e-2)
        torch.testing.assert_close(got.lse[:rows].float(), want.lse[:rows], atol=1e-3,
                                   rtol=1e-3)


def _run(c: Case, n: int, bs: int = BS) -> tuple[Any, ArgumentAPI]:
    fake = ArgumentAPI()
    view, q, rows = c.step(n, bs)
    got = fm.attention(view, q, c.kv, c.shape, fn=fake.flash_mla_with_kvcache)
    c.check(view, q, got, rows)
    return view, fake


@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("heads, sms", [(16, 2), (16, 12), (128, 6), (128, 132)])
def test_matches_sdpa(phase: str, heads: int, sms: int) -> None:
    c = Case(phase, heads, sms, seed=heads + sms)
    for n, bs in ((3, BS), (BS, BS), (1, 4)):  # padded rows, none, a smaller captured size
        view, fake = _run(c, n, bs)
        call = fake.calls[0]
        part = view if phase == "decode" else view.prefix
        f = part.flashmla
        # the view's own buffers and the cache itself: what a captured graph bakes
        assert call["tile_scheduler_metadata"] is f.tile_scheduler_metadata
        assert call["num_splits"] is f.num_splits and f.num_splits.shape == (bs + 1,)
        assert call["block_table"] is part.page_table and call["cache_seqlens"] is part.cache_seqlens
        assert call["k_cache"].data_ptr() == c.kv.data_ptr()
        assert call["q"].shape == (bs, f.s_q, heads, 576)
        assert call["softmax_scale"] == c.shape.softmax_scale
        assert call["causal"] is part.causal


def test_schedule_splits_requests() -> None:
    """The cases above cut requests across parts (else the combine would go untested)."""
    c = Case("decode", 16, 12, seed=0)
    view, _ = _run(c, BS)
    assert int(view.flashmla.num_splits[BS]) > BS  # some request has more than one split


@pytest.mark.triton
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_matches_sdpa_fused_update(phase: str) -> None:
    c = Case(phase, 16, 4, seed=9, impl=Impl.TRITON)
    for n in (2, BS):
        _run(c, n)


def test_split_query_form() -> None:
    c = Case("verify", 16, 3, seed=2)
    view, q, rows = c.step(3)
    fake = ArgumentAPI()
    got = fm.attention(view, q[..., :512].contiguous(), c.kv, c.shape,
                       q_pe=q[..., 512:].contiguous(), fn=fake.flash_mla_with_kvcache)
    c.check(view, q, got, rows)


def test_metadata_is_on_the_path() -> None:
    """Corrupting one part of the pool's schedule changes the kernel's result: the fake walks
    the metadata the view hands it."""
    c = Case("decode", 16, 12, seed=0)
    view, q, rows = c.step(BS)
    good = fm.attention(view, q, c.kv, c.shape, fn=ArgumentAPI().flash_mla_with_kvcache)
    md = view.flashmla.tile_scheduler_metadata
    assert md[0, 3] > 0
    md[0, 3] -= 1  # part 0 ends one block early: that block is nobody's
    bad = fm.attention(view, q, c.kv, c.shape, fn=ArgumentAPI().flash_mla_with_kvcache)
    assert not torch.equal(bad.out[:rows].nan_to_num(7.0), good.out[:rows].nan_to_num(7.0))
    md[0, 3] += 1
    again = fm.attention(view, q, c.kv, c.shape, fn=ArgumentAPI().flash_mla_with_kvcache)
    assert torch.equal(again.out[:rows], good.out[:rows])


@pytest.mark.parametrize("vllm_build", [True, False])
def test_idle_parts_are_skipped_by_every_build(vllm_build: bool) -> None:
    """Idle parts begin at ``bs``, which both builds of the argument API skip (vLLM's skips
    ``begin_req < 0 or >= b``, deepseek-ai's ``>= b`` only). A part marked -1 instead, vLLM's
    planner's mark, is run by deepseek-ai's build (the fake stands for its out-of-range read
    with an assertion)."""
    c = Case("decode", 16, 12, seed=1)
    view, q, rows = c.step(2)
    md = view.flashmla.tile_scheduler_metadata
    assert int(md[-1, 0]) == BS
    fn = ArgumentAPI(vllm_build=vllm_build).flash_mla_with_kvcache
    c.check(view, q, fm.attention(view, q, c.kv, c.shape, fn=fn), rows)
    md[-1, 0] = -1
    if vllm_build:
        c.check(view, q, fm.attention(view, q, c.kv, c.shape, fn=fn), rows)
    else:
        with pytest.raises(AssertionError, match="spans requests -1"):
            fm.attention(view, q, c.kv, c.shape, fn=fn)


# ---- refusals, before any call -----------------------------------------------------------------
def test_refusals() -> None:
    fake = ArgumentAPI()
    call = fake.flash_mla_with_kvcache
    c = Case("decode", 16, 4, seed=3)
    view, q, _ = c.step(3, 4)
    s = c.shape

    def refused(err: type[Exception], match: str, v: Any = view, qq: Tensor = q,
                kv: Tensor | None = None, shape: MLAShape = s) -> None:
        with pytest.raises(err, match=match):
            fm.attention(v, qq, c.kv if kv is None else kv, shape, fn=call)

    refused(InputError, r"bs \* s_q = 4 \* 1 = 4 rows .* got 3", qq=q[:3])
    refused(InputError, "bfloat16 or float16 queries, got torch.float32", qq=q.float())
    refused(InputError, r"num_heads_q=16 .*got q with 32 heads", qq=q.repeat(1, 2, 1),
            shape=_shape(32))
    refused(InputError, "queries' dtype torch.bfloat16 .*got torch.float16", kv=c.kv.half())
    refused(InputError, "fp8 cache", kv=c.kv.to(torch.float8_e4m3fn))
    refused(LayoutError, "kv_lora_rank 512 and qk_rope_head_dim 64 only, got 256 and 64",
            qq=q[..., 256:], shape=dataclasses.replace(s, kv_lora_rank=256),
            kv=c.kv[..., 256:].contiguous())
    small = KVCachePool(s.latent_config(8, 16, dtype=torch.bfloat16)).kv_cache(0)
    refused(LayoutError, "64-token pages, got 16", kv=small)
    refused(LayoutError, "page_size=64, got 16", v=dataclasses.replace(view, page_size=16))
    refused(LayoutError, "PoolConfig\\(flashmla=",
            v=dataclasses.replace(view, flashmla=None))
    # tree verify's expand pass and sliding windows: the other MLA adapters
    tree_pool = BufferPool(dataclasses.replace(c.cfg, topk=2), poison=True)
    rng = random.Random(0)
    b = make_batch(tree_pool.cfg, 2, rng, extra=N)
    tv = tree_pool.verify.update_(2, **b.inputs(), tree_mask=tree_mask(2, N, rng))
    refused(LayoutError, "expand pass .*mla.flashinfer", v=tv, qq=torch.zeros(
        2 * N, 16, 576, dtype=torch.bfloat16))
    win = BufferPool(dataclasses.replace(c.cfg, sliding_window=100), poison=True)
    wv = win.decode.update_(4, **make_batch(win.cfg, 3, rng).inputs())
    refused(LayoutError, "no sliding window .*attnpool.adapters.mla ", v=wv.window)
    refused(LayoutError, "PoolConfig\\(flashmla=", v=c.pool.draft_extend.view(4))
    refused(InputError, "decode view or a chain verify view, got str", v="decode")
    fp8 = Case("decode", 16, 4, seed=3, fp8=True)
    fv, fq, _ = fp8.step(2, 4)
    refused(LayoutError, "fp8=True", v=fv, qq=fq)
    assert not fake.calls


def test_fake_checks_what_flashmla_checks() -> None:
    """The fake asserts the C++ entry's checks (a call the adapter would never make)."""
    c = Case("decode", 16, 4, seed=6)
    view, q, _ = c.step(2, 4)
    kw = fm.flashmla_kwargs(view, q, c.kv, c.shape)
    call = ArgumentAPI().flash_mla_with_kvcache
    for key, bad, match in (
            ("block_table", kw["block_table"].long(), "block_table must have dtype"),
            ("num_splits", kw["num_splits"][:-1], None),
            ("tile_scheduler_metadata", kw["tile_scheduler_metadata"][:, :5], None),
            ("head_dim_v", 576, "head_size_v")):
        with pytest.raises(AssertionError, match=match):
            call(**{**kw, key: bad})


# ---- the scheduler-object API (DecodingSchedMeta rows in a FlashMLASchedMeta) ----------------
META, ARGS = SchedLayout.DECODING_SCHED_META, SchedLayout.ARGUMENTS


def _run_meta(c: Case, n: int, bs: int = BS) -> tuple[Any, SchedMetaAPI]:
    fake = SchedMetaAPI(c.cfg.flashmla.num_sms)  # type: ignore[union-attr]
    view, q, rows = c.step(n, bs)
    got = fm.attention(view, q, c.kv, c.shape, fn=fake.flash_mla_with_kvcache,
                       sched_meta_cls=FlashMLASchedMeta)
    c.check(view, q, got, rows)
    return view, fake


@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("heads, sms", [(16, 2), (16, 12), (128, 132)])
def test_sched_meta_matches_sdpa(phase: str, heads: int, sms: int) -> None:
    c = Case(phase, heads, sms, seed=heads * sms, layout=META)
    for n, bs in ((3, BS), (BS, BS), (1, 4)):
        view, fake = _run_meta(c, n, bs)
        meta = fake.calls[0]["sched_meta"]
        f = (view if phase == "decode" else view.prefix).flashmla
        assert meta.have_initialized and not fake.planned  # FlashMLA planned nothing itself
        assert meta.tile_scheduler_metadata is f.tile_scheduler_metadata
        assert meta.num_splits is f.num_splits
        assert meta.config.b == bs and meta.config.s_q == f.s_q


@pytest.mark.triton
def test_sched_meta_fused_update() -> None:
    c = Case("verify", 16, 12, seed=8, layout=META, impl=Impl.TRITON)
    for n in (2, BS):
        _run_meta(c, n)


def test_sched_meta_flags_are_on_the_path() -> None:
    """The struct layout's split flags decide where a part writes: flipping one breaks a row."""
    c = Case("decode", 16, 12, seed=0, layout=META)
    view, q, rows = c.step(BS)
    md = view.flashmla.tile_scheduler_metadata
    call = SchedMetaAPI(12).flash_mla_with_kvcache
    good = fm.attention(view, q, c.kv, c.shape, fn=call, sched_meta_cls=FlashMLASchedMeta)
    p = int(torch.nonzero(md[:, 5] == 1)[0])  # a part whose first request is split
    md[p, 5] = 0
    bad = fm.attention(view, q, c.kv, c.shape, fn=call, sched_meta_cls=FlashMLASchedMeta)
    assert not torch.equal(bad.out[:rows].nan_to_num(7.0), good.out[:rows].nan_to_num(7.0))


def test_layout_and_api_must_match() -> None:
    fake = SchedMetaAPI(4)
    args = Case("decode", 16, 4, seed=1)
    view, q, _ = args.step(2, 4)
    with pytest.raises(LayoutError, match=r"argument layout .*DECODING_SCHED_META"):
        fm.attention(view, q, args.kv, args.shape, fn=fake.flash_mla_with_kvcache,
                     sched_meta_cls=FlashMLASchedMeta)
    meta = Case("decode", 16, 4, seed=1, layout=META)
    view, q, _ = meta.step(2, 4)
    with pytest.raises(LayoutError, match="pass sched_meta_cls"):
        fm.attention(view, q, meta.kv, meta.shape, fn=ArgumentAPI().flash_mla_with_kvcache)
    assert not fake.calls
    # FlashMLA sizes its parts from the device's SMs: a pool sized for others is refused (on a
    # GPU by the adapter, from the device's properties; here by the fake, as FlashMLA's C++)
    with pytest.raises(AssertionError, match=r"shape \(8, 8\)"):
        fm.attention(view, q, meta.kv, meta.shape, fn=SchedMetaAPI(8).flash_mla_with_kvcache,
                     sched_meta_cls=FlashMLASchedMeta)


# ---- the installed package as the default entry point (sgl-flash-mla 1.0.0, and upstream's) --
def _install(monkeypatch: pytest.MonkeyPatch, mod: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", mod)
    monkeypatch.setitem(sys.modules, "flash_mla.flash_mla_interface", mod)


@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("heads, sms", [(16, 2), (16, 12), (128, 132)])
def test_sgl_flash_mla_default_matches_sdpa(monkeypatch: pytest.MonkeyPatch, phase: str,
                                            heads: int, sms: int) -> None:
    """sgl-flash-mla 1.0.0: its Config requires enable_batch_invariant, and its dense path runs
    only with use_legacy=True (the fake asserts both, as the package does)."""
    fake = SglSchedMetaAPI(sms)
    _install(monkeypatch, fake.module())
    c = Case(phase, heads, sms, seed=heads + sms + 1, layout=META)
    for k, (n, bs) in enumerate(((3, BS), (BS, BS), (1, 4))):
        view, q, rows = c.step(n, bs)
        c.check(view, q, fm.attention(view, q, c.kv, c.shape), rows)
        meta = fake.calls[k]["sched_meta"]
        f = (view if phase == "decode" else view.prefix).flashmla
        assert isinstance(meta, SglFlashMLASchedMeta) and meta.have_initialized
        assert meta.config.enable_batch_invariant is False and meta.config.b == bs
        assert meta.tile_scheduler_metadata is f.tile_scheduler_metadata and not fake.planned
    # the fake refuses what the package refuses: the dense path without use_legacy
    view, q, _ = c.step(2)
    with pytest.raises(AssertionError, match="pass use_legacy=True"):
        fm.attention(view, q, c.kv, c.shape, fn=fake.flash_mla_with_kvcache,
                     sched_meta_cls=SglFlashMLASchedMeta)


def test_upstream_default_gets_no_use_legacy(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry point without a use_legacy parameter (upstream's, vLLM's copy) is called
    without it (the fake asserts every extra keyword is None), and its Config without
    enable_batch_invariant."""
    fake = SchedMetaAPI(12)
    mod = types.ModuleType("flash_mla")
    mod.flash_mla_with_kvcache = fake.flash_mla_with_kvcache  # type: ignore[attr-defined]
    mod.FlashMLASchedMeta = FlashMLASchedMeta  # type: ignore[attr-defined]
    mod.flash_mla_interface = mod  # type: ignore[attr-defined]
    _install(monkeypatch, mod)
    c = Case("verify", 16, 12, seed=4, layout=META)
    view, q, rows = c.step(3)
    c.check(view, q, fm.attention(view, q, c.kv, c.shape), rows)
    assert len(fake.calls) == 1


def test_sgl_flash_mla_without_legacy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SglSchedMetaAPI(4, legacy=False)
    _install(monkeypatch, fake.module())
    c = Case("decode", 16, 4, seed=5, layout=META)
    view, q, _ = c.step(2, 4)
    with pytest.raises(LayoutError, match=r"has_legacy\(\) is False.*FLASH_MLA_BUILD_LEGACY=0"):
        fm.attention(view, q, c.kv, c.shape)
    assert not fake.calls


def test_config_fields_unknown_required_is_refused() -> None:
    @dataclasses.dataclass
    class Config:
        b: int
        new_required: int

    with pytest.raises(LayoutError, match="new_required"):
        fm._config_fields(Config)
    keep = fm._config_fields(SglFlashMLASchedMeta.Config)
    assert keep is fm._config_fields(SglFlashMLASchedMeta.Config)  # resolved once per class
    assert keep(b=1, enable_batch_invariant=False) == {"b": 1, "enable_batch_invariant": False}
    assert fm._config_fields(FlashMLASchedMeta.Config)(b=1, enable_batch_invariant=False) == \
        {"b": 1}


# ---- CUDA: FlashMLA itself (SM90, bf16, its current API), when installed -----------------------
@functools.cache
def _flashmla_import_error() -> str | None:
    """Why ``flash_mla`` does not import (the exception's text), or None; printed once, so a GPU
    log (``pytest -s``) shows it, and it is the skip reason (``-rs``)."""
    try:
        import flash_mla
    except Exception as exc:  # ImportError, or its loader's OSError / RuntimeError
        msg = f"flash_mla failed to import: {type(exc).__name__}: {exc}"
        print(msg)
        return msg
    legacy = getattr(flash_mla, "has_legacy", None)
    print(f"flash_mla {getattr(flash_mla, '__version__', '?')} at {flash_mla.__file__}, "
          f"has_legacy={legacy() if legacy is not None else 'n/a'}")
    return None


def _need_flashmla() -> SchedLayout:
    """Skip unless ``flash_mla`` imports and the GPU is SM90; the layout its API reads."""
    err = _flashmla_import_error()
    if err is not None:
        pytest.skip(err)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FlashMLA's dense decode kernel needs an SM90 GPU")
    from flash_mla import flash_mla_interface as api

    return META if hasattr(api, "FlashMLASchedMeta") else ARGS


@pytest.mark.cuda
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_flashmla_cuda(phase: str) -> None:
    layout = _need_flashmla()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for heads in (16, 128):
        c = Case(phase, heads, sms, seed=11 + heads, dev="cuda", layout=layout)
        for n in (3, BS):
            view, q, rows = c.step(n)
            got = fm.attention(view, q, c.kv, c.shape)
            torch.cuda.synchronize()
            c.check(view, q, got, rows)


@pytest.mark.cuda
@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("heads", [16, 128])
def test_flashmla_cuda_graph_replay(phase: str, heads: int) -> None:
    """FlashMLA captured once at ``bs`` on the pool's view; per replay the pool is refilled in
    place (``update_``, ``n <= bs`` real rows), the static query and the static cache too."""
    layout = _need_flashmla()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    c = Case(phase, heads, sms, seed=21 + heads, dev="cuda", layout=layout)
    rng = random.Random(heads)
    view, q0, _ = c.step(BS)
    # make_batch's table: 2 * BS rows of max_pages pages (page 0 unused), + the step's spare
    pages = 2 * BS * c.cfg.max_pages + 2
    cache = torch.zeros(pages, *c.kv.shape[1:], dtype=c.kv.dtype, device=c.dev)
    q = torch.zeros_like(q0)

    def refill(v: Any, q_new: Tensor) -> Any:
        assert c.kv.shape[0] <= pages
        cache[: c.kv.shape[0]].copy_(c.kv)
        c.kv = cache
        q.copy_(q_new)
        return v if phase == "decode" else v.prefix

    part = refill(view, q0)
    bufs = [t.data_ptr() for t in (part.page_table, part.cache_seqlens,
                                   part.flashmla.tile_scheduler_metadata, part.flashmla.num_splits)]
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fm.attention(view, q, cache, c.shape)  # warm-up: never the first call inside a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fm.attention(view, q, cache, c.shape)
    for i in range(20):
        n = rng.randint(1, BS)
        v, q_new, rows = c.step(n)
        part = refill(v, q_new)
        assert [t.data_ptr() for t in (part.page_table, part.cache_seqlens,
                                       part.flashmla.tile_scheduler_metadata,
                                       part.flashmla.num_splits)] == bufs, i
        graph.replay()
        torch.cuda.synchronize()
        c.check(v, q, got, rows)

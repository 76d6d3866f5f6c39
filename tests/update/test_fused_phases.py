"""Every phase's fused update (Impl.TRITON) equals its reference update (Impl.REFERENCE).

Two poisoned pools get the same batch; every paged part of the two views must agree exactly
(``torch.equal``) on its read region, and both must pass the checker. On CPU the kernels run in
the Triton interpreter (tests/conftest.py). Capturable updates (``num_real``, inputs padded to
``bs`` rows) and the incremental decode page table are checked against the same reference.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnpool import BufferPool, Impl, InputError, Layout, PagedView, Phase, PoolConfig
from attnpool.errors import LayoutError

from tests.helpers.batches import Batch, make_batch
from tests.helpers.opcount import count

pytestmark = pytest.mark.triton

C = 256
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LAYOUTS = [Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH]
common = {
    "page": st.sampled_from([1, 16, 64]),
    "layout": st.sampled_from(LAYOUTS),
    "n": st.integers(0, 6),
    "pad": st.integers(0, 3),
    "seed": st.integers(0, 2**16),
    "capturable": st.booleans(),
}


def pools(page: int, layout: Layout, **kw: object) -> tuple[BufferPool, BufferPool]:
    def make(impl: Impl) -> BufferPool:
        cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=page, device="cpu",
                         layout=layout, pad_seq_len=3, pad_page=2, impl=impl,
                         **kw)  # type: ignore[arg-type]
        return BufferPool(cfg, poison=True)

    return make(Impl.REFERENCE), make(Impl.TRITON)


def parts(view: object) -> list[PagedView]:
    """Every paged part of a view, in field order."""
    if isinstance(view, PagedView):
        return [view]
    out: list[PagedView] = []
    for f in dataclasses.fields(view):  # type: ignore[arg-type]
        x = getattr(view, f.name)
        for p in x if isinstance(x, tuple) else (x,):
            if isinstance(p, PagedView) or (dataclasses.is_dataclass(p) and not isinstance(p, type)):
                out += parts(p)
    return out


def read_region(v: PagedView) -> list[Tensor]:
    """The elements a kernel reads (docs/design.md, The contract): lengths, cumsums, each row's
    live page ids."""
    bs, p = v.bs, v.page_size
    lens = v.cache_seqlens[:bs]
    out = [lens, v.cu_seqlens_q[: bs + 1], v.cu_seqlens_k[: bs + 1]]
    if v.page_table is not None:
        out += [v.page_table[i, : -(-int(x) // p)] for i, x in enumerate(lens.tolist())]
    if v.kv_indptr is not None and v.kv_indices is not None and v.kv_last_page_len is not None:
        ip = v.kv_indptr[: bs + 1]
        out += [ip, v.kv_indices[: int(ip[-1])], v.kv_last_page_len[:bs]]
    return out


def assert_same(a: object, b: object, host_ints: bool = True) -> None:
    pa, pb = parts(a), parts(b)
    assert len(pa) == len(pb) and pa
    for x, y in zip(pa, pb, strict=True):
        for s, t in zip(read_region(x), read_region(y), strict=True):
            assert torch.equal(s, t), (s, t)
        if host_ints:
            assert (x.max_seqlen_q, x.max_seqlen_k, x.causal) == (y.max_seqlen_q, y.max_seqlen_k,
                                                                  y.causal)


def sizes(n: int, pad: int) -> tuple[int, int]:
    bs = max(1, min(6, n + pad))
    return min(n, bs), bs


def padded(t: Tensor, bs: int, fill: int) -> Tensor:
    """``t`` with rows appended up to ``bs``; their values must never be read."""
    junk = torch.full((bs - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)
    return torch.cat([t, junk]).contiguous()


def run(ref: BufferPool, tt: BufferPool, phase: str, bs: int, capturable: bool,
        tensors: dict[str, Tensor], **kw: object) -> None:
    """The same update on both pools; every tensor but ``req_to_token`` has a row per request."""
    real = getattr(ref, phase).update_(bs, **tensors, **kw)
    if capturable:
        n = tensors["seq_lens"].shape[0]
        tensors = {k: t if k == "req_to_token" else padded(t, bs, 10**6)
                   for k, t in tensors.items()}
        kw = {k: (padded(v, bs, True) if k == "tree_mask" else padded(v, bs, -5)
                  if isinstance(v, Tensor) else v) for k, v in kw.items() if "cpu" not in k}
        kw["num_real"] = torch.tensor([n], dtype=torch.int32)
    fused = getattr(tt, phase).update_(bs, **tensors, **kw)
    tt.check(fused)
    ref.check(real)
    assert_same(real, fused, host_ints=not capturable)


def host(b: Batch, capturable: bool) -> dict[str, object]:
    return {} if capturable else {"seq_lens_cpu": b.seq_lens}


@SETTINGS
@given(**common)
def test_decode(page: int, layout: Layout, n: int, pad: int, seed: int, capturable: bool) -> None:
    ref, tt = pools(page, layout)
    n, bs = sizes(n, pad)
    b = make_batch(ref.cfg, n, random.Random(seed))
    run(ref, tt, "decode", bs, capturable, b.inputs(), **host(b, capturable))


@SETTINGS
@given(**common, topk=st.sampled_from([1, 3]))
def test_verify(page: int, layout: Layout, n: int, pad: int, seed: int, capturable: bool,
                topk: int) -> None:
    nd = 4
    ref, tt = pools(page, layout, num_draft_tokens=nd, topk=topk)
    n, bs = sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(ref.cfg, n, rng, extra=nd)
    kw = host(b, capturable)
    if topk > 1:
        mask = torch.rand(n, nd, nd, generator=torch.Generator().manual_seed(seed)) < 0.5
        kw["tree_mask"] = mask | torch.eye(nd, dtype=torch.bool)
    run(ref, tt, "verify", bs, capturable, b.inputs(), **kw)


@SETTINGS
@given(**common, topk=st.sampled_from([1, 2]), steps=st.sampled_from([1, 3]))
def test_draft(page: int, layout: Layout, n: int, pad: int, seed: int, capturable: bool,
               topk: int, steps: int) -> None:
    assume(topk > 1 or layout is not Layout.FLASHINFER)  # chain drafts need FLASH_ATTN
    ref, tt = pools(page, layout, spec_steps=steps, topk=topk)
    n, bs = sizes(n, pad)
    b = make_batch(ref.cfg, n, random.Random(seed), extra=steps)
    kw = host(b, capturable)
    if topk > 1:
        gen = torch.Generator().manual_seed(seed)
        kw["out_cache_loc"] = torch.randint(1, 10_000, (n, steps, topk), generator=gen)
    run(ref, tt, "draft", bs, capturable, b.inputs(), **kw)


@SETTINGS
@given(**common)
def test_draft_extend(page: int, layout: Layout, n: int, pad: int, seed: int,
                      capturable: bool) -> None:
    nd = 4
    ref, tt = pools(page, layout, num_draft_tokens=nd)
    n, bs = sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(ref.cfg, n, rng)
    acc = torch.tensor([rng.randint(1, min(nd, s)) for s in b.seq_lens], dtype=torch.int32)
    run(ref, tt, "draft_extend", bs, capturable, {**b.inputs(), "accept_lens": acc},
        **host(b, capturable))


@SETTINGS
@given(**common)
def test_encoder(page: int, layout: Layout, n: int, pad: int, seed: int, capturable: bool
                 ) -> None:
    max_enc = 100
    ref, tt = pools(page, layout, max_encoder_len=max_enc)
    n, bs = sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(ref.cfg, n, rng, extra=max_enc)
    enc = torch.tensor([rng.choice([0, 1, max_enc, rng.randint(1, max_enc)]) for _ in range(n)],
                       dtype=torch.int64)
    run(ref, tt, "encoder", bs, capturable, {**b.inputs(), "encoder_lens": enc},
        **host(b, capturable))


@SETTINGS
@given(**common, verify=st.booleans(), chunk_pages=st.sampled_from([1, 2]))
def test_local(page: int, layout: Layout, n: int, pad: int, seed: int, capturable: bool,
               verify: bool, chunk_pages: int) -> None:
    nd = 5
    chunk = max(4, page) * chunk_pages
    ref, tt = pools(page, layout, num_draft_tokens=nd, attention_chunk_size=chunk - chunk % page)
    n, bs = sizes(n, pad)
    b = make_batch(ref.cfg, n, random.Random(seed), extra=nd)
    run(ref, tt, "local", bs, capturable, b.inputs(),
        for_phase=Phase.VERIFY if verify else Phase.DECODE, **host(b, capturable))


@SETTINGS
@given(**common, host_lens=st.booleans(), slot_len=st.sampled_from([0, 40, 45]))
def test_extend(page: int, layout: Layout, n: int, pad: int, seed: int, capturable: bool,
                host_lens: bool, slot_len: int) -> None:
    """Paged part, packed query offsets, positions and the KV slots written in the same call."""
    total = 40
    ref, tt = pools(page, layout, max_extend_tokens=total)
    n, bs = sizes(n, pad)
    rng = random.Random(seed)
    b = make_batch(ref.cfg, n, rng)
    ext = [rng.randint(1, max(1, min(s, total // 6))) for s in b.seq_lens]
    seq, rpi, table = b.tensors()
    kw: dict[str, object] = {"seq_lens": seq, "extend_lens": torch.tensor(ext, dtype=torch.int64),
                             "req_pool_indices": rpi, "req_to_token": table}
    if host_lens and not capturable:
        kw.update(seq_lens_cpu=b.seq_lens, extend_lens_cpu=ext)
    slots = [torch.full((slot_len,), 5, dtype=torch.int64) if slot_len else None
             for _ in range(2)]
    real = ref.extend.update_(bs, **kw, out_slots=slots[0])  # type: ignore[arg-type]
    if capturable:
        kw = {k: padded(v, bs, 10**6) if isinstance(v, Tensor) and v.dim() == 1 else v
              for k, v in kw.items()}
        kw["num_real"] = torch.tensor([n], dtype=torch.int32)
    fused = tt.extend.update_(bs, **kw, out_slots=slots[1])  # type: ignore[arg-type]
    ref.check(real)
    tt.check(fused)
    assert_same(real, fused, host_ints=not capturable)
    assert torch.equal(real.positions, fused.positions)  # the whole [T]: every entry is read
    if slot_len:
        assert torch.equal(slots[0], slots[1])


# ---- one launch per part, no aten op that launches a kernel ---------------------------------
LAUNCHES = {"decode": 1, "verify": 2, "draft": 1, "draft_extend": 1, "encoder": 2, "local": 1,
            "extend": 1}


@pytest.mark.parametrize("phase", list(LAUNCHES))
def test_launches_per_phase(phase: str) -> None:
    """Decode, chain draft (all steps), draft extend (with its query part), extend (with its
    query offsets, positions and KV slots) and local are one launch; tree verify and encoder are
    two parts, two launches. No aten op that computes."""
    kw: dict[str, object] = {"num_draft_tokens": 4, "spec_steps": 3, "max_encoder_len": 64,
                             "attention_chunk_size": 64, "max_extend_tokens": 32}
    if phase == "verify":
        kw["topk"] = 2  # the tree: prefix + expand
    _, tt = pools(16, Layout.FLASH_ATTN, **kw)
    b = make_batch(tt.cfg, 3, random.Random(0), extra=68)
    three = torch.ones(3, dtype=torch.int64)
    extra: dict[str, dict[str, object]] = {
        "verify": {"tree_mask": torch.ones(3, 4, 4, dtype=torch.bool)},
        "draft_extend": {"accept_lens": three}, "encoder": {"encoder_lens": three},
        # KV slots written by the same launch
        "extend": {"extend_lens": three, "out_slots": torch.empty(32, dtype=torch.int64)},
    }
    kwargs = {**b.inputs(), **extra.get(phase, {})}
    fn = getattr(tt, phase).update_
    fn(4, **kwargs)  # compile first, as an engine does before capture
    c = count(lambda: fn(4, **kwargs))
    assert c.launches == LAUNCHES[phase], c.kernels
    computing = {k: v for k, v in c.ops.items() if not k.startswith(VIEW_OPS)}
    assert computing == {}, computing


VIEW_OPS = ("aten.slice.", "aten.select.", "aten.view.", "aten.alias.", "aten.as_strided.")


# ---- incremental decode page table ----------------------------------------------------------
def test_incremental_decode_writes_only_new_pages_and_equals_reference() -> None:
    ref, tt = pools(16, Layout.BOTH)
    rng = random.Random(3)
    b = make_batch(ref.cfg, 4, rng, extra=40)
    seq, rpi, table = b.tensors()
    ids = ["a", "b", "c", "d"]
    for p in (ref, tt):
        p.decode.update_(5, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, request_ids=ids)
    pt = tt.arena.buffer(Phase.DECODE, "page_table")
    pt[0, 0] = 999_999  # an old page of request "a": the next update must not rewrite it
    seq2 = seq + torch.tensor([1, 17, 0, 33])
    ids2 = ["a", "b", "x", "d"]  # row 2 is a new request
    rpi2 = rpi.clone()
    rpi2[2] = (int(rpi[2]) + 1) % table.shape[0]
    real = ref.decode.update_(5, seq_lens=seq2, req_pool_indices=rpi2, req_to_token=table,
                              request_ids=ids2)
    inc = tt.decode.update_(5, seq_lens=seq2, req_pool_indices=rpi2, req_to_token=table,
                            request_ids=ids2)
    assert int(pt[0, 0]) == 999_999  # kept row: old page untouched
    pt[0, 0] = real.page_table[0, 0]
    assert_same(real, inc)
    # another overlaid phase wrote the bytes in between: the next update is a full one
    tt.decode.update_(5, seq_lens=seq2, req_pool_indices=rpi2, req_to_token=table, request_ids=ids2)
    pt[0, 0] = 999_999
    tt.arena.mark_written(Phase.VERIFY, 1)
    tt.decode.update_(5, seq_lens=seq2, req_pool_indices=rpi2, req_to_token=table, request_ids=ids2)
    assert torch.equal(pt[0, :1], real.page_table[0, :1])


def test_incremental_launch_and_copy_counts() -> None:
    """Incremental: one host-to-device copy of the flags plus the launch, nothing else."""
    _, tt = pools(16, Layout.FLASH_ATTN)
    b = make_batch(tt.cfg, 3, random.Random(1), extra=8)
    seq, rpi, table = b.tensors()
    tt.decode.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, request_ids=[1, 2, 3])
    c = count(lambda: tt.decode.update_(4, seq_lens=seq + 1, req_pool_indices=rpi, req_to_token=table,
                                        request_ids=[1, 2, 3]))
    assert c.launches == 1
    assert c.ops.get("aten.copy_.default") == 1


# ---- impl selection and refusals ------------------------------------------------------------
def test_impl_resolution_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    ref, tt = pools(16, Layout.FLASH_ATTN)
    auto = BufferPool(PoolConfig(max_bs=2, max_context_len=64, device="cpu"))
    assert (ref.decode.impl, tt.decode.impl, auto.decode.impl) == (
        Impl.REFERENCE, Impl.TRITON, Impl.REFERENCE)  # AUTO never picks the interpreter
    b = make_batch(ref.cfg, 2, random.Random(0))
    seq, rpi, table = b.tensors()
    with pytest.raises(InputError, match="fused path"):
        ref.decode.update_(2, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                           num_real=torch.tensor([2]))
    with pytest.raises(InputError, match="padded to bs=3"):
        tt.decode.update_(3, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                          num_real=torch.tensor([2]))
    with pytest.raises(InputError, match="host copy"):
        tt.decode.update_(2, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                          seq_lens_cpu=b.seq_lens, num_real=torch.tensor([2]))
    with pytest.raises(InputError, match="contiguous"):
        tt.decode.update_(2, seq_lens=torch.stack([seq, seq], 1)[:, 0], req_pool_indices=rpi,
                          req_to_token=table)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(LayoutError, match="TRITON_INTERPRET"):
        BufferPool(PoolConfig(max_bs=2, max_context_len=64, device="cpu", impl=Impl.TRITON))


def test_incremental_off_after_a_capturable_update() -> None:
    """A ``num_real`` update may be replayed from the engine's graph behind the arena's back:
    from then on ``request_ids`` updates write every page."""
    _, tt = pools(16, Layout.FLASH_ATTN)
    b = make_batch(tt.cfg, 3, random.Random(2), extra=40)
    seq, rpi, table = b.tensors()
    ids = [7, 8, 9]
    tt.decode.update_(3, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, request_ids=ids)
    tt.decode.update_(3, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                      num_real=torch.tensor([3]))
    tt.decode.update_(3, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, request_ids=ids)
    pt = tt.arena.buffer(Phase.DECODE, "page_table")
    good = int(pt[0, 0])
    pt[0, 0] = 999_999
    tt.decode.update_(3, seq_lens=seq + 1, req_pool_indices=rpi, req_to_token=table, request_ids=ids)
    assert int(pt[0, 0]) == good  # rewritten: no row was trusted to keep its pages
    with pytest.raises(InputError, match="host values"):
        tt.decode.update_(3, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                          request_ids=torch.tensor(ids))

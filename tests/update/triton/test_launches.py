"""Fused Triton updates equal the reference path exactly (``torch.equal``) in every read region.

On a CPU-only machine the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
conftest.py); on a GPU machine they run on the GPU (``devices.on_device`` moves each call's
tensors there and back, so cases are built and compared on the host either way). Both paths
write into separate buffers filled with *different* poison values first, so equal read regions
also prove that each path wrote all of its read region. Outside the read region (columns past a
row's live pages, the CSR scratch slot) the paths may differ by design.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnpool.errors import CapacityError, InputError, LayoutError, PoolError
from attnpool.update import reference as ref
from attnpool.update import triton as triton_update
from attnpool.update.reference import PagedBuffers

from tests.helpers.devices import on_device

pytestmark = pytest.mark.triton
tt = on_device(triton_update)  # the kernels, on the device that can run them

POISON_REF, POISON_TT = -1_000_001, -2_000_002
SETTINGS = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
I32, I64 = torch.int32, torch.int64


def bufs(rows: int, width: int, pt: bool, fi: bool, fill: int) -> PagedBuffers:
    def t(*shape: int) -> Tensor:
        return torch.full(shape, fill, dtype=I32)

    return PagedBuffers(t(rows), t(rows + 1), t(rows, width) if pt else None,
                        t(rows + 1) if fi else None, t(rows * width + 1) if fi else None,
                        t(rows) if fi else None)


def snapshot(b: PagedBuffers) -> list[Tensor | None]:
    return [None if (x := getattr(b, f.name)) is None else x.clone() for f in fields(b)]


def assert_read_region_equal(a: PagedBuffers, b: PagedBuffers, bs: int, page: int) -> None:
    """Every element a kernel may read for ``bs`` rows, compared exactly."""
    assert torch.equal(a.cache_seqlens[:bs], b.cache_seqlens[:bs])
    assert torch.equal(a.cu_seqlens_k[: bs + 1], b.cu_seqlens_k[: bs + 1])
    lens = a.cache_seqlens[:bs].to(I64)
    npages = torch.div(lens + page - 1, page, rounding_mode="floor")
    if a.page_table is not None and b.page_table is not None:
        cols = torch.arange(a.page_table.shape[1])
        read = cols[None, :] < npages[:, None]
        assert torch.equal(a.page_table[:bs][read], b.page_table[:bs][read])
    if a.kv_indptr is not None and b.kv_indptr is not None:
        assert b.kv_indices is not None and a.kv_indices is not None
        assert b.kv_last_page_len is not None and a.kv_last_page_len is not None
        assert torch.equal(a.kv_indptr[: bs + 1], b.kv_indptr[: bs + 1])
        end = int(a.kv_indptr[bs])
        assert torch.equal(a.kv_indices[:end], b.kv_indices[:end])
        assert torch.equal(a.kv_last_page_len[:bs], b.kv_last_page_len[:bs])


@dataclass
class Case:
    page: int
    bs: int
    seq: Tensor  # [n]
    rpi: Tensor  # [n]
    table: Tensor  # [R, cols]
    extra: int
    pad_seq_len: int
    pad_page: int
    pt: bool
    fi: bool
    off: Tensor | None
    width: int  # page-table width (max pages)

    @property
    def n(self) -> int:
        return self.seq.shape[0]


@st.composite
def cases(draw: st.DrawFn, max_bs: int = 12) -> Case:
    page = draw(st.sampled_from([1, 16, 64]))
    max_pages = draw(st.integers(1, 6 if page > 1 else 40))
    ctx = page * max_pages
    bs = draw(st.integers(1, max_bs))
    n = draw(st.integers(0, bs))
    extra = draw(st.sampled_from([0, 0, 1, 3]))
    extra = min(extra, ctx)
    use_off = draw(st.booleans())
    num_req = draw(st.integers(1, 5))
    cols = ctx + draw(st.sampled_from([0, 0, 7]))
    seq_l: list[int] = []
    off_l: list[int] = []
    for _ in range(n):
        o = draw(st.integers(0, ctx - extra)) if use_off else 0
        seq_l.append(draw(st.integers(0, ctx - extra - o)))
        off_l.append(o)
    wide = draw(st.booleans())
    tdt = draw(st.sampled_from([I32, I64]))
    lo, hi = (-(2**33), 2**33) if wide and tdt == I64 else (-5, 2**20)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    table = torch.randint(lo, hi, (num_req, cols), generator=gen, dtype=I64).to(tdt)
    rpi = torch.tensor([draw(st.integers(0, num_req - 1)) for _ in range(n)],
                       dtype=draw(st.sampled_from([I32, I64])))
    seq = torch.tensor(seq_l, dtype=draw(st.sampled_from([I32, I64])))
    off = torch.tensor(off_l, dtype=draw(st.sampled_from([I32, I64]))) if use_off else None
    pad_seq_len = draw(st.sampled_from([1, 1, 0, page + 3]))
    if -(-pad_seq_len // page) > max_pages:
        pad_seq_len = 1
    layout = draw(st.sampled_from([(True, True), (True, False), (False, True), (False, False)]))
    return Case(page, bs, seq, rpi, table, extra, pad_seq_len, draw(st.integers(0, 5)),
                *layout, off, max_pages)


def run_reference(c: Case, b: PagedBuffers) -> None:
    pages = ref.gather_pages(c.table, c.rpi, c.page, c.width, c.off)
    ref.lengths_(b.cache_seqlens, c.seq, c.extra, c.bs, c.pad_seq_len)
    arange = torch.arange(max(c.width, c.bs) + 1, dtype=I32)
    ref.paged_(b, bs=c.bs, pages=pages, page_size=c.page, pad_page=c.pad_page,
               pad_pages=-(-c.pad_seq_len // c.page), arange=arange)


def run_triton(c: Case, b: PagedBuffers, **kw: object) -> None:
    tt.paged_update_(b, bs=c.bs, seq_lens=c.seq, req_pool_indices=c.rpi, req_to_token=c.table,
                     extra=c.extra, page_size=c.page, pad_seq_len=c.pad_seq_len,
                     pad_page=c.pad_page, token_offset=c.off, **kw)  # type: ignore[arg-type]


def pair(c: Case, rows: int | None = None) -> tuple[PagedBuffers, PagedBuffers]:
    r = rows if rows is not None else c.bs + 2  # spare rows: nothing past bs may matter
    return (bufs(r, c.width, c.pt, c.fi, POISON_REF), bufs(r, c.width, c.pt, c.fi, POISON_TT))


@SETTINGS
@given(cases())
def test_paged_equals_reference(c: Case) -> None:
    a, b = pair(c)
    run_reference(c, a)
    run_triton(c, b)
    assert_read_region_equal(a, b, c.bs, c.page)


def padded_inputs(c: Case, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor | None]:
    """The case's inputs padded to ``bs`` rows with garbage the kernel must never read."""
    k = c.bs - c.n

    def pad(t: Tensor, lo: int, hi: int) -> Tensor:
        junk = torch.randint(lo, hi, (k,), generator=gen, dtype=I64).to(t.dtype)
        return torch.cat([t, junk])

    off = None if c.off is None else pad(c.off, -(10**6), 10**6)
    return pad(c.seq, -(10**6), 10**6), pad(c.rpi, -(10**6), 10**6), off


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**31))
def test_paged_device_count_equals_reference(c: Case, seed: int) -> None:
    """Capturable mode: inputs padded to bs, the real count in a device scalar."""
    a, b = pair(c)
    run_reference(c, a)
    seq, rpi, off = padded_inputs(c, torch.Generator().manual_seed(seed))
    num_real = torch.tensor([c.n], dtype=I32)
    tt.paged_update_(b, bs=c.bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=c.table,
                     extra=c.extra, page_size=c.page, pad_seq_len=c.pad_seq_len,
                     pad_page=c.pad_page, token_offset=off, num_real=num_real)
    assert_read_region_equal(a, b, c.bs, c.page)


def test_device_count_varies_per_replay_without_new_arguments() -> None:
    """One set of argument tensors (as a graph would bake them); only their contents change."""
    bs, page, ctx = 6, 16, 128
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(0, 5000, (8, ctx), generator=gen, dtype=I32)
    seq = torch.zeros(bs, dtype=I64)
    rpi = torch.zeros(bs, dtype=I64)
    num_real = torch.zeros(1, dtype=I32)
    b = bufs(bs, ctx // page, True, True, POISON_TT)
    for n in (6, 2, 0, 5, 1):
        real_seq = torch.randint(1, ctx, (n,), generator=gen)
        real_rpi = torch.randint(0, 8, (n,), generator=gen)
        seq[:n], rpi[:n] = real_seq, real_rpi
        seq[n:] = 10**6  # stale rows of an earlier replay: never read
        num_real.fill_(n)
        tt.paged_update_(b, bs=bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table,
                         extra=0, page_size=page, pad_seq_len=1, pad_page=0, num_real=num_real)
        c = Case(page, bs, real_seq, real_rpi, table, 0, 1, 0, True, True, None, ctx // page)
        a = bufs(bs, ctx // page, True, True, POISON_REF)
        run_reference(c, a)
        assert_read_region_equal(a, b, bs, page)


def test_large_batch_single_launch() -> None:
    """bs = 160 * 8 rows (a tree expand's worth): the in-register scan covers 2048 lanes."""
    bs, n, page, ctx = 1280, 1001, 16, 64
    gen = torch.Generator().manual_seed(2)
    table = torch.randint(0, 10**6, (64, ctx), generator=gen, dtype=I64)
    c = Case(page, bs, torch.randint(0, ctx + 1, (n,), generator=gen),
             torch.randint(0, 64, (n,), generator=gen), table, 0, 1, 3, True, True, None,
             ctx // page)
    a, b = pair(c)
    run_reference(c, a)
    run_triton(c, b)
    assert_read_region_equal(a, b, bs, page)


def test_writes_only_live_pages() -> None:
    """Columns past a real row's live pages (and past a padded row's pad pages) stay untouched."""
    c = Case(16, 4, torch.tensor([1, 40]), torch.tensor([0, 1]),
             torch.randint(0, 999, (2, 128), dtype=I32), 0, 1, 0, True, True, None, 8)
    _, b = pair(c)
    run_triton(c, b)
    assert b.page_table is not None and b.kv_indices is not None
    assert (b.page_table[0, 1:] == POISON_TT).all() and (b.page_table[1, 3:] == POISON_TT).all()
    assert (b.page_table[2:4, 1:] == POISON_TT).all()
    assert (b.kv_indices[4:] == POISON_TT).all()  # 1 + 3 live pages
    assert (b.cache_seqlens[4:] == POISON_TT).all()  # rows past bs


# ---- incremental page table ---------------------------------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([1, 16, 64]), st.integers(1, 8), st.booleans(), st.data())
def test_incremental_equals_full_and_skips_old_pages(page: int, bs: int, fi: bool,
                                                     data: st.DataObject) -> None:
    max_pages = 5 if page > 1 else 24
    ctx = page * max_pages
    num_req = 6
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    table = torch.randint(0, 10**5, (num_req, ctx), generator=gen, dtype=I32)
    n1 = data.draw(st.integers(0, bs))
    ids1 = data.draw(st.lists(st.integers(0, num_req - 1), min_size=n1, max_size=n1))
    len1 = data.draw(st.lists(st.integers(1, ctx - 4), min_size=n1, max_size=n1))
    n2 = data.draw(st.integers(0, bs))
    ids2 = [ids1[i] if i < n1 and data.draw(st.booleans()) else data.draw(
        st.integers(0, num_req - 1)) for i in range(n2)]
    len2 = [min(ctx, len1[i] + data.draw(st.integers(0, 2 * page))) if i < n1 and ids2[i] == ids1[i]
            else data.draw(st.integers(1, ctx)) for i in range(n2)]

    def mk(ids: list[int], lens: list[int]) -> Case:
        return Case(page, bs, torch.tensor(lens, dtype=I64), torch.tensor(ids, dtype=I64), table,
                    0, 1, 0, True, fi, None, max_pages)

    c1, c2 = mk(ids1, len1), mk(ids2, len2)
    a, b = pair(c2)
    run_triton(c1, b)
    keep = torch.tensor(tt.keep_flags(ids1, ids2, bs), dtype=torch.int8)
    # mark the pages a kept row already holds: an incremental update must not rewrite them
    assert b.page_table is not None
    old_np = [-(-len1[i] // page) for i in range(n1)]
    for i in range(n2):
        if keep[i]:
            b.page_table[i, : old_np[i]] = -7 - i
    marked = b.page_table.clone()
    run_triton(c2, b, keep=keep)
    for i in range(n2):
        if keep[i]:
            assert torch.equal(b.page_table[i, : old_np[i]], marked[i, : old_np[i]])
            b.page_table[i, : old_np[i]] = ref.gather_pages(table, c2.rpi[i : i + 1], page,
                                                            old_np[i])[0]
    run_reference(c2, a)
    assert_read_region_equal(a, b, bs, page)


@pytest.mark.parametrize(("page", "len1", "len2"), [(1, 5, 8), (16, 16, 17), (16, 20, 40),
                                                    (64, 1, 130), (16, 40, 20)])
def test_incremental_writes_exactly_the_new_pages(page: int, len1: int, len2: int) -> None:
    """A kept row writes page-table columns ceil(len1/P) .. ceil(len2/P)-1 and nothing else."""
    table = torch.randint(0, 10**5, (3, 256), dtype=I32)

    def mk(n: int) -> Case:
        return Case(page, 2, torch.tensor([n, 3]), torch.tensor([2, 0]), table, 0, 1, 0, True,
                    False, None, 256 // page)

    _, b = pair(mk(len1))
    run_triton(mk(len1), b)
    assert b.page_table is not None
    b.page_table.fill_(-5)
    run_triton(mk(len2), b, keep=torch.tensor([1, 0], dtype=torch.bool))
    old, new = -(-len1 // page), -(-len2 // page)
    want = ref.gather_pages(table, torch.tensor([2]), page, 256 // page)[0]
    row = b.page_table[0]
    assert (row[:old] == -5).all() and (row[max(old, new):] == -5).all()
    assert torch.equal(row[old:new], want[old:new])
    assert int(b.page_table[1, 0]) == int(table[0, 0]) // page


def test_keep_flags() -> None:
    assert tt.keep_flags(None, [3, 4], 3) == [0, 0, 0]
    assert tt.keep_flags([3, 5, 7], [3, 4, 7], 4) == [1, 0, 1, 0]
    assert tt.keep_flags([3], [3, 3], 2) == [1, 0]
    with pytest.raises(CapacityError):
        tt.keep_flags([], [1, 2], 1)


# ---- query part (draft extend) ------------------------------------------------------------------
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 8), st.integers(0, 2**31), st.booleans(), st.sampled_from([1, 2]))
def test_query_part_equals_reference(c: Case, nd: int, seed: int, device_n: bool,
                                     pad_q: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    acc = torch.randint(1, nd + 1, (c.n,), generator=gen, dtype=c.seq.dtype)
    a, b = pair(c)
    cu_a = torch.full((c.bs + 3,), POISON_REF, dtype=I32)
    cu_b = torch.full((c.bs + 3,), POISON_TT, dtype=I32)
    run_reference(c, a)
    ref.cumsum_(cu_a, acc)
    pad = torch.arange(1, c.bs - c.n + 1, dtype=I32) * pad_q
    torch.add(pad, cu_a[c.n : c.n + 1], out=cu_a[c.n + 1 : c.bs + 1])
    if device_n:
        seq, rpi, off = padded_inputs(c, gen)
        q = torch.cat([acc, torch.full((c.bs - c.n,), 10**6, dtype=acc.dtype)])
        tt.paged_update_(b, bs=c.bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=c.table,
                         extra=c.extra, page_size=c.page, pad_seq_len=c.pad_seq_len,
                         pad_page=c.pad_page, token_offset=off, q_lens=q, cu_seqlens_q=cu_b,
                         pad_q=pad_q, num_real=torch.tensor([c.n]))
    else:
        run_triton(c, b, q_lens=acc, cu_seqlens_q=cu_b, pad_q=pad_q)
    assert torch.equal(cu_a[: c.bs + 1], cu_b[: c.bs + 1])
    assert_read_region_equal(a, b, c.bs, c.page)


# ---- verify tree expand -------------------------------------------------------------------------
@st.composite
def tree_cases(draw: st.DrawFn) -> tuple[Case, Tensor, int, int]:
    nd = draw(st.integers(1, 6))
    bs = draw(st.integers(1, 6))
    n = draw(st.integers(0, bs))
    page = draw(st.sampled_from([1, 16, 64]))
    ctx = page * draw(st.integers(1, 3)) + nd
    num_req = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    table = torch.randint(0, 10**6, (num_req, ctx), generator=gen,
                          dtype=I64).to(draw(st.sampled_from([I32, I64])))
    seq = torch.randint(1, ctx - nd + 1, (n,), generator=gen).to(draw(st.sampled_from([I32, I64])))
    rpi = torch.randint(0, num_req, (n,), generator=gen).to(draw(st.sampled_from([I32, I64])))
    mask = torch.rand((n, nd, nd), generator=gen) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    if draw(st.booleans()):
        mask |= torch.eye(nd, dtype=torch.bool)  # the contract: a draft attends to itself
    if draw(st.booleans()):
        mask = mask.transpose(1, 2).contiguous().transpose(1, 2)  # strided, same values
    layout = draw(st.sampled_from([(True, True), (True, False), (False, True), (False, False)]))
    pad_seq_len = draw(st.sampled_from([1, 0, 5]))
    c = Case(1, bs * nd, seq, rpi, table, 0, min(pad_seq_len, nd), 0, *layout, None, nd)
    return c, mask, nd, draw(st.integers(0, 3)) * page


def tree_reference(c: Case, mask: Tensor, pad_id: int, e: PagedBuffers) -> None:
    lens, slots = ref.tree_expand(mask, c.seq, c.rpi, c.table)
    ref.lengths_(e.cache_seqlens, lens, 0, c.bs, c.pad_seq_len)
    ref.paged_(e, bs=c.bs, pages=slots, page_size=1, pad_page=pad_id, pad_pages=c.pad_seq_len,
               arange=torch.arange(c.bs + c.width + 1, dtype=I32))


@SETTINGS
@given(tree_cases(), st.booleans(), st.integers(0, 2**31))
def test_tree_expand_equals_reference(tc: tuple[Case, Tensor, int, int], device_n: bool,
                                      seed: int) -> None:
    c, mask, nd, pad_id = tc
    bs = c.bs // nd
    a, b = pair(c)
    tree_reference(c, mask, pad_id, a)
    if device_n:
        n = mask.shape[0]
        gen = torch.Generator().manual_seed(seed)
        junk = torch.rand((bs - n, nd, nd), generator=gen) < 0.5
        seq = torch.cat([c.seq, torch.full((bs - n,), 10**6, dtype=c.seq.dtype)])
        rpi = torch.cat([c.rpi, torch.full((bs - n,), -(10**6), dtype=c.rpi.dtype)])
        tt.tree_expand_update_(b, bs=bs, tree_mask=torch.cat([mask, junk]), seq_lens=seq,
                               req_pool_indices=rpi, req_to_token=c.table, pad_len=c.pad_seq_len,
                               pad_id=pad_id, num_real=torch.tensor([n], dtype=I64))
    else:
        tt.tree_expand_update_(b, bs=bs, tree_mask=mask, seq_lens=c.seq, req_pool_indices=c.rpi,
                               req_to_token=c.table, pad_len=c.pad_seq_len, pad_id=pad_id)
    assert_read_region_equal(a, b, c.bs, 1)


def test_tree_expand_large_batch() -> None:
    """bs = 160 requests, N = 8: every program sums its predecessors' mask rows in tiles."""
    bs, n, nd, ctx = 160, 150, 8, 64
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 10**6, (200, ctx), generator=gen, dtype=I32)
    seq = torch.randint(1, ctx - nd + 1, (n,), generator=gen)
    rpi = torch.randint(0, 200, (n,), generator=gen)
    mask = (torch.rand((n, nd, nd), generator=gen) < 0.4) | torch.eye(nd, dtype=torch.bool)
    c = Case(1, bs * nd, seq, rpi, table, 0, 1, 0, True, True, None, nd)
    a, b = pair(c)
    tree_reference(c, mask, 0, a)
    tt.tree_expand_update_(b, bs=bs, tree_mask=mask, seq_lens=seq, req_pool_indices=rpi,
                           req_to_token=table, pad_len=1, pad_id=0)
    assert_read_region_equal(a, b, c.bs, 1)


@pytest.mark.parametrize("nd,rows", [(40, None), (7, 2), (6, 1)])
@pytest.mark.parametrize("device_n", [False, True])
def test_tree_expand_in_row_tiles(nd: int, rows: int | None, device_n: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A large tree's mask is read ``tile_rows`` rows at a time (N = 40: two tiles of 32 rows
    of 64 columns), the CSR offset carried from tile to tile; smaller tiles are forced for
    small trees (``rows``) so that every path loops. Padded requests too."""
    from attnpool.update.triton import tuning as ck

    if rows is not None:
        monkeypatch.setattr(ck, "tile_rows", lambda bn: rows)
        monkeypatch.setattr(ck, "tree_tile", ck.tree_tile.__wrapped__)  # (cached per size)
    bs, n, ctx = 5, 3, 64 + nd
    gen = torch.Generator().manual_seed(nd)
    table = torch.randint(0, 10**6, (8, ctx), generator=gen, dtype=I32)
    seq = torch.randint(1, ctx - nd + 1, (n,), generator=gen)
    rpi = torch.randint(0, 8, (n,), generator=gen)
    mask = (torch.rand((n, nd, nd), generator=gen) < 0.4) | torch.eye(nd, dtype=torch.bool)
    c = Case(1, bs * nd, seq, rpi, table, 0, min(3, nd), 0, True, True, None, nd)
    a, b = pair(c)
    tree_reference(c, mask, 7, a)
    if device_n:
        junk = torch.rand((bs - n, nd, nd), generator=gen) < 0.5
        tt.tree_expand_update_(b, bs=bs, tree_mask=torch.cat([mask, junk]),
                               seq_lens=torch.cat([seq, torch.full((bs - n,), 10**6)]),
                               req_pool_indices=torch.cat([rpi, torch.full((bs - n,), -5)]),
                               req_to_token=table, pad_len=c.pad_seq_len, pad_id=7,
                               num_real=torch.tensor([n], dtype=I64))
    else:
        tt.tree_expand_update_(b, bs=bs, tree_mask=mask, seq_lens=seq, req_pool_indices=rpi,
                               req_to_token=table, pad_len=c.pad_seq_len, pad_id=7)
    assert_read_region_equal(a, b, c.bs, 1)


# ---- bad input: an attnpool error before any write ----------------------------------------------
def _base() -> dict[str, object]:
    return dict(bs=4, seq_lens=torch.tensor([3, 5]), req_pool_indices=torch.tensor([0, 1]),
                req_to_token=torch.zeros((2, 64), dtype=I32), extra=0, page_size=16,
                pad_seq_len=1, pad_page=0)


@pytest.mark.parametrize(("change", "err"), [
    (dict(bs=1), CapacityError),
    (dict(seq_lens=torch.tensor([3.0, 5.0])), InputError),
    (dict(seq_lens=[3, 5]), InputError),
    (dict(req_pool_indices=torch.tensor([0, 1, 2])), InputError),
    (dict(req_to_token=torch.zeros((2, 64), dtype=I32).t()), InputError),
    (dict(req_to_token=torch.zeros((64,), dtype=I32)), InputError),
    (dict(token_offset=torch.tensor([0])), InputError),
    (dict(pad_seq_len=16 * 4 + 1), CapacityError),
    (dict(bs=9), CapacityError),
    (dict(num_real=torch.tensor([2])), InputError),  # inputs must then have bs rows
    (dict(keep=torch.ones(3, dtype=torch.int8)), InputError),
    (dict(q_lens=torch.tensor([1, 1])), InputError),
    (dict(page_size=0), InputError),
])
def test_bad_input_raises_before_any_write(change: dict[str, object], err: type[PoolError]
                                           ) -> None:
    b = bufs(8, 4, True, True, POISON_TT)
    before = snapshot(b)
    with pytest.raises(err):
        tt.paged_update_(b, **{**_base(), **change})  # type: ignore[arg-type]
    assert all((x is None and y is None) or torch.equal(x, y)  # type: ignore[arg-type]
               for x, y in zip(before, snapshot(b), strict=True))


def test_half_a_csr_layout_is_a_layout_error() -> None:
    b = bufs(8, 4, True, True, POISON_TT)
    half = PagedBuffers(b.cache_seqlens, b.cu_seqlens_k, b.page_table, b.kv_indptr, None, None)
    with pytest.raises(LayoutError):
        tt.paged_update_(half, **_base())  # type: ignore[arg-type]


def test_tree_bad_input() -> None:
    e = bufs(16, 4, True, True, POISON_TT)
    good: dict[str, object] = dict(bs=4, tree_mask=torch.ones((2, 4, 4), dtype=torch.bool),
                                   seq_lens=torch.tensor([3, 5]),
                                   req_pool_indices=torch.tensor([0, 1]),
                                   req_to_token=torch.zeros((2, 64), dtype=I32), pad_len=1,
                                   pad_id=0)
    for change, err in [
        (dict(tree_mask=torch.ones((2, 4, 4), dtype=I32)), InputError),
        (dict(tree_mask=torch.ones((2, 4, 3), dtype=torch.bool)), InputError),
        (dict(bs=5), CapacityError),  # 5 * 4 rows > 16
        (dict(pad_len=5), InputError),
        (dict(num_real=torch.tensor([2])), InputError),  # the mask must then have bs rows
    ]:
        before = snapshot(e)
        with pytest.raises(err):
            tt.tree_expand_update_(e, **{**good, **change})  # type: ignore[arg-type, dict-item]
        assert all((x is None and y is None) or torch.equal(x, y)  # type: ignore[arg-type]
                   for x, y in zip(before, snapshot(e), strict=True))


# ---- chunked local attention --------------------------------------------------------------------
@dataclass
class LocalCase:
    c: Case  # page, bs (requests), seq, rpi, table, extra, pad_seq_len (= pad_len), layouts, width
    q: int
    per: int
    chunk: int

    @property
    def rows(self) -> int:
        return self.c.bs * self.per


@st.composite
def local_cases(draw: st.DrawFn) -> LocalCase:
    page = draw(st.sampled_from([1, 16, 64]))
    chunk = page * draw(st.integers(1, 3)) * (draw(st.sampled_from([1, 4])) if page == 1 else 1)
    nd = draw(st.sampled_from([0, 1, 3, 7]))  # 0: decode, else verify with N drafts
    q, extra = (1, 0) if nd == 0 else (nd, nd)
    per = min(q, (q - 1) // chunk + 2) + draw(st.sampled_from([0, 0, 1]))
    ctx = chunk * draw(st.integers(1, 3)) + page * draw(st.integers(0, 2)) + extra
    bs = draw(st.integers(1, 6))
    n = draw(st.integers(0, bs))
    num_req = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    table = torch.randint(0, 10**6, (num_req, ctx), generator=gen,
                          dtype=I64).to(draw(st.sampled_from([I32, I64])))
    seq = torch.randint(1, ctx - extra + 1, (n,), generator=gen).to(
        draw(st.sampled_from([I32, I64])))
    rpi = torch.randint(0, num_req, (n,), generator=gen).to(draw(st.sampled_from([I32, I64])))
    pad_len = min(draw(st.sampled_from([1, 2, page + 1])), chunk)
    width = -(-min(chunk, ctx) // page)
    layout = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
    c = Case(page, bs, seq, rpi, table, extra, pad_len, draw(st.integers(0, 3)), *layout, None,
             width)
    return LocalCase(c, q, per, chunk)


def local_reference(lc: LocalCase, b: PagedBuffers, cu_q: Tensor) -> None:
    """What the reference local phase writes (phases/local.py), on plain buffers."""
    c = lc.c
    kv = c.seq + c.extra if c.extra else c.seq
    q_lens, kv_lens, off, valid = ref.local_rows(kv, lc.q, lc.chunk, lc.per, c.pad_seq_len)
    pages = ref.gather_pages(c.table, c.rpi.repeat_interleave(lc.per), c.page, c.width, off)
    pages = torch.where(valid[:, None], pages, c.pad_page)
    rows, real = lc.rows, q_lens.shape[0]
    ref.cumsum_(cu_q, q_lens)
    arange = torch.arange(max(rows, c.width) + 1, dtype=I32)
    pad = torch.div(arange[: rows - real], lc.per, rounding_mode="floor").add_(1).mul_(lc.q)
    torch.add(pad, cu_q[real : real + 1], out=cu_q[real + 1 : rows + 1])
    ref.lengths_(b.cache_seqlens, kv_lens, 0, rows, c.pad_seq_len)
    ref.paged_(b, bs=rows, pages=pages, page_size=c.page, pad_page=c.pad_page,
               pad_pages=-(-c.pad_seq_len // c.page), arange=arange)


@SETTINGS
@given(local_cases(), st.booleans(), st.integers(0, 2**31))
def test_local_equals_reference(lc: LocalCase, device_n: bool, seed: int) -> None:
    c = lc.c
    a, b = pair(c, lc.rows + 2)
    cu_a = torch.full((lc.rows + 3,), POISON_REF, dtype=I32)
    cu_b = torch.full((lc.rows + 3,), POISON_TT, dtype=I32)
    local_reference(lc, a, cu_a)
    seq, rpi, num_real = c.seq, c.rpi, None
    if device_n:
        seq, rpi, _ = padded_inputs(c, torch.Generator().manual_seed(seed))
        num_real = torch.tensor([c.n], dtype=I32)
    tt.local_update_(b, cu_seqlens_q=cu_b, bs=c.bs, seq_lens=seq, req_pool_indices=rpi,
                     req_to_token=c.table, extra=c.extra, num_queries=lc.q,
                     rows_per_request=lc.per, chunk=lc.chunk, page_size=c.page,
                     pad_len=c.pad_seq_len, pad_page=c.pad_page, num_real=num_real)
    assert torch.equal(cu_a[: lc.rows + 1], cu_b[: lc.rows + 1])
    assert_read_region_equal(a, b, lc.rows, c.page)


# ---- draft rounds: chain steps in one launch, tree prefix over whole pages ----------------------
def _stacked(c: Case, steps: int, fill: int) -> PagedBuffers:
    rows = c.bs + 2
    pt = torch.full((rows, c.width), fill, dtype=I32) if c.pt else None
    return PagedBuffers(torch.full((steps + 1, rows), fill, dtype=I32),
                        torch.full((steps + 1, rows + 1), fill, dtype=I32), pt, None, None, None)


def _step(b: PagedBuffers, d: int, table: bool) -> PagedBuffers:
    return PagedBuffers(b.cache_seqlens[d], b.cu_seqlens_k[d], b.page_table if table else None,
                        None, None, None)


@SETTINGS
@given(cases(), st.integers(2, 4), st.booleans())
def test_chain_steps_equal_reference_per_step(c: Case, steps: int, device_n: bool) -> None:
    """Step d's lengths and cumsum equal a reference part with ``extra + d``; the shared table
    equals the last step's (its row prefixes serve the earlier steps)."""
    limit = c.width * c.page - c.extra - (steps - 1)
    assume(limit >= 1)  # else no length is in contract for the last step
    off = c.off if c.off is not None else torch.zeros_like(c.seq)
    c.seq = torch.minimum(c.seq, (limit - off).clamp(min=0).to(c.seq.dtype))
    a, b = _stacked(c, steps, POISON_REF), _stacked(c, steps, POISON_TT)
    for d in range(steps):
        run_reference(Case(**{**c.__dict__, "extra": c.extra + d}), _step(a, d, d == steps - 1))
    if device_n:
        seq, rpi, off_p = padded_inputs(c, torch.Generator().manual_seed(c.n))
        tt.paged_update_(b, bs=c.bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=c.table,
                         extra=c.extra, page_size=c.page, pad_seq_len=c.pad_seq_len,
                         pad_page=c.pad_page, token_offset=off_p, steps=steps,
                         num_real=torch.tensor([c.n]))
    else:
        run_triton(c, b, steps=steps)
    for d in range(steps):
        assert_read_region_equal(_step(a, d, True), _step(b, d, True), c.bs, c.page)
    assert (b.cache_seqlens[steps] == POISON_TT).all()  # nothing past the last step


def test_chain_steps_refuse_csr() -> None:
    c = Case(16, 2, torch.tensor([3]), torch.tensor([0]), torch.zeros((1, 64), dtype=I32), 1, 1,
             0, True, False, None, 4)
    b = _stacked(c, 2, 0)
    csr = PagedBuffers(b.cache_seqlens, b.cu_seqlens_k, b.page_table, torch.zeros((2, 4), dtype=I32),
                       torch.zeros((2, 9), dtype=I32), torch.zeros((2, 3), dtype=I32))
    with pytest.raises(LayoutError):
        run_triton(c, csr, steps=2)
    with pytest.raises(InputError):  # steps > 1 needs [steps, rows] lengths
        run_triton(c, PagedBuffers(b.cache_seqlens[0], b.cu_seqlens_k[0], None, None, None, None),
                   steps=2)


@SETTINGS
@given(cases())
def test_full_pages_equals_reference(c: Case) -> None:
    """The draft tree prefix pass: lengths rounded down to whole pages (phases/draft.py)."""
    a, b = pair(c)
    full = torch.div(c.seq.to(I64) + c.extra, c.page, rounding_mode="floor") * c.page
    run_reference(Case(**{**c.__dict__, "seq": full, "extra": 0}), a)
    run_triton(c, b, full_pages=True)
    assert_read_region_equal(a, b, c.bs, c.page)


@st.composite
def draft_cases(draw: st.DrawFn) -> tuple[Case, Tensor]:
    """A draft tree round: Case.bs = requests, Case.width = P-1+S; plus out_cache_loc [n, S, K]."""
    page = draw(st.sampled_from([1, 16, 64]))
    steps, topk = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    bs = draw(st.integers(1, 5))
    n = draw(st.integers(0, bs))
    ctx = page * draw(st.integers(1, 3)) + steps
    num_req = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    dt = [draw(st.sampled_from([I32, I64])) for _ in range(4)]
    table = torch.randint(0, 10**6, (num_req, ctx), generator=gen, dtype=I64).to(dt[0])
    seq = torch.randint(1, ctx - steps + 1, (n,), generator=gen).to(dt[1])
    rpi = torch.randint(0, num_req, (n,), generator=gen).to(dt[2])
    loc = torch.randint(0, 10**6, (n, steps, topk), generator=gen, dtype=I64).to(dt[3])
    if draw(st.booleans()):
        loc = loc.permute(0, 2, 1).contiguous().permute(0, 2, 1)  # strided, same values
    width = page - 1 + steps
    pad_len = min(draw(st.sampled_from([1, 0, 3, 100])), width)
    layout = draw(st.sampled_from([(True, True), (True, False), (False, True), (False, False)]))
    c = Case(page, bs, seq, rpi, table, 0, pad_len, draw(st.integers(0, 3)) * page, *layout, None,
             width)
    return c, loc


def _draft_stacked(c: Case, steps: int, rows: int, fill: int) -> PagedBuffers:
    def t(*shape: int) -> Tensor:
        return torch.full(shape, fill, dtype=I32)

    return PagedBuffers(t(steps, rows + 2), t(steps, rows + 3),
                        t(rows + 2, c.width) if c.pt else None,
                        t(steps, rows + 3) if c.fi else None,
                        t(steps, rows * c.width + 1) if c.fi else None,
                        t(steps, rows + 2) if c.fi else None)


def _draft_step(b: PagedBuffers, d: int, table: bool) -> PagedBuffers:
    def s(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[d]

    return PagedBuffers(b.cache_seqlens[d], b.cu_seqlens_k[d], b.page_table if table else None,
                        s(b.kv_indptr), s(b.kv_indices), s(b.kv_last_page_len))


@SETTINGS
@given(draft_cases(), st.booleans())
def test_draft_tree_expand_equals_reference(dc: tuple[Case, Tensor], device_n: bool) -> None:
    c, loc = dc
    steps, topk = loc.shape[1], loc.shape[2]
    rows = c.bs * topk
    a, b = (_draft_stacked(c, steps, rows, f) for f in (POISON_REF, POISON_TT))
    _, part, slots = ref.draft_expand(c.seq, c.rpi, c.table, loc, c.page)
    arange = torch.arange(rows + c.width + 1, dtype=I32)
    for d in range(steps):  # what the reference draft phase writes (phases/draft.py)
        step = _draft_step(a, d, d == steps - 1)
        ref.lengths_(step.cache_seqlens, part, d + 1, rows, c.pad_seq_len)
        ref.paged_(step, bs=rows, pages=slots, page_size=1, pad_page=c.pad_page,
                   pad_pages=c.pad_seq_len, arange=arange)
    seq, rpi, num_real = c.seq, c.rpi, None
    if device_n:
        seq, rpi, _ = padded_inputs(c, torch.Generator().manual_seed(c.n))
        junk = torch.full((c.bs - c.n, steps, topk), -(10**6), dtype=loc.dtype)
        loc = torch.cat([loc, junk])
        num_real = torch.tensor([c.n], dtype=I32)
    tt.draft_tree_expand_update_(b, bs=c.bs, seq_lens=seq, req_pool_indices=rpi,
                                 req_to_token=c.table, out_cache_loc=loc, page_size=c.page,
                                 pad_len=c.pad_seq_len, pad_id=c.pad_page, num_real=num_real)
    for d in range(steps):
        assert_read_region_equal(_draft_step(a, d, True), _draft_step(b, d, True), rows, 1)


# ---- out-of-contract values: wrong metadata at worst, never a write outside the buffers ---------
def _guarded(rows: int, width: int, fill: int = POISON_TT) -> tuple[PagedBuffers, list[Tensor]]:
    """Buffers that are interior slices of larger tensors; the returned guards must stay intact."""
    big1 = [torch.full((3 * (rows + 1),), fill, dtype=I32) for _ in range(5)]
    big2 = torch.full((rows + 4, width + 5), fill, dtype=I32)
    idx = torch.full((3 * (rows * width + 1),), fill, dtype=I32)
    m, k = rows + 1, rows * width + 1
    b = PagedBuffers(big1[0][m : m + rows], big1[1][m : 2 * m], big2[2 : rows + 2, 2 : width + 2],
                     big1[2][m : 2 * m], idx[k : 2 * k], big1[3][m : m + rows])
    guards = [x[:m] for x in big1[:4]] + [x[2 * m :] for x in big1[:4]]
    guards += [big2[:2], big2[rows + 2 :], big2[:, :2], big2[:, width + 2 :], idx[:k], idx[2 * k :]]
    return b, guards


def test_out_of_contract_inputs_stay_in_bounds() -> None:
    bs, width, page = 4, 3, 16
    table = torch.randint(0, 999, (2, 48), dtype=I32)
    seq = torch.tensor([10**6, -(10**6), 2**31 - 5])  # far past capacity, negative, near overflow
    rpi = torch.tensor([5, -3, 2**40])  # outside the table
    b, guards = _guarded(bs, width)
    tt.paged_update_(b, bs=bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, extra=7,
                     page_size=page, pad_seq_len=1, pad_page=0,
                     token_offset=torch.tensor([-(10**6), 10**9, 5]))
    tt.paged_update_(b, bs=bs, seq_lens=seq, req_pool_indices=rpi, req_to_token=table, extra=0,
                     page_size=page, pad_seq_len=1, pad_page=0, keep=torch.ones(bs, dtype=I32))
    nd = 3
    e, e_guards = _guarded(bs * nd, nd)
    tt.tree_expand_update_(e, bs=bs, tree_mask=torch.ones((3, nd, nd), dtype=torch.bool),
                           seq_lens=seq, req_pool_indices=rpi, req_to_token=table, pad_len=1,
                           pad_id=0)
    loc_b, l_guards = _guarded(bs, width)
    cu_q = torch.zeros(bs + 1, dtype=I32)
    tt.local_update_(loc_b, cu_seqlens_q=cu_q, bs=bs, seq_lens=seq, req_pool_indices=rpi,
                     req_to_token=table, extra=2, num_queries=2, rows_per_request=1, chunk=32,
                     page_size=page, pad_len=1, pad_page=0)
    for g in guards + e_guards + l_guards:
        assert (g == POISON_TT).all()

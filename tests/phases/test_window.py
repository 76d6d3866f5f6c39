"""Sliding-window parts (``PoolConfig(sliding_window=W)``): every phase that reads the KV cache
keeps a ``.window`` part whose rows start at the window's first page.

Each update's window part is compared, byte for byte in its read region, with a plain-Python
oracle of the formula (docs/design.md, Sliding windows): a row of total length ``L`` with ``q``
queries starts at page ``s = max(0, L - q - W + 1) // P``, holds ``cache_seqlens = L - s * P``
and the row's pages ``s, s+1, ...`` of the window table. Both update paths, both layouts, page
sizes 1 / 4 / 16, token and block tables, a separate window table whose entries before the
window hold -1 (freed), and every phase with a window part. Bad input raises ``PoolError`` with
no byte of the pool changed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import (
    BufferPool,
    CapacityError,
    Impl,
    InputError,
    Layout,
    LayoutError,
    Phase,
    PoolConfig,
    PoolError,
)

C, MAX_BS, ROWS, T, ND, STEPS = 96, 5, 7, 40, 3, 2
IMPLS = [pytest.param(Impl.REFERENCE, id="ref"),
         pytest.param(Impl.TRITON, id="triton", marks=pytest.mark.triton)]
LAYOUTS = [pytest.param(Layout.FLASH_ATTN, id="fa"), pytest.param(Layout.FLASHINFER, id="fi")]
PHASES = ["decode", "verify", "draft", "draft_extend", "extend"]


def config(page: int, w: int, layout: Layout, impl: Impl, **kw: Any) -> PoolConfig:
    return PoolConfig(max_bs=MAX_BS, max_context_len=C, page_size=page, device="cpu",
                      layout=layout | Layout.FLASH_ATTN if kw.get("spec_steps") else layout,
                      num_draft_tokens=ND, max_extend_tokens=T, sliding_window=w, impl=impl,
                      num_pages=ROWS * (C // page) * 2 + 1, pad_seq_len=2, **kw)


def tables(page: int, rng: random.Random) -> tuple[Tensor, Tensor]:
    """A token-level request table and a window table (distinct slots, page-aligned)."""
    cols = C // page
    out = []
    for base in (1, ROWS * cols + 1):
        ids = list(range(base, base + ROWS * cols))
        rng.shuffle(ids)
        bt = torch.tensor(ids, dtype=torch.int64).view(ROWS, cols)
        out.append((bt.repeat_interleave(page, 1) * page + torch.arange(C) % page).to(torch.int32))
    return out[0], out[1]


def as_block(tok: Tensor, page: int) -> Tensor:
    return (tok[:, ::page] // page).contiguous()


def forget_before_window(wt: Tensor, rows: list[int], starts: list[int]) -> Tensor:
    """The window table as an engine that freed the out-of-window pages keeps it: -1 before
    each row's window start (nothing may read those entries)."""
    wt = wt.clone()
    for r, s in zip(rows, starts, strict=True):
        wt[r, :s] = -1
    return wt


def oracle(total: list[int], q: list[int], w: int, page: int, table: Tensor, rows: list[int],
           steps: int = 1) -> tuple[list[int], list[list[int]]]:
    """The window rows' lengths (step 1's) and page ids, in plain Python."""
    lens, pages = [], []
    for big, qi, r in zip(total, q, rows, strict=True):
        s = max(0, big - qi - w + 1) // page
        ln = big - s * page
        lens.append(ln)
        npg = -(-(ln + steps - 1) // page)
        pages.append([int(table[r, (s + j) * page]) // page for j in range(npg)])
    return lens, pages


def run(pool: BufferPool, phase: str, n: int, bs: int, seq: list[int], rows: list[int],
        tbl: dict[str, Tensor], q: list[int]) -> Any:
    """One update of ``phase``; ``q`` are the queries per row (extend / draft extend)."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    kw: dict[str, Any] = {"seq_lens": t(seq), "req_pool_indices": t(rows), **tbl}
    if phase == "draft_extend":
        kw["accept_lens"] = t(q)
    if phase == "extend":
        kw["extend_lens"] = t(q)
    return pool.phase(phase).update_(bs, **kw)


def window_parts(view: Any) -> list[Any]:
    if hasattr(view, "steps"):
        return [s.window for s in view.steps]
    return [view.window]


def batch(phase: str, rng: random.Random, n: int) -> tuple[list[int], list[int], list[int]]:
    """``(seq_lens, q, total lengths L)`` of ``n`` in-contract rows of ``phase``."""
    hi = C - (ND if phase == "verify" else STEPS if phase == "draft" else 0)
    seq = [rng.randint(1, hi) for _ in range(n)]
    if phase == "extend":
        q = [rng.randint(1, min(s, T // n)) for s in seq]
    elif phase == "draft_extend":
        q = [rng.randint(1, min(s, ND)) for s in seq]
    else:
        q = [ND if phase == "verify" else 1] * n
    add = ND if phase == "verify" else 1 if phase == "draft" else 0
    return seq, q, [s + add for s in seq]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kind", ["tokens", "blocks"])
def test_window_rows_match_the_formula(phase: str, page: int, layout: Layout, impl: Impl,
                                       kind: str) -> None:
    if phase == "draft" and layout is Layout.FLASHINFER:
        layout = Layout.FLASH_ATTN  # chain drafts keep one 2-D table (config rule)
    rng = random.Random(f"{phase}{page}{layout}{kind}")
    w = rng.choice([1, 5, 17, 33])
    cfg = config(page, w, layout, impl, spec_steps=STEPS if phase == "draft" else 0)
    pool = BufferPool(cfg, poison=True)
    full, win = tables(page, rng)
    for n, bs in ((3, 5), (5, 5), (1, 2)):
        seq, q, total = batch(phase, rng, n)
        rows = rng.sample(range(ROWS), n)
        _, starts = oracle(total, q, w, page, win, rows)[0], [
            max(0, big - qi - w + 1) // page * page for big, qi in zip(total, q, strict=True)]
        wt = forget_before_window(win, rows, starts)
        tbl = ({"req_to_token": full, "window_req_to_token": wt} if kind == "tokens" else
               {"block_table": as_block(full, page), "window_block_table": as_block(wt, page)})
        view = run(pool, phase, n, bs, seq, rows, tbl, q)
        pool.check(view)
        steps = STEPS if phase == "draft" else 1
        lens, pages = oracle(total, q, w, page, win, rows, steps)
        for d, part in enumerate(window_parts(view)):
            assert part.window_left == w - 1 and part.bs == bs
            got = part.cache_seqlens.tolist()
            assert got[:n] == [x + d for x in lens]
            assert got[n:] == [cfg.pad_seq_len] * (bs - n)
            cum = [0]
            for x in got:
                cum.append(cum[-1] + x)
            assert part.cu_seqlens_k.tolist() == cum
        last = window_parts(view)[-1]
        if last.page_table is not None:
            for i in range(n):
                assert last.page_table[i, : len(pages[i])].tolist() == pages[i]
        if last.kv_indptr is not None:
            ptr = last.kv_indptr.tolist()
            for i in range(n):
                assert last.kv_indices[ptr[i] : ptr[i + 1]].tolist() == pages[i]
            assert last.kv_last_page_len[:n].tolist() == [(x - 1) % page + 1 for x in lens]


@pytest.mark.triton
@pytest.mark.parametrize("layout", [Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH])
@pytest.mark.parametrize("phase", PHASES)
def test_both_paths_write_the_same_window_bytes(phase: str, layout: Layout) -> None:
    """The fused launch (full and window rows in one) and the reference path agree exactly in
    the window part's read region, with the window's own slot mapping for extend."""
    rng = random.Random(phase)
    pools = [BufferPool(config(4, 9, layout, impl, spec_steps=STEPS if phase == "draft" else 0),
                        poison=True) for impl in (Impl.REFERENCE, Impl.TRITON)]
    full, win = tables(4, rng)
    seq, q, _ = batch(phase, rng, 4)
    rows = rng.sample(range(ROWS), 4)
    slots = [torch.full((T,), 7, dtype=torch.int64) for _ in range(4)]
    views = []
    for k, pool in enumerate(pools):
        extra = ({"out_slots": slots[2 * k], "window_out_slots": slots[2 * k + 1]}
                 if phase == "extend" else {})
        pool_view = run(pool, phase, 4, 5, seq, rows,
                        {"req_to_token": full, "window_req_to_token": win, **extra}, q)
        pool.check(pool_view)
        views.append(pool_view)
    for a, b in zip(window_parts(views[0]), window_parts(views[1]), strict=True):
        assert torch.equal(a.cache_seqlens, b.cache_seqlens)
        assert torch.equal(a.cu_seqlens_k, b.cu_seqlens_k)
        if a.page_table is not None:
            lens = a.cache_seqlens.tolist()
            for i, x in enumerate(lens):
                k = -(-x // 4)  # the step's own read region
                assert torch.equal(a.page_table[i, :k], b.page_table[i, :k])
        if a.kv_indptr is not None:
            assert torch.equal(a.kv_indptr, b.kv_indptr)
            end = int(a.kv_indptr[-1])
            assert torch.equal(a.kv_indices[:end], b.kv_indices[:end])
            assert torch.equal(a.kv_last_page_len, b.kv_last_page_len)
    if phase == "extend":
        assert torch.equal(slots[0], slots[2]) and torch.equal(slots[1], slots[3])
        total = sum(q)
        want = [int(win[r, s - qi + j]) for r, s, qi in zip(rows, seq, q, strict=True)
                for j in range(qi)]
        assert slots[1][:total].tolist() == want and set(slots[1][total:].tolist()) == {-1}


@pytest.mark.parametrize("phase", PHASES)
def test_window_table_memory_is_bounded_by_the_window(phase: str) -> None:
    """The window page table has ``ceil((W - 1 + q_max) / P) + 1`` columns however long the
    context; the full one has ``ceil(C / P)``."""
    qmax = {"decode": 1, "verify": ND, "draft": STEPS, "draft_extend": ND, "extend": T}[phase]
    for c in (4096, 131072):
        cfg = PoolConfig(max_bs=8, max_context_len=c, page_size=16, device="cpu",
                         num_draft_tokens=ND, spec_steps=STEPS, max_extend_tokens=T,
                         sliding_window=1024)
        pool = BufferPool(cfg)
        ph = Phase(phase)
        wt = pool.arena.buffer(ph, "window_page_table")
        assert wt.shape == (8, -(-(1023 + qmax) // 16) + 1)
        assert cfg.window_pages(ph) == wt.shape[1] < cfg.max_pages or c < 2048
        assert "window_page_table" in pool.report()


def test_no_window_means_no_window_part() -> None:
    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=64, page_size=4, device="cpu",
                                 num_draft_tokens=2, spec_steps=1, max_extend_tokens=8))
    assert pool.decode.view(2).window is None and pool.verify.view(2).window is None
    assert all(s.window is None for s in pool.draft.view(2).steps)
    assert not any("window" in p.spec.name for p in pool.arena.plan.placements)


def test_window_view_is_stale_once_another_phase_writes() -> None:
    pool = BufferPool(config(4, 8, Layout.FLASH_ATTN, Impl.REFERENCE), poison=True)
    v = pool.decode.view(3)
    assert v.window is not None and v.window.is_current
    pool.verify.view(3)
    assert not v.window.is_current


@pytest.mark.triton
def test_bound_and_capturable_updates_write_the_window() -> None:
    """``bind`` and ``num_real`` replay the window rows too (one launch for both parts)."""
    rng = random.Random(3)
    full, win = tables(4, rng)
    cfg = config(4, 6, Layout.BOTH, Impl.TRITON)
    ref = BufferPool(config(4, 6, Layout.BOTH, Impl.REFERENCE), poison=True)
    pool = BufferPool(cfg, poison=True)
    seq = torch.tensor([30, 5, 90, 1, 44], dtype=torch.int64)
    rows = torch.tensor([6, 0, 3, 2, 1], dtype=torch.int64)
    u = pool.decode.bind(5, seq_lens=seq, req_pool_indices=rows, req_to_token=full,
                         window_req_to_token=win)
    seq.copy_(torch.tensor([60, 6, 91, 2, 45]))
    view = u()
    want = ref.decode.update_(5, seq_lens=seq, req_pool_indices=rows, req_to_token=full,
                              window_req_to_token=win)
    assert torch.equal(view.window.cache_seqlens, want.window.cache_seqlens)
    n_real = torch.tensor([3], dtype=torch.int32)
    view = pool.decode.update_(5, seq_lens=seq, req_pool_indices=rows, req_to_token=full,
                               window_req_to_token=win, num_real=n_real)
    want = ref.decode.update_(5, seq_lens=seq[:3], req_pool_indices=rows[:3], req_to_token=full,
                              window_req_to_token=win)
    assert torch.equal(view.window.cache_seqlens, want.window.cache_seqlens)
    assert torch.equal(view.window.kv_indptr, want.window.kv_indptr)
    pool.check(view)


def test_validate_mode_accepts_window_tables() -> None:
    rng = random.Random(4)
    full, win = tables(4, rng)
    pool = BufferPool(config(4, 6, Layout.FLASH_ATTN, Impl.REFERENCE), poison=True,
                      validate=True)
    v = pool.decode.update_(2, seq_lens=torch.tensor([40, 3]),
                            req_pool_indices=torch.tensor([1, 2]), req_to_token=full,
                            window_req_to_token=win[:3])
    pool.check(v)
    with pytest.raises(CapacityError, match=r"req_pool_indices\[1\] must be in \[0, 2\]"):
        pool.decode.update_(2, seq_lens=torch.tensor([40, 3]),
                            req_pool_indices=torch.tensor([1, 5]), req_to_token=full,
                            window_req_to_token=win[:3])


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [0, -3, 2.0, True])
def test_bad_sliding_window(w: object) -> None:
    with pytest.raises(PoolError, match="sliding_window"):
        PoolConfig(max_bs=2, max_context_len=64, device="cpu", sliding_window=w)  # type: ignore[arg-type]


def test_tree_speculation_refuses_a_window() -> None:
    with pytest.raises(LayoutError, match="topk"):
        PoolConfig(max_bs=2, max_context_len=64, device="cpu", num_draft_tokens=3, topk=2,
                   sliding_window=8)


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_window_tables_change_nothing(impl: Impl) -> None:
    rng = random.Random(5)
    full, win = tables(4, rng)
    pool = BufferPool(config(4, 6, Layout.BOTH, impl), poison=True)
    base = {"seq_lens": torch.tensor([40, 3]), "req_pool_indices": torch.tensor([1, 2])}
    pool.decode.update_(2, **base, req_to_token=full, window_req_to_token=win)
    before = pool.arena.storage.clone()
    bad: list[tuple[dict[str, Any], type[PoolError], str]] = [
        ({"req_to_token": full, "window_req_to_token": win[:, : C - 1]}, InputError,
         r"window_req_to_token must have >= max_context_len=96 columns"),
        ({"req_to_token": full, "window_req_to_token": win.to(torch.int64)}, InputError,
         "dtype"),
        ({"req_to_token": full, "window_req_to_token": win.to("meta")}, InputError,
         "must be on cpu, got meta"),
        ({"req_to_token": full, "window_block_table": as_block(win, 4)}, InputError, "kind"),
        ({"req_to_token": full, "window_req_to_token": win, "window_block_table": win},
         InputError, "at most one"),
        ({"block_table": as_block(full, 4), "window_block_table": as_block(win, 4)[:, :3]},
         InputError, r"window_block_table must have >= max_pages=24 columns"),
    ]
    for kw, err, msg in bad:
        with pytest.raises(err, match=msg):
            pool.decode.update_(2, **base, **kw)
        assert torch.equal(pool.arena.storage, before)
    with pytest.raises(CapacityError, match="window_out_slots"):
        pool.extend.update_(2, **base, extend_lens=torch.tensor([2, 2]), req_to_token=full,
                            window_out_slots=torch.zeros(3, dtype=torch.int64))
    plain = BufferPool(PoolConfig(max_bs=2, max_context_len=C, page_size=4, device="cpu",
                                  max_extend_tokens=T, impl=impl))
    with pytest.raises(LayoutError, match="sliding_window"):
        plain.decode.update_(2, **base, req_to_token=full, window_req_to_token=win)
    with pytest.raises(LayoutError, match="sliding_window"):
        plain.extend.update_(2, **base, extend_lens=torch.tensor([2, 2]), req_to_token=full,
                             window_out_slots=torch.zeros(T, dtype=torch.int64))


def test_plan_shows_the_window_parts() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "attnpool", "plan", "--max-bs", "160", "--context",
                          "131072", "--page-size", "16", "--sliding-window", "4096"],
                         capture_output=True, text=True, check=True).stdout
    rows = {line.split()[1]: line.split()[2] for line in out.splitlines()
            if line.startswith("decode ")}
    assert rows["window_page_table"] == "160x257" and rows["page_table"] == "160x8192"


def test_check_reads_the_window_part_too() -> None:
    """``pool.check`` covers the window part of a decode view: a window row whose page was
    never written is caught (here: poison put back into the window part's table)."""
    pool = BufferPool(config(4, 6, Layout.FLASH_ATTN, Impl.REFERENCE), poison=True)
    full, win = tables(4, random.Random(9))
    view = pool.decode.update_(2, seq_lens=torch.tensor([40, 3]),
                               req_pool_indices=torch.tensor([1, 2]), req_to_token=full,
                               window_req_to_token=win)
    pool.check(view)
    assert view.window is not None and view.window.page_table is not None
    view.window.page_table[0, 0] = torch.iinfo(torch.int32).max
    from attnpool import ReadRegionError

    with pytest.raises(ReadRegionError, match=r"DecodeView\.window\.page_table\[0\]"):
        pool.check(view)


# ---- out-of-contract values and edge shapes (each once a bug) ---------------------------------
def test_padded_rows_must_fit_the_window_table() -> None:
    with pytest.raises(PoolError, match="pad_seq_len must fit the window parts' page tables"):
        PoolConfig(max_bs=4, max_context_len=256, page_size=16, device="cpu", sliding_window=4,
                   pad_seq_len=64)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_contract_lengths_stay_inside_the_window_part(impl: Impl) -> None:
    """Device values no host check sees (a query count past T, one near int32's limit) give a
    window part whose read region still fits its buffers, the same on both paths."""
    cfg = PoolConfig(max_bs=4, max_context_len=C, page_size=4, device="cpu",
                     layout=Layout.FLASHINFER, max_extend_tokens=8, sliding_window=5, impl=impl)
    full, _ = tables(4, random.Random(10))
    cap = cfg.window_pages(Phase.EXTEND)
    for ext in ([58, 58, 58, 58], [2**31 - 1, 3, 1, 1]):
        pool = BufferPool(cfg, poison=True)
        v = pool.extend.update_(4, seq_lens=torch.tensor([60, 20, 10, 5], dtype=torch.int32),
                                extend_lens=torch.tensor(ext, dtype=torch.int32),
                                req_pool_indices=torch.arange(4), req_to_token=full)
        w = v.window
        assert w is not None and w.kv_indptr is not None and w.kv_indices is not None
        lens = w.cache_seqlens.tolist()
        assert all(0 <= x <= cap * 4 for x in lens), lens
        assert 0 <= int(w.kv_indptr[-1]) <= w.kv_indices.shape[0] - 1


@pytest.mark.triton
def test_out_of_contract_window_bytes_agree() -> None:
    full, _ = tables(4, random.Random(11))
    views = []
    for impl in (Impl.REFERENCE, Impl.TRITON):
        cfg = PoolConfig(max_bs=4, max_context_len=C, page_size=4, device="cpu",
                         layout=Layout.BOTH, max_extend_tokens=8, sliding_window=100, impl=impl)
        pool = BufferPool(cfg, poison=True)
        views.append(pool.extend.update_(
            2, seq_lens=torch.tensor([10, 20], dtype=torch.int32),
            extend_lens=torch.tensor([2**31 - 1, 3], dtype=torch.int32),
            req_pool_indices=torch.tensor([0, 1]), req_to_token=full).window)
    a, b = views
    assert torch.equal(a.cache_seqlens, b.cache_seqlens) and min(a.cache_seqlens.tolist()) >= 0
    assert torch.equal(a.kv_indptr, b.kv_indptr) and torch.equal(a.cu_seqlens_k, b.cu_seqlens_k)


def test_window_table_edge_inputs() -> None:
    rng = random.Random(12)
    full, win = tables(4, rng)
    pool = BufferPool(config(4, 6, Layout.BOTH, Impl.REFERENCE), poison=True)
    # a window block table too short for rows in batch order
    with pytest.raises(CapacityError, match="window_block_table without req_pool_indices"):
        pool.decode.update_(4, seq_lens=torch.tensor([5, 6, 7, 8]),
                            block_table=as_block(full, 4), window_block_table=as_block(win, 4)[:2])
    # one tensor for both slot mappings
    slots = torch.zeros(T + 1, dtype=torch.int64)
    with pytest.raises(InputError, match="must not overlap"):
        pool.extend.update_(2, seq_lens=torch.tensor([5, 6]), extend_lens=torch.tensor([2, 2]),
                            req_pool_indices=torch.tensor([0, 1]), req_to_token=full,
                            out_slots=slots[:T], window_out_slots=slots[1:])
    # a request table wider than the window table (both cover C): accepted
    wide = torch.cat([full, full[:, :8]], 1)
    pool.decode.update_(2, seq_lens=torch.tensor([50, 6]), req_pool_indices=torch.tensor([0, 1]),
                        req_to_token=wide, window_req_to_token=win)

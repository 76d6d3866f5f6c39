"""Page-level block tables (vLLM, transformers): ``block_table=`` instead of ``req_to_token=``.

A block table ``[rows, >= max_pages]`` holds page ids; it means the token-level table
``req_to_token[r, t] = block_table[r, t // P] * P + t % P``. For every phase, layout, page size
and update path, an update given the block table writes exactly the bytes (the whole arena, not
only the read region) of the same update given that token table: with ``req_pool_indices``, and
without (row ``i`` of the batch is then block-table row ``i``), eager and capturable (fused path).
Bad block tables raise a ``PoolError`` with no byte of the pool changed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, CapacityError, Impl, InputError, Layout, PoolConfig, PoolError

from tests.helpers import fuzzcases as fc
from tests.update.test_fused_phases import assert_same, padded

#: test id -> (phase attribute, topk)
VARIANTS = {"decode": ("decode", 1), "verify_chain": ("verify", 1), "verify_tree": ("verify", 2),
            "draft_chain": ("draft", 1), "draft_tree": ("draft", 2),
            "draft_extend": ("draft_extend", 1), "encoder": ("encoder", 1),
            "local": ("local", 1), "extend": ("extend", 1)}
PAGES = [1, 4, 16]
LAYOUTS = [pytest.param(Layout.FLASH_ATTN, id="fa"), pytest.param(Layout.FLASHINFER, id="fi")]
IMPLS = [pytest.param(Impl.REFERENCE, id="ref"),
         pytest.param(Impl.TRITON, id="triton", marks=pytest.mark.triton)]
MAX_BS, ROWS, EXTRA_COLS, T = 6, 13, 3, 24


def config(variant: str, layout: Layout, page: int, impl: Impl) -> PoolConfig:
    """Every phase but draft (whose chain rounds need a page table) in the layout asked for."""
    phase, topk = VARIANTS[variant]
    draft = phase == "draft"
    if draft and topk == 1:
        layout |= Layout.FLASH_ATTN  # chain drafts share one 2-D page table (config rule)
    max_pages = -(-fc.C // page)
    return PoolConfig(max_bs=MAX_BS, max_context_len=fc.C, page_size=page, device="cpu",
                      layout=layout, num_draft_tokens=fc.ND, topk=topk,
                      spec_steps=fc.STEPS if draft else 0, max_encoder_len=fc.MAX_ENC,
                      attention_chunk_size=max(8, page) * 2, pad_seq_len=fc.PAD_LEN,
                      pad_page=fc.PAD_PAGE, num_pages=ROWS * (max_pages + EXTRA_COLS) + 1,
                      max_extend_tokens=T, impl=impl)


def make_block_table(cfg: PoolConfig, rng: random.Random, cols: int) -> Tensor:
    """``[ROWS, cols]`` int32 distinct page ids, shuffled; page 0 is never used."""
    ids = list(range(1, ROWS * cols + 1))
    rng.shuffle(ids)
    return torch.tensor(ids, dtype=torch.int32).view(ROWS, cols)


def token_table(bt: Tensor, page: int) -> Tensor:
    """The equivalent token-level table: ``bt[r, t // P] * P + t % P``, ``cols * P`` wide."""
    tok = bt.to(torch.int64).repeat_interleave(page, 1) * page
    return (tok + torch.arange(page).repeat(bt.shape[1])).to(bt.dtype).contiguous()


def extend_call(pool: BufferPool, rng: random.Random, table: Tensor) -> fc.Call:
    bs = rng.randint(1, MAX_BS)
    n = rng.randint(0, bs)
    slots = rng.sample(range(table.shape[0]), n)
    lens = [rng.choice([1, fc.C, rng.randint(1, fc.C)]) for _ in range(n)]
    ext = [rng.randint(1, min(s, T // MAX_BS)) for s in lens]
    i64 = torch.int64
    kw: dict[str, Any] = {"seq_lens": torch.tensor(lens, dtype=i64),
                          "extend_lens": torch.tensor(ext, dtype=i64),
                          "req_pool_indices": torch.tensor(slots, dtype=i64), "req_to_token": table}
    if rng.random() < 0.5:
        kw.update(seq_lens_cpu=lens, extend_lens_cpu=ext)
    return fc.Call("extend", bs, kw, pool.check)


def make_call(pool: BufferPool, variant: str, rng: random.Random, table: Tensor, min_rows: int = 3
              ) -> fc.Call:
    """A random valid call of ``variant`` with at least ``min_rows`` real rows, one of which
    ends past its last page's second slot (token-slot reads then cross a page's interior)."""
    phase, page = VARIANTS[variant][0], pool.cfg.page_size
    while True:
        call = extend_call(pool, rng, table) if phase == "extend" else fc.valid_call(
            pool, phase, rng, table=table)
        lens = call.kwargs["seq_lens"].tolist()
        if len(lens) >= min_rows and (page <= 2 or any(x % page >= 2 for x in lens)):
            return call


def capturable(call: fc.Call) -> fc.Call:
    """The call in capturable form: per-row inputs padded to ``bs`` rows, a ``[1]`` real count,
    no host copies (the padded rows' values are junk: they must never be read)."""
    n = call.kwargs["seq_lens"].shape[0]
    kw: dict[str, Any] = {}
    for k, v in call.kwargs.items():
        if k.endswith("_cpu"):
            continue
        if isinstance(v, Tensor) and k != "req_to_token":
            v = padded(v, call.bs, True) if v.dtype == torch.bool else padded(v, call.bs, -5)
        kw[k] = v
    kw["num_real"] = torch.tensor([n], dtype=torch.int32)
    return fc.Call(call.phase, call.bs, kw, call.oracle)


def in_order(bt: Tensor, rows: Tensor, need: int) -> Tensor:
    """Block-table rows ``rows`` in batch order, then junk rows up to ``max(need, 1)`` rows."""
    picked = bt[rows.long()]
    junk = torch.full((max(need, 1) - picked.shape[0], bt.shape[1]), 10**6, dtype=bt.dtype)
    return torch.cat([picked, junk]).contiguous()


def update(pool: BufferPool, call: fc.Call, **override: Any) -> tuple[object, Tensor | None]:
    """Run ``call`` (with ``override``); for extend, into a fresh ``out_slots`` buffer."""
    slots = None
    if call.phase == "extend":
        slots = override["out_slots"] = torch.full((T + 3,), 7, dtype=torch.int64)
    view = fc.run(pool, call, **override)
    pool.check(view)
    return view, slots


def assert_same_bytes(a: BufferPool, va: object, b: BufferPool, vb: object,
                      host_ints: bool = True) -> None:
    assert_same(va, vb, host_ints)  # read regions (readable failures) ...
    assert torch.equal(a.arena.storage, b.arena.storage)  # ... then every byte of the arena


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_table_writes_the_bytes_of_the_equivalent_req_to_token(
        variant: str, layout: Layout, page: int, impl: Impl) -> None:
    cfg = config(variant, layout, page, impl)
    tok_pool, blk_pool = BufferPool(cfg, poison=True), BufferPool(cfg, poison=True)
    seed = list(VARIANTS).index(variant) * 100 + page * 10 + layout.value
    rng = random.Random(seed)
    bt = make_block_table(cfg, rng, cfg.max_pages + rng.choice([0, EXTRA_COLS]))
    if rng.random() < 0.5:
        bt = bt.to(torch.int64)
    call = make_call(tok_pool, variant, rng, token_table(bt, page))
    # capturable (fused path) at one page size > 1: the same launches with the count on device
    modes = [call, capturable(call)] if impl is Impl.TRITON and page == 4 else [call]
    for c in modes:
        eager = "num_real" not in c.kwargs
        tok_pool.poison_()  # every update below starts from the same bytes
        want, want_slots = update(tok_pool, c)
        if eager:
            c.oracle(want)  # the token-table update itself is right
        rows = c.kwargs["req_pool_indices"]
        ordered = in_order(bt, rows[: c.kwargs["seq_lens"].shape[0]], rows.shape[0])
        # with req_pool_indices; without (batch row i is block-table row i)
        for override in ({"block_table": bt},
                         {"block_table": ordered, "req_pool_indices": None}):
            blk_pool.poison_()
            got, slots = update(blk_pool, c, req_to_token=None, **override)
            assert_same_bytes(tok_pool, want, blk_pool, got, host_ints=eager)
            assert slots is None or torch.equal(slots, want_slots)


@pytest.mark.triton
@pytest.mark.parametrize("phase", ["decode", "verify"])
def test_fused_launch_cache_tells_the_table_kinds_apart(phase: str) -> None:
    """A token table and a block table of the same shape and strides are different launches."""
    cfg = config("verify_tree" if phase == "verify" else phase, Layout.BOTH, 4, Impl.TRITON)
    pool, fresh = BufferPool(cfg, poison=True), BufferPool(cfg, poison=True)
    rng = random.Random(5)
    bt = make_block_table(cfg, rng, fc.C)  # as wide as a token table: valid as either kind
    call = fc.valid_call(pool, phase, rng, table=token_table(bt, 4))
    fc.run(pool, call, req_to_token=bt)  # caches the token-table launch of this very tensor
    pool.poison_()
    got = fc.run(pool, call, req_to_token=None, block_table=bt)
    want = fc.run(fresh, call)
    assert_same_bytes(fresh, want, pool, got)


@pytest.mark.parametrize("impl", IMPLS)
def test_bound_update_over_a_block_table(impl: Impl) -> None:
    """``bind`` with a block table and no ``req_pool_indices``: later calls read the current
    values of the bound tensors, as a token-table update of those values would."""
    cfg = config("decode", Layout.BOTH, 4, impl)
    pool, ref = BufferPool(cfg, poison=True), BufferPool(cfg, poison=True)
    rng = random.Random(9)
    bt = make_block_table(cfg, rng, cfg.max_pages)
    seq = torch.tensor([5, 77, 128, 1], dtype=torch.int32)
    u = pool.decode.bind(4, seq_lens=seq, block_table=bt)
    for _ in range(2):
        want = ref.decode.update_(4, seq_lens=seq, req_pool_indices=torch.arange(4),
                                  req_to_token=token_table(bt, 4))
        assert_same_bytes(ref, want, pool, u(), host_ints=False)
        seq.copy_(torch.tensor([9, 3, 64, 100]))
        bt.copy_(make_block_table(cfg, rng, cfg.max_pages))


def _bad_block_tables(pool: BufferPool, bt: Tensor) -> list[tuple[str, dict[str, Any], str]]:
    cfg = pool.cfg
    k = bt.numel() * bt.element_size()
    alias = pool.arena.storage[256 : 256 + k].view(bt.dtype).view(bt.shape)
    alias.copy_(bt)  # (the bytes the test compares are taken after this)
    table = {"req_to_token": None}
    return [
        ("float", {**table, "block_table": bt.float()}, "dtype"),
        ("bool", {**table, "block_table": bt != 0}, "dtype"),
        ("too narrow", {**table, "block_table": bt[:, : cfg.max_pages - 1]},
         rf"block_table must have >= max_pages={cfg.max_pages} columns"),
        ("1-D", {**table, "block_table": bt[0]}, "2 dim"),
        ("columns strided", {**table, "block_table": bt.t().contiguous().t()}, "contiguous"),
        ("a list", {**table, "block_table": bt.tolist()}, "torch.Tensor"),
        ("on meta", {**table, "block_table": bt.to("meta")}, "must be on"),
        ("aliases the arena", {**table, "block_table": alias}, "alias"),
        ("both tables", {"block_table": bt}, "exactly one request table.*got both"),
        ("neither table", {**table, "block_table": None}, "exactly one request table.*neither"),
        ("req_to_token without req_pool_indices", {"req_pool_indices": None},
         "req_pool_indices is required with req_to_token"),
        ("too few rows for the batch", {**table, "req_pool_indices": None,
                                        "block_table": bt[:1]}, r"block_table without"),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bad_block_tables_raise_before_any_write(variant: str, impl: Impl) -> None:
    cfg = config(variant, Layout.BOTH if VARIANTS[variant][1] > 1 else Layout.FLASH_ATTN, 4, impl)
    pool = BufferPool(cfg, poison=True)
    rng = random.Random(3)
    bt = make_block_table(cfg, rng, cfg.max_pages)
    call = make_call(pool, variant, rng, token_table(bt, 4), min_rows=2)  # more rows than bt[:1]
    for what, override, match in _bad_block_tables(pool, bt):
        before = pool.arena.storage.clone()
        with pytest.raises(PoolError, match=match):
            update(pool, call, **override)
        assert torch.equal(before, pool.arena.storage), what  # uint8 storage: a byte compare


@pytest.mark.parametrize("impl", IMPLS)
def test_validation_mode_checks_rows_against_the_block_table(impl: Impl) -> None:
    cfg = config("decode", Layout.FLASH_ATTN, 16, impl)
    pool = BufferPool(cfg, poison=True, validate=True)
    bt = make_block_table(cfg, random.Random(2), cfg.max_pages)[:5]
    seq = torch.tensor([3, 40, 9])
    ok = pool.decode.update_(4, seq_lens=seq, req_pool_indices=torch.tensor([4, 0, 2]),
                             block_table=bt)
    pool.check(ok)
    before = pool.arena.storage.clone()
    with pytest.raises(CapacityError, match=r"req_pool_indices\[1\] must be in \[0, 4\], got 5"):
        pool.decode.update_(4, seq_lens=seq, req_pool_indices=torch.tensor([4, 5, 2]),
                            block_table=bt)
    with pytest.raises(InputError, match="exactly one request table"):
        pool.decode.update_(4, seq_lens=seq, req_pool_indices=torch.tensor([4, 0, 2]))
    assert torch.equal(before, pool.arena.storage)

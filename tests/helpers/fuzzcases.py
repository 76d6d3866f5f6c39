"""Generators for the adversarial suite (tests/core/test_fuzz.py): random pools, valid phase calls with
their loop-reference oracle, and mutations that turn a valid call into a bad one.

A *call* is a phase name plus the keyword arguments of its ``update_``; every phase takes them as
keywords, so a mutation can replace any one argument without knowing the phase's order.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnpool import BufferPool, Impl, Layout, Phase, PoolConfig

from tests.helpers.batches import make_table, tree_mask
from tests.helpers.loopref import (
    PagedRows,
    assert_paged_equal,
    cross_rows,
    decode_rows,
    decoder_rows,
    draft_tree_rows,
    local_rows,
    tree_expand_rows,
)

C = 128  # max_context_len of every fuzzed pool
ND = 4  # num_draft_tokens
STEPS = 3  # spec_steps
MAX_ENC = 32  # max_encoder_len
PAD_LEN, PAD_PAGE = 3, 2
PHASES = ("decode", "verify", "draft", "draft_extend", "encoder", "local")


def make_pool(rng: random.Random, impl: Impl, *, page: int | None = None,
              layout: Layout | None = None, topk: int | None = None) -> BufferPool:
    """A poisoned pool with every phase; page size, layout and tree shape drawn from ``rng``."""
    page = page or rng.choice([1, 4, 16])
    topk = topk or rng.choice([1, 2])
    layout = layout or rng.choice([Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH])
    if topk == 1:  # chain drafts share one 2-D page table (config rule)
        layout |= Layout.FLASH_ATTN
    chunk = max(8, page) * rng.choice([1, 2])
    cfg = PoolConfig(max_bs=6, max_context_len=C, page_size=page, device="cpu", layout=layout,
                     num_draft_tokens=ND, topk=topk, spec_steps=STEPS, max_encoder_len=MAX_ENC,
                     attention_chunk_size=chunk, pad_seq_len=PAD_LEN, pad_page=PAD_PAGE,
                     num_pages=(2 * 6 + 1) * (-(-C // page)) + 1, impl=impl)
    return BufferPool(cfg, poison=True)


@dataclass
class Call:
    """One valid ``pool.<phase>.update_(bs, **kwargs)`` and the oracle of its view."""

    phase: str
    bs: int
    kwargs: dict[str, Any]
    oracle: Callable[[object], None]
    host: dict[str, list[int]] = field(default_factory=dict)


def _rows_check(exp: PagedRows, real_q_only: bool = False) -> Callable[[object], None]:
    def check(view: object) -> None:
        if real_q_only:
            # padded rows' query counts are a layout choice of the phase; real rows are not
            cu = view.cu_seqlens_q.tolist()  # type: ignore[attr-defined]
            got = [cu[i + 1] - cu[i] for i in range(exp.real)]
            assert got == exp.q_lens[: exp.real]
            assert all(a <= b for a, b in itertools.pairwise(cu))
            exp.q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        assert_paged_equal(view, exp)
    return check


def valid_call(pool: BufferPool, phase: str, rng: random.Random, *, host: bool | None = None,
               table: Tensor | None = None) -> Call:
    """A random in-contract call of ``phase`` (its own requests, lengths at the edges too)."""
    cfg = pool.cfg
    page, topk = cfg.page_size, cfg.topk
    bs = rng.randint(1, cfg.max_bs)
    n = rng.randint(0, bs)
    if table is None:
        table = make_table(cfg, 2 * cfg.max_bs + 1, rng)
    slots = rng.sample(range(table.shape[0]), n)
    use_host = rng.random() < 0.5 if host is None else host
    extra = {"decode": 0, "verify": ND, "draft": STEPS, "draft_extend": 0,
             "encoder": MAX_ENC, "local": ND}[phase]
    hi = C - extra
    lens = [rng.choice([1, hi, rng.randint(1, hi)]) for _ in range(n)]
    i64 = torch.int64 if rng.random() < 0.5 else torch.int32
    kw: dict[str, Any] = {
        "seq_lens": torch.tensor(lens, dtype=i64),
        "req_pool_indices": torch.tensor(slots, dtype=i64),
        "req_to_token": table,
    }
    hosts: dict[str, list[int]] = {}
    if use_host:
        kw["seq_lens_cpu"] = hosts["seq_lens_cpu"] = list(lens)
    tab = table
    if phase == "decode":
        oracle = _rows_check(decode_rows(lens, slots, tab, bs, page, PAD_LEN, PAD_PAGE))
    elif phase == "verify":
        if topk > 1:
            mask = tree_mask(n, ND, rng)
            kw["tree_mask"] = mask
            pre = decode_rows(lens, slots, tab, bs, page, PAD_LEN, PAD_PAGE, q_len=ND)
            exp = tree_expand_rows(lens, slots, tab, mask, bs, ND, PAD_LEN, PAD_PAGE * page)

            def oracle(v: object) -> None:
                assert_paged_equal(v.prefix, pre)  # type: ignore[attr-defined]
                assert_paged_equal(v.expand, exp)  # type: ignore[attr-defined]
        else:
            oracle = _rows_check(decode_rows(lens, slots, tab, bs, page, PAD_LEN, PAD_PAGE,
                                             extra=ND, q_len=ND))
            oracle = _prefix(oracle)
    elif phase == "draft":
        loc = None
        if topk > 1:
            top = (cfg.num_pages or 2) * page  # raw token slots inside the cache
            loc = torch.tensor([[[rng.randrange(page, top) for _ in range(topk)]
                                 for _ in range(STEPS)] for _ in range(n)],
                               dtype=torch.int64).view(n, STEPS, topk)
            kw["out_cache_loc"] = loc
        oracle = _draft_oracle(lens, slots, tab, bs, page, topk, loc)
    elif phase == "draft_extend":
        acc = [rng.randint(1, min(ND, s)) for s in lens]
        kw["accept_lens"] = torch.tensor(acc, dtype=i64)
        if use_host:
            kw["accept_lens_cpu"] = hosts["accept_lens_cpu"] = list(acc)
        exp = decode_rows(lens, slots, tab, bs, page, PAD_LEN, PAD_PAGE)
        exp.q_lens = acc + [1] * (bs - n)
        oracle = _rows_check(exp, real_q_only=True)
    elif phase == "encoder":
        enc = [rng.choice([1, MAX_ENC, rng.randint(1, MAX_ENC)]) for _ in range(n)]
        kw["encoder_lens"] = torch.tensor(enc, dtype=i64)
        if use_host:
            kw["encoder_lens_cpu"] = hosts["encoder_lens_cpu"] = list(enc)
        cross = cross_rows(enc, slots, tab, bs, page, MAX_ENC, PAD_LEN, PAD_PAGE)
        dec = decoder_rows(lens, enc, slots, tab, bs, page, PAD_LEN, PAD_PAGE)

        def oracle(v: object) -> None:
            assert_paged_equal(v.cross, cross)  # type: ignore[attr-defined]
            assert_paged_equal(v.decoder, dec)  # type: ignore[attr-defined]
    else:
        verify = rng.random() < 0.5
        kw["for_phase"] = Phase.VERIFY if verify else Phase.DECODE
        q = ND if verify else 1
        kv = [s + (ND if verify else 0) for s in lens]
        chunk = cfg.attention_chunk_size or 1

        def oracle(v: object) -> None:
            per = v.rows_per_request  # type: ignore[attr-defined]
            assert_paged_equal(v, local_rows(kv, slots, tab, bs, page, chunk, q, per,
                                             PAD_LEN, PAD_PAGE))
    return Call(phase, bs, kw, oracle, hosts)


def _prefix(check: Callable[[object], None]) -> Callable[[object], None]:
    return lambda v: check(v.prefix)  # type: ignore[attr-defined]


def _draft_oracle(lens: list[int], slots: list[int], tab: Tensor, bs: int, page: int, topk: int,
                  loc: Tensor | None) -> Callable[[object], None]:
    def check(v: object) -> None:
        for d, sv in enumerate(v.steps, start=1):  # type: ignore[attr-defined]
            if loc is None:
                assert_paged_equal(sv.prefix, decode_rows(lens, slots, tab, bs, page, PAD_LEN,
                                                          PAD_PAGE, extra=d))
            else:
                pre, exp = draft_tree_rows(lens, slots, tab, loc, bs, page, topk, d, PAD_LEN,
                                           PAD_PAGE)
                assert_paged_equal(sv.prefix, pre)
                assert_paged_equal(sv.expand, exp)
    return check


def run(pool: BufferPool, call: Call, **override: Any) -> object:
    kw = {**call.kwargs, **override}
    bs = kw.pop("bs", call.bs)
    return getattr(pool, call.phase).update_(bs, **kw)


# ---- mutations: each returns overrides that make a valid call invalid -----------------------------
def _tensor_args(call: Call) -> list[str]:
    return [k for k, v in call.kwargs.items() if isinstance(v, Tensor)]


def _strided(t: Tensor) -> Tensor:
    """The same values with stride 2 in dim 0 (1-D) or a transposed table (2-D)."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    return t.repeat_interleave(2, dim=0)[::2]


def mutations(pool: BufferPool, call: Call, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    """Every bad variant of ``call`` this generator knows (the test samples from them)."""
    cfg = pool.cfg
    out: list[tuple[str, dict[str, Any]]] = [
        ("bs=True", {"bs": True}),
        ("bs=False", {"bs": False}),
        ("bs float", {"bs": float(call.bs)}),
        ("bs=0", {"bs": 0}),
        ("bs > max_bs", {"bs": cfg.max_bs + 1}),
    ]
    n = call.kwargs["seq_lens"].shape[0]
    if n >= 2:
        out.append(("n > bs", {"bs": n - 1}))
    for name in _tensor_args(call):
        t: Tensor = call.kwargs[name]
        out.append((f"{name} as list", {name: t.tolist()}))
        out.append((f"{name} on meta", {name: t.to("meta")}))
        out.append((f"{name} with an extra dim", {name: t[None]}))
        bad_dtype = torch.float32 if t.dtype == torch.bool else torch.bool
        if name == "tree_mask":
            bad_dtype = torch.int32
        out.append((f"{name} as {bad_dtype}", {name: t.to(bad_dtype)}))
        if name != "req_to_token":
            out.append((f"{name} with a row more", {name: torch.cat([t, t[:1]]) if n else
                                                     torch.zeros((1, *t.shape[1:]), dtype=t.dtype)}))
        if name == "req_to_token":
            out.append(("req_to_token too narrow", {name: t[:, : cfg.max_context_len - 1]}))
            out.append(("req_to_token transposed", {name: _strided(t)}))
        elif n >= 2 and t.dim() == 1:
            out.append((f"{name} strided", {name: _strided(t)}))
        if t.dim() == 1 and t.shape[0]:
            # a slice of the pool's own arena with the right shape and dtype: aliasing
            arena = pool.arena.storage
            k = t.shape[0] * t.element_size()
            alias = arena[64 : 64 + k].view(t.dtype)
            alias.copy_(t)  # (the bytes compared by the test are taken after this)
            out.append((f"{name} aliases the arena", {name: alias}))
    for name, vals in call.host.items():
        lo_hi_bad = [0, -1, cfg.max_context_len + 1]
        if vals:
            i = rng.randrange(len(vals))
            wild = [*vals[:i], rng.choice(lo_hi_bad), *vals[i + 1:]]
            out.append((f"{name} out of range", {name: wild}))
            out.append((f"{name} float", {name: [float(x) + 0.5 for x in vals]}))
            out.append((f"{name} bool", {name: [True] * len(vals)}))
            out.append((f"{name} None", {name: [None] * len(vals)}))
            out.append((f"{name} str", {name: ["x"] * len(vals)}))
            out.append((f"{name} float tensor", {name: torch.tensor(vals, dtype=torch.float32)}))
        out.append((f"{name} count", {name: [*vals, 1]}))
        out.append((f"{name} not a sequence", {name: 7}))
    if call.phase == "draft_extend" and "accept_lens_cpu" in call.host and n:
        acc, seq = call.host["accept_lens_cpu"], call.host["seq_lens_cpu"]
        if any(s < ND for s in seq):
            i = next(i for i, s in enumerate(seq) if s < ND)
            acc2 = list(acc)
            acc2[i] = seq[i] + 1
            out.append(("accept_lens_cpu > seq_lens_cpu", {"accept_lens_cpu": acc2}))
    if "tree_mask" in call.kwargs:
        out.append(("tree_mask missing", {"tree_mask": None}))
    elif call.phase == "verify":
        out.append(("tree_mask on a chain", {"tree_mask": torch.ones(n, ND, ND, dtype=torch.bool)}))
    return out

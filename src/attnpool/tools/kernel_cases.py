"""The configs ``attnpool kernels`` updates real pools over, to record every launch they make.

A kernel specialization is decided by the launch the update wrappers assemble, so the matrix
varies what an engine can vary, and the wrappers decide the rest (constexprs, block sizes, warps):

* every phase part (decode, verify chain and tree, draft chain and tree, draft extend, extend,
  encoder, local attention for decode and for verify), every :class:`~attnpool.Layout`, page
  sizes 1, 16 and 4 (to Triton: a constant, a multiple of 16, neither), ``req_to_token`` and
  ``block_table`` (with and without ``req_pool_indices``), a sliding window (with the request
  table or a table of its own, extend's window slots), capturable (``num_real``) or not,
  incremental decode (``request_ids`` twice) or not, bound updates; caller tensors int64
  (tables int32), and once all int32 and all int64;
* sizes: a small batch, and for the heaviest flags of each part the largest block of each warp
  count the wrappers pick (:func:`tiers`, up to :data:`MAX_ROWS` rows), with page tables wide
  enough for the widest page loop and a large draft tree (:data:`MAX_TREE_TOKENS` tokens);
* FlashMLA's scheduler part (``PoolConfig(flashmla=...)``): decode and verify, eager and
  capturable, int32 and int64 caller tensors, and a batch per warp count;
* the KV store: every cache dtype (float16, bfloat16, float32, fp8 e4m3 / e5m2 from each model
  dtype, per-tensor and per-head scales), MHA (one and many heads, K and V of different head
  sizes) and MLA (with and without the rope part), NHD and HND, page sizes 1, 16 and 12, the
  pool's int64 slots and caller int32 ones.

The launches are recorded, not run (:class:`~attnpool.tools.kernels.Recorder` with ``dry_run``),
so the input values only need to pass the host checks: sizes can be those of large engines.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from ..config import ceil_div

if TYPE_CHECKING:
    from ..pool import BufferPool


class Recorder(Protocol):
    """What the matrix needs of :class:`attnpool.tools.kernels.Recorder` (installed by the
    caller; not imported here, which would make the two modules import each other)."""

    case: str


#: Largest batch rows (programs of one launch) the size tiers sample: past the widest scan
#: block, so the programs loop over several chunks (:func:`tiers`).
MAX_ROWS = 16384
#: Draft tokens of the large tree: its expand kernel tiles an ``N x N`` mask block per request.
MAX_TREE_TOKENS = 128
I32, I64 = torch.int32, torch.int64


@contextmanager
def _interpreted() -> Iterator[None]:
    """Fused pools on the CPU need ``TRITON_INTERPRET=1`` (``attnpool.config.triton_usable``);
    nothing runs here, the launches are only assembled."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def tiers() -> list[int]:
    """Row counts up to MAX_ROWS, the largest of each kind of program the wrappers pick: its
    warp count and whether its scan takes one chunk or loops over several (the widest block,
    ``MAX_BLOCK`` rows, in one pass; MAX_ROWS rows in many). Smaller blocks hold fewer values
    per thread than the widest."""
    from ..update.triton.tuning import scan_block, warps

    top: dict[tuple[int, bool], int] = {}
    rows = 16
    while rows <= MAX_ROWS:
        top[(warps(rows), rows > scan_block(rows))] = rows
        rows *= 2
    return sorted(top.values())


def _pool(**kw: Any) -> BufferPool:
    from ..config import Impl, PoolConfig
    from ..pool import BufferPool

    return BufferPool(PoolConfig(device="cpu", impl=Impl.TRITON, **kw))


def _t(shape: tuple[int, ...] | int, dtype: torch.dtype, value: int = 1) -> Tensor:
    return torch.full((shape,) if isinstance(shape, int) else shape, value, dtype=dtype)


class _Batch:
    """The inputs of one update: ``rows`` real rows (``bs`` when capturable), ``dt`` for the
    caller's int tensors and ``tdt`` for its tables; ``block``: a block table."""

    def __init__(self, pool: BufferPool, bs: int, *, cap: bool, block: bool,
                 req_pool_indices: bool = True, dt: torch.dtype = I64, tdt: torch.dtype = I32,
                 own_window: bool = False) -> None:
        cfg = pool.cfg
        self.cfg, self.bs, self.dt = cfg, bs, dt
        self.rows = bs if cap else max(1, bs - 1)
        # a few table rows (not 1, which Triton would specialize on), or one per row without
        # req_pool_indices
        trows = 5 if req_pool_indices else bs
        width = cfg.max_context_len if not block else ceil_div(cfg.max_context_len, cfg.page_size)
        name = "block_table" if block else "req_to_token"
        self.common: dict[str, Any] = {"seq_lens": _t(self.rows, dt), name: _t((trows, width), tdt)}
        if req_pool_indices:
            self.common["req_pool_indices"] = _t(self.rows, dt, 0)
        if cap:
            self.common["num_real"] = _t(1, dt, self.rows)
        self.window: dict[str, Any] = {}
        if cfg.sliding_window is not None and own_window:
            self.window["window_" + name] = _t((trows, width), tdt)

    def args(self, phase: str) -> dict[str, Any]:
        """Keyword inputs of ``phase``'s update_."""
        cfg, m, dt = self.cfg, self.rows, self.dt
        kw = dict(self.common)
        if phase in ("decode", "verify", "draft", "draft_extend", "extend"):
            kw.update(self.window)
        if phase == "verify" and cfg.topk > 1:
            n = cfg.num_draft_tokens
            kw["tree_mask"] = torch.ones((m, n, n), dtype=torch.bool)
        elif phase == "draft" and cfg.topk > 1:
            kw["out_cache_loc"] = _t((m, cfg.spec_steps, cfg.topk), dt)
        elif phase == "draft_extend":
            kw["accept_lens"] = _t(m, dt)
        elif phase == "extend":
            kw["extend_lens"] = _t(m, dt)
        elif phase == "encoder":
            kw["encoder_lens"] = _t(m, dt)
        return kw


def _update(rec: Recorder, pool: BufferPool, b: _Batch, label: str, bound: bool = False,
            slots: bool = True, only: tuple[str, ...] = ()) -> None:
    """Every phase part of ``pool`` (or those named in ``only``) once with batch ``b`` (extend
    with and without its slot outputs, local for decode and for verify, decode also
    incrementally unless bound)."""
    from ..config import Phase

    cfg, bs = pool.cfg, b.bs
    for phase in cfg.phases:
        if only and phase.value not in only:
            continue
        ph: Any = pool.phase(phase)  # (each phase's update_ takes its own inputs)
        kw = b.args(phase.value)
        rec.case = f"{phase.value}: {label}"
        calls: list[dict[str, Any]] = [kw]
        if phase is Phase.EXTEND and slots:
            more = {"out_slots": _t(cfg.max_extend_tokens, I64, -1)}
            if cfg.sliding_window is not None:
                more["window_out_slots"] = _t(cfg.max_extend_tokens, I64, -1)
            calls.append({**kw, **more})
        if phase is Phase.LOCAL and cfg.num_draft_tokens:
            calls.append({**kw, "for_phase": Phase.VERIFY})
        for c in calls:
            if bound:
                ph.bind(bs, **c)()
            else:
                ph.update_(bs, **c)
        if phase is Phase.DECODE and not bound and "num_real" not in kw:
            ids = list(range(b.rows))  # (host ids: not with num_real)
            rec.case = f"decode: incremental {label}"
            ph.update_(bs, request_ids=ids, **kw)
            ph.update_(bs, request_ids=ids, **kw)  # the second keeps the rows' old pages


#: speculative shapes: a chain (with and without a sliding window) and a tree
_SHAPES: tuple[dict[str, Any], ...] = (
    {"num_draft_tokens": 3, "spec_steps": 3},
    {"num_draft_tokens": 3, "spec_steps": 3, "sliding_window": 40},
    {"num_draft_tokens": 4, "topk": 2, "spec_steps": 2},
)


def _small(rec: Recorder) -> None:
    """Every flag combination at a small batch (bs 3, 256-token context)."""
    from ..config import Layout

    for layout, page, shape, block in itertools.product(
            (Layout.FLASH_ATTN, Layout.FLASHINFER, Layout.BOTH), (1, 16), _SHAPES, (False, True)):
        if layout is Layout.FLASHINFER and shape.get("topk", 1) == 1:
            shape = {**shape, "spec_steps": 0}  # chain drafts share a page table: FLASH_ATTN only
        pool = _pool(max_bs=4, max_context_len=256, page_size=page, layout=layout,
                     max_encoder_len=32, attention_chunk_size=64, max_extend_tokens=64, **shape)
        win = "window " if "sliding_window" in shape else ""
        tree = "tree" if shape.get("topk", 1) > 1 else "chain"
        table = "block_table" if block else "req_to_token"
        for cap in (False, True):
            label = f"{layout.name} P={page} {tree} {win}{table}{' num_real' if cap else ''}"
            _update(rec, pool, _Batch(pool, 3, cap=cap, block=block), label)
        label = f"{layout.name} P={page} {tree} {win}{table} bound"
        _update(rec, pool, _Batch(pool, 3, cap=True, block=block), label, bound=True)
        if layout is not Layout.BOTH or page == 1:
            continue  # (what follows changes argument types and values, not flags)
        if block:  # a block table's rows may stand for the batch order (no req_pool_indices)
            _update(rec, pool, _Batch(pool, 3, cap=False, block=True, req_pool_indices=False),
                    f"{layout.name} P={page} {tree} {win}block_table without req_pool_indices")
        if win:
            _update(rec, pool, _Batch(pool, 3, cap=True, block=block, own_window=True),
                    f"{layout.name} P={page} {tree} {win}{table} own window table num_real")


def _widths(rec: Recorder) -> None:
    """Caller tensors all int32 (capturable, ``req_to_token``) and all int64 (a block table),
    tables included, with page size 4 (neither 1 nor a multiple of 16: the page-size values
    Triton specializes on differently)."""
    from ..config import Layout

    for shape, dt in itertools.product(_SHAPES[1:], (I32, I64)):
        pool = _pool(max_bs=4, max_context_len=256, page_size=4, layout=Layout.BOTH,
                     max_encoder_len=32, attention_chunk_size=64, max_extend_tokens=64, **shape)
        b = _Batch(pool, 3, cap=dt == I32, block=dt == I64, dt=dt, tdt=dt)
        name = "chain window" if "sliding_window" in shape else "tree"
        _update(rec, pool, b, f"BOTH P=4 {name} all {str(dt).removeprefix('torch.')}")
        out = {"out_slots": _t(64, I32, -1)}
        if "sliding_window" in shape:
            out["window_out_slots"] = _t(64, I32, -1)
        rec.case = f"extend: BOTH P=4 {name} int32 out_slots"
        pool.extend.update_(3, **_Batch(pool, 3, cap=False, block=False).args("extend"), **out)


def _large(rec: Recorder) -> None:
    """The heaviest flags of each part at the largest block of each warp count: layouts BOTH,
    block table, capturable, incremental decode, a sliding window, 1024-page tables."""
    from ..config import Layout
    from ..specs import local_rows_per_request

    big = {"page_size": 16, "max_context_len": 16 * 1024, "layout": Layout.BOTH}
    for rows in tiers():
        pool = _pool(max_bs=rows, max_encoder_len=64, max_extend_tokens=rows,
                     **_SHAPES[1], **big)
        for cap in (True, False):  # incremental decode is not capturable
            _update(rec, pool, _Batch(pool, rows, cap=cap, block=True), f"{rows} rows",
                    slots=False, only=("decode",) if not cap else ())
        rec.case = f"extend: {rows} rows with out_slots"
        b = _Batch(pool, rows, cap=True, block=True)
        pool.extend.update_(rows, out_slots=_t(rows, I64), window_out_slots=_t(rows, I64),
                            **b.args("extend"))
        del pool
        tree = _SHAPES[2]
        pool = _pool(max_bs=rows // tree["topk"], **tree, **big)  # draft expand: bs * K rows
        _update(rec, pool, _Batch(pool, rows // tree["topk"], cap=True, block=True),
                f"tree, {rows} expand rows", only=("verify", "draft"))
        del pool
        local = {"num_draft_tokens": 3, "attention_chunk_size": 2048}
        probe = _pool(max_bs=1, **local, **big)
        per = local_rows_per_request(probe.cfg)
        bs = rows // per  # local: bs * rows_per_request rows
        pool = _pool(max_bs=bs, **local, **big)
        _update(rec, pool, _Batch(pool, bs, cap=True, block=True), f"{bs} requests",
                only=("local",))
        del pool
    # large draft trees: the verify expand kernel's mask tiles grow with N (8 warps up to 64
    # tokens, 16 past them: one tree of each)
    for n in (MAX_TREE_TOKENS // 2, MAX_TREE_TOKENS):
        pool = _pool(max_bs=4, num_draft_tokens=n, topk=8, spec_steps=8, **big)
        _update(rec, pool, _Batch(pool, 4, cap=True, block=True), f"tree N={n}",
                only=("verify", "draft"))


def _flashmla(rec: Recorder) -> None:
    """FlashMLA's scheduler part (decode and verify, page size 64) in each row layout: eager and
    capturable, caller tensors int32 and int64, bound; then one batch per warp count its
    wrapper picks (the prefix-sum vector holds every row)."""
    from ..config import FlashMLAConfig, SchedLayout

    for layout in SchedLayout:
        tag = "" if layout is SchedLayout.ARGUMENTS else " struct"
        mla = {"page_size": 64, "num_draft_tokens": 3,
               "flashmla": FlashMLAConfig(num_sms=132, num_heads_q=128, layout=layout)}
        pool = _pool(max_bs=4, max_context_len=1024, **mla)
        for dt, cap in itertools.product((I32, I64), (False, True)):
            label = f"flashmla{tag} {str(dt).removeprefix('torch.')}{' num_real' if cap else ''}"
            _update(rec, pool, _Batch(pool, 3, cap=cap, block=True, dt=dt, tdt=dt), label,
                    only=("decode", "verify"))
        _update(rec, pool, _Batch(pool, 3, cap=True, block=True), f"flashmla{tag} bound",
                bound=True, only=("decode", "verify"))
        del pool
        for rows in (2048, 4096):  # (FLASHMLA_MAX_BS)
            pool = _pool(max_bs=rows, max_context_len=1024, **mla)
            _update(rec, pool, _Batch(pool, rows, cap=True, block=True),
                    f"flashmla{tag} {rows} rows", only=("decode",))
            del pool


def _kv(rec: Recorder) -> None:
    """Every store the KV pool launches: each cache dtype from each source dtype it accepts, for
    each kind and page size (NHD, the pool's int64 slots, one scale); then, for a float16 and an
    fp8 cache, HND, caller int32 slots, per-head scales and K / V of different head sizes."""
    from ..kv import KVKind, KVLayout

    kinds: tuple[dict[str, Any], ...] = (
        {"kind": KVKind.MHA, "num_kv_heads": 8, "head_dim": 128},
        {"kind": KVKind.MHA, "num_kv_heads": 1, "head_dim": 64},
        {"kind": KVKind.MLA, "kv_lora_rank": 512, "rope_dim": 64},
        {"kind": KVKind.MLA, "kv_lora_rank": 512},
    )
    dtypes = (*_MODEL, torch.float8_e4m3fn, torch.float8_e5m2)
    for dtype, kind, page in itertools.product(dtypes, kinds, (1, 16, 12)):
        _store(rec, dtype, kind, KVLayout.NHD, page, None, per_head=False)
    for dtype in (torch.float16, torch.float8_e4m3fn):
        _store(rec, dtype, kinds[0], KVLayout.HND, 16, None, per_head=False)
        _store(rec, dtype, kinds[0], KVLayout.NHD, 16, _t(3, I32, -1), per_head=True)
        for layout in KVLayout:  # K and V rows of different sizes (DeepSeek's 192 / 128)
            _store(rec, dtype, _SPLIT_KV, layout, 16, None, per_head=False)


_SPLIT_KV: dict[str, Any] = {"num_kv_heads": 8, "head_dim": 192, "head_dim_v": 128}


_MODEL = (torch.float16, torch.bfloat16, torch.float32)


def _store(rec: Recorder, dtype: torch.dtype, kind: dict[str, Any], layout: Any, page: int,
           slots: Tensor | None, per_head: bool) -> None:
    """Store 3 tokens from every source dtype the cache accepts (only fp8 caches convert)."""
    from ..config import Impl
    from ..errors import InputError
    from ..kv import KVCacheConfig, KVCachePool, KVKind
    from ..kv.quant import is_fp8

    kv = KVCachePool(KVCacheConfig(num_pages=4, page_size=page, max_tokens=8, dtype=dtype,
                                   layout=layout, device="cpu", **kind))
    heads, cfg = kv.cfg.num_kv_heads, kv.cfg
    sc = torch.ones(heads if per_head else 1) if is_fp8(dtype) else None
    for src in _MODEL:
        rec.case = (f"store: {cfg.kind.name} h={heads} {dtype} from {src} {layout.name} P={page}"
                    f"{' int32 slots' if slots is not None else ''}"
                    f"{' per-head scales' if per_head else ''}")
        try:
            if cfg.kind is KVKind.MHA:
                x = torch.zeros((3, heads, cfg.head_dim), dtype=src)  # ok: tool inputs, once per case
                v = torch.zeros((3, heads, cfg.head_dim_v or 0), dtype=src)  # ok: tool inputs
                kv.store_kv_(0, x, v, slots, k_scale=sc, v_scale=sc, impl=Impl.TRITON)
            else:
                lat = torch.zeros((3, cfg.kv_lora_rank), dtype=src)  # ok: tool inputs
                rope = torch.zeros((3, cfg.rope_dim), dtype=src) if cfg.rope_dim else None  # ok: tool
                kv.store_mla_(0, lat, rope, slots, scale=sc, impl=Impl.TRITON)
        except InputError:
            continue  # a source dtype this cache refuses


def run_matrix(rec: Recorder) -> None:
    """Update pools over the whole matrix with ``rec`` installed (the caller's job)."""
    with _interpreted():
        _small(rec)
        _widths(rec)
        _large(rec)
        _flashmla(rec)
        _kv(rec)

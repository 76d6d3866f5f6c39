"""Every fused-kernel specialization the pools launch compiles for sm_90 without spilling, on a
machine without a GPU (the triton wheel's own compiler; ``attnpool kernels``), and no launch can
escape that check: what real pools launch in the interpreter must be in the enumeration (here for
a few updates, and for the whole pytest run in conftest.py).

The enumeration is compiled once per pytest run (a few minutes on 2 cores): every test that needs
the results shares the module fixture, and :func:`attnpool.tools.kernels.compile_specs` keeps them
for the life of the process.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from attnpool.errors import InputError
from attnpool.tools import kernels as K

ROOT = pathlib.Path(__file__).resolve().parents[3]
TARGET = "sm_90"
I32, I64 = torch.int32, torch.int64


@pytest.fixture(scope="module")
def compiled() -> list[K.Result]:
    return K.compile_specs(K.enumerate_specs(TARGET), TARGET)


def _where(r: K.Result) -> str:
    return f"{r.spec.name} [{r.case}] {r.spec.label()}"


@pytest.mark.triton
def test_every_specialization_compiles(compiled: list[K.Result]) -> None:
    failed = [f"{_where(r)}: {r.error}" for r in compiled if r.error]
    assert not failed, "\n".join(failed)
    assert all(r.regs > 0 and r.cubin > 0 for r in compiled)


@pytest.mark.triton
def test_no_specialization_spills(compiled: list[K.Result]) -> None:
    """0 spill bytes everywhere, the largest parts included: each program's prefix sums loop
    over the batch in fixed-size chunks, and every update launch gives ptxas a ``maxnreg``
    (update.triton.kernels' docstring says why both are needed)."""
    spilled = [f"{_where(r)}: {r.spec.num_warps} warps, {r.regs} registers, spills "
               f"{r.spill_stores} B stored / {r.spill_loads} B loaded"
               for r in compiled if not r.error and (r.spill_stores or r.spill_loads)]
    assert not spilled, f"{len(spilled)} specializations spill:\n" + "\n".join(spilled)


@pytest.mark.triton
def test_registers_do_not_grow_with_the_batch(compiled: list[K.Result]) -> None:
    """The largest parts (16384 rows) use one scan step of ``MAX_BLOCK`` rows, like a part of
    ``MAX_BLOCK`` rows: the block is capped and the warp count is one for every size. FlashMLA's
    scheduler is one program over every row instead, so its rows are capped by the config
    (``FLASHMLA_MAX_BS``) and its warps (with a ``maxnreg`` that fits them) grow to hold them."""
    from attnpool.config import FLASHMLA_MAX_BS
    from attnpool.update.triton import tuning as ck

    sched = [r for r in compiled if r.spec.name == "flashmla_sched_kernel"]
    compiled = [r for r in compiled if r.spec.name != "flashmla_sched_kernel"]
    blocks = {v for r in compiled for n, k, v in r.spec.params if n == "BLOCK" and k == "constexpr"}
    assert max(blocks) == ck.MAX_BLOCK == ck.scan_block(16384)
    assert {ck.warps(rows) for rows in (1, ck.MAX_BLOCK, 16384)} == {4}
    update = [r for r in compiled if r.spec.name != "_store_kernel"]
    assert update and {r.spec.maxnreg for r in update} == {ck.MAXNREG}
    rows = {v for r in sched for n, k, v in r.spec.params if n == "BLOCK"}
    assert sched and max(rows) == FLASHMLA_MAX_BS
    assert all(r.spec.maxnreg == ck.maxnreg(r.spec.num_warps) for r in sched)


@pytest.mark.triton
def test_every_block_fits_the_register_file(compiled: list[K.Result]) -> None:
    """A block whose threads need more registers than an SM holds compiles but fails to launch
    (ptxas honours ``maxnreg`` over the block size): registers x threads <= 65536 everywhere,
    the 128-draft tree included (its mask is read in row tiles: 8 warps suffice)."""
    from attnpool.update.triton import tuning as ck

    over = [f"{_where(r)}: {r.regs} registers x {32 * r.spec.num_warps} threads"
            for r in compiled if not r.error
            and r.regs * 32 * r.spec.num_warps > ck.REGISTERS_PER_BLOCK]
    assert not over, "\n".join(over)
    assert any("tree N=128" in r.case for r in compiled)
    assert all(ck.maxnreg(w) * 32 * w <= ck.REGISTERS_PER_BLOCK for w in (1, 2, 4, 8, 16, 32))


@pytest.mark.triton
def test_enumeration_reaches_every_kernel_and_warp_count() -> None:
    from attnpool.kv import store_kernels
    from attnpool.tools.kernel_cases import tiers
    from attnpool.update.triton import draft_kernels, flashmla_kernels
    from attnpool.update.triton import loaders as ck
    from attnpool.update.triton.tuning import warps as tier_warps

    specs = K.enumerate_specs(TARGET)
    kernels = (ck.paged_kernels().paged_kernel, ck.kernels().tree_expand_kernel,
               ck.kernels().local_kernel, draft_kernels.draft_expand_kernel,
               flashmla_kernels.flashmla_sched_kernel, store_kernels._store_kernel)
    names = {f"{k.fn.__module__}:{k.fn.__qualname__}" for k in kernels}
    assert {s.kernel for s in specs} == names
    warps = {tier_warps(r) for r in tiers()}
    for name in ("paged_kernel", "local_kernel", "draft_expand_kernel"):
        assert {s.num_warps for s in specs if s.name == name} == warps, name
    assert {s.num_warps for s in specs if s.name == "flashmla_sched_kernel"} == {4, 8}
    # page sizes 1 (a constant to Triton), 16 (divisible by 16) and 4 (neither) all reach the
    # paged kernel; the store's constexpr page size is 1, 16 and 12
    kinds = {(k, v) for s in specs if s.name == "paged_kernel" for n, k, v in s.params if n == "P"}
    assert {k if k == "one" else v for k, v in kinds} == {"one", "D", ""}
    store = {v for s in specs if s.name == "_store_kernel" for n, _, v in s.params
             if n == "PAGE_SIZE"}
    assert store == {1, 16, 12}


#: test_fused_phases' property tests: every phase part, fused and reference path compared
#: with torch.equal on their read regions
_FUSED = ("test_decode", "test_verify", "test_draft", "test_draft_extend", "test_encoder",
          "test_local", "test_extend")


@pytest.mark.triton
@pytest.mark.parametrize("name", _FUSED)
def test_chunked_scan_writes_the_same_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the scan step cut to 4 rows, the parts of those tests (up to 6 rows; a local or
    draft expand part more) take several steps per program: the running sums must still write
    exactly what the reference path writes. (The wrappers read ``MAX_BLOCK`` per launch they
    assemble, and each test builds its own pools.)"""
    from attnpool.update.triton import tuning as ck

    from tests.update import test_fused_phases as fused

    monkeypatch.setattr(ck, "MAX_BLOCK", 4)
    getattr(fused, name)()


@pytest.mark.triton
@pytest.mark.parametrize("phase", ["decode", "verify", "draft", "draft_extend", "extend"])
def test_chunked_scan_writes_the_same_window_bytes(phase: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for window parts (programs ``bs..2bs-1`` of the paged kernel scan the batch
    again, for the window lengths), with 5 rows in steps of 4."""
    from attnpool import Layout
    from attnpool.update.triton import tuning as ck

    from tests.phases import test_window

    monkeypatch.setattr(ck, "MAX_BLOCK", 4)
    test_window.test_both_paths_write_the_same_window_bytes(phase, Layout.BOTH)


def _small_pool_updates() -> None:
    """Real interpret-mode updates of a small pool and KV cache (the kernels run)."""
    from attnpool import BufferPool, Impl, KVCacheConfig, KVCachePool, Layout, PoolConfig

    pool = BufferPool(PoolConfig(max_bs=4, max_context_len=64, page_size=4, layout=Layout.BOTH,
                                 num_draft_tokens=2, spec_steps=2, max_extend_tokens=16,
                                 device="cpu", impl=Impl.TRITON))
    seq, rpi = torch.tensor([5, 9], dtype=I64), torch.tensor([0, 1], dtype=I64)
    table = torch.arange(2 * 64, dtype=I32).reshape(2, 64)
    pool.decode.update_(3, seq_lens=seq, req_pool_indices=rpi, req_to_token=table)
    pad = torch.tensor([5, 9, 1], dtype=I64)
    pool.verify.update_(3, seq_lens=pad, req_pool_indices=pad * 0, req_to_token=table,
                        num_real=torch.tensor([2]))
    pool.draft.update_(3, seq_lens=seq, block_table=table[:, :16])
    pool.extend.update_(3, seq_lens=seq, extend_lens=torch.tensor([2, 3]), req_pool_indices=rpi,
                        req_to_token=table)
    kv = KVCachePool(KVCacheConfig(num_pages=8, page_size=4, max_tokens=8, num_kv_heads=2,
                                   head_dim=8, dtype=torch.float8_e4m3fn, device="cpu"))
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    kv.store_kv_(0, x, x, torch.tensor([4, 5, -1]), k_scale=torch.ones(1),
                 v_scale=torch.ones(1), impl=Impl.TRITON)


@pytest.mark.triton
def test_pool_launches_in_the_interpreter_are_enumerated() -> None:
    rec = K.Recorder(TARGET, pools_only=True)
    with rec.active():
        _small_pool_updates()
    assert {s.name for s in rec.specs} == {"paged_kernel", "_store_kernel"}
    assert K.missing(rec.specs, K.enumerate_specs(TARGET)) == []


@pytest.mark.triton
def test_a_launch_outside_the_enumeration_is_reported() -> None:
    """The coverage check has teeth: a flag combination no pool launches (a token offset with a
    query part and whole pages) and an argument type no pool passes (bool keep flags)."""
    from attnpool.update import triton as tu
    from attnpool.update.reference import PagedBuffers

    def bufs() -> PagedBuffers:
        return PagedBuffers(torch.zeros(4, dtype=I32), torch.zeros(5, dtype=I32),
                            torch.zeros(4, 8, dtype=I32), None, None, None)

    common = {"bs": 3, "seq_lens": torch.tensor([3, 5]), "req_pool_indices": torch.tensor([0, 1]),
              "req_to_token": torch.zeros(2, 32, dtype=I32), "extra": 0, "page_size": 4,
              "pad_seq_len": 1, "pad_page": 0}
    rec = K.Recorder(TARGET)  # every launch, a pool's or not
    with rec.active():
        tu.paged_update_(bufs(), **common, token_offset=torch.tensor([0, 1]),
                         q_lens=torch.tensor([1, 2]), cu_seqlens_q=torch.zeros(4, dtype=I32),
                         full_pages=True)
        tu.paged_update_(bufs(), **common, keep=torch.zeros(3, dtype=torch.bool))
    gaps = K.missing(rec.specs, K.enumerate_specs(TARGET))
    assert any("HAS_OFF HAS_PT HAS_Q FULL_PAGES" in g for g in gaps), gaps
    assert "paged_kernel: keep_ptr = *u1" in gaps, gaps
    assert K.Recorder(TARGET, pools_only=True).pools_only  # (those are not pool launches)


def test_stand_in_kernels_are_not_recorded() -> None:
    """A launch of something that is not a Triton kernel (``bench --host`` stubs the kernels) has
    nothing to compile: recorded as nothing, and run."""
    rec = K.Recorder(TARGET, dry_run=True)
    assert rec(object(), (1,), (1, 2), {}) is False and rec.specs == {}


@pytest.mark.triton
def test_spec_is_what_triton_specializes_on() -> None:
    """Page size 1 is a constant to Triton, 16 an int divisible by 16, 12 neither; int64 inputs
    are i64 pointers; the warps and constexprs are the wrapper's."""
    from attnpool.update import triton as tu
    from attnpool.update.reference import PagedBuffers

    rec = K.Recorder(TARGET, dry_run=True)
    with rec.active():
        for page in (1, 16, 12):
            b = PagedBuffers(torch.zeros(4, dtype=I32), torch.zeros(5, dtype=I32),
                             torch.zeros(4, 8, dtype=I32), None, None, None)
            tu.paged_update_(b, bs=3, seq_lens=torch.tensor([3, 5], dtype=I64),
                             req_pool_indices=torch.tensor([0, 1], dtype=I32),
                             req_to_token=torch.zeros(2, 96, dtype=I32), extra=0, page_size=page,
                             pad_seq_len=1, pad_page=0)
    assert len(rec.specs) == 3
    for s in rec.specs:
        p = {n: (k, v) for n, k, v in s.params}
        assert p["seq_ptr"] == ("*i64", "D") and p["rpi_ptr"][0] == "*i32"
        assert p["HAS_PT"] == ("constexpr", True) and p["HAS_FI"] == ("constexpr", False)
        assert s.num_warps == 4 and p["BLOCK"] == ("constexpr", 16)
    pages = {(k, v) for s in rec.specs for n, k, v in s.params if n == "P"}
    assert pages == {("one", 1), ("i32", "D"), ("i32", "")}


@pytest.mark.triton
def test_table_and_json(compiled: list[K.Result], tmp_path: pathlib.Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kernels.json"
    rc = K.run_cli(TARGET, json_path=str(path))  # compiled already: the results are kept
    text = capsys.readouterr().out
    main, per_kernel = text.split("\n\n")[:2]  # the table, the per-kernel table, the summary
    out = text.splitlines()
    rows = main.splitlines()[2:]
    assert len(rows) == len(compiled) == len({r.spec.label() for r in compiled})
    groups = {(r.spec.name, r.spec.num_warps) for r in compiled}
    assert len(per_kernel.splitlines()) == 2 + len(groups)
    assert sum(int(line.split("|")[3]) for line in per_kernel.splitlines()[2:]) == len(compiled)
    n = len(compiled)
    bad = [r for r in compiled if r.error or r.spill_stores or r.spill_loads]
    assert out[-1].startswith(f"**{n - sum(bool(r.error) for r in compiled)} of {n} "
                              f"specializations compiled for {TARGET}**"), out[-1]
    assert rc == (1 if bad else 0)
    data = json.loads(path.read_text())
    assert data["target"] == TARGET and len(data["results"]) == n
    top = max(compiled, key=lambda r: r.regs)
    assert f"largest register count {top.regs}" in out[-1]
    assert {"kernel", "params", "num_warps", "case", "regs", "spill_stores", "spill_loads",
            "shared", "cubin", "seconds"} <= set(data["results"][0])


def test_bad_target_is_refused() -> None:
    with pytest.raises(InputError, match="sm_80, sm_90, got 'sm_75'"):
        K.capability("sm_75")
    out = subprocess.run([sys.executable, "-m", "attnpool", "kernels", "--target", "sm_75"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "sm_75" in lines[0] and "sm_90" in lines[0], out.stderr


def test_without_triton_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests/helpers/hide_triton"), str(ROOT / "src")])
    out = subprocess.run([sys.executable, "-m", "attnpool", "kernels", "--target", "sm_90"],
                         capture_output=True, text=True, timeout=60, check=False, env=env)
    assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "`triton` extra" in lines[0], out.stderr
    assert lines[0].startswith("attnpool kernels: error:"), lines[0]

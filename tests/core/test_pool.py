"""Pool construction: one allocation, no memset, report, missing phases, lean import."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import attnpool
from attnpool import BufferPool, Layout, Phase, PoolConfig

from tests.helpers.opcount import OpRecorder

SRC = pathlib.Path(attnpool.__file__).parent


CONFIGS = [
    PoolConfig(max_bs=16, max_context_len=512, page_size=16, device="cpu", layout=Layout.BOTH),
    PoolConfig(max_bs=160, max_context_len=4096, page_size=1, device="cpu"),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("poison", [False, True])
def test_one_allocation_no_memset(cfg: PoolConfig, poison: bool) -> None:
    rec = OpRecorder()
    with rec:
        pool = BufferPool(cfg, poison=poison)
    factories = [op for op in rec.ops if re.match(r"aten\.(empty|zeros|ones|full|new_)", op)]
    assert factories == ["aten.empty.memory_format"], factories
    assert rec.storages == {pool.arena.storage.untyped_storage().data_ptr()}
    if not poison:  # no memset: the only writes at construction are the constants
        fills = [op for op in rec.ops if "fill" in op or "zero" in op]
        assert fills == [], fills


def test_all_buffers_live_in_the_arena_aligned() -> None:
    pool = BufferPool(CONFIGS[0])
    base = pool.arena.storage.data_ptr()
    for (_, name), buf in pool.arena.buffers().items():
        assert buf.untyped_storage().data_ptr() == pool.arena.storage.untyped_storage().data_ptr()
        assert (buf.data_ptr() - base) % 256 == 0, name
        assert buf.is_contiguous(), name


def test_report_and_plan_agree() -> None:
    cfg = CONFIGS[0]
    pool = BufferPool(cfg)
    plan = attnpool.plan_arena(cfg)
    assert pool.nbytes == plan.nbytes == pool.arena.storage.numel()
    text = pool.report()
    for p in plan.placements:
        assert p.spec.name in text
    assert "overlaid" in text and "separate" in text
    d = plan.as_dict()
    assert json.loads(json.dumps(d))["nbytes"] == plan.nbytes
    assert plan.separate_nbytes >= plan.nbytes


def test_constants_survive_poison() -> None:
    pool = BufferPool(CONFIGS[0], poison=True)
    ar = pool.arena.buffer(None, "arange")
    assert torch.equal(ar, torch.arange(ar.numel(), dtype=torch.int32))
    pool.poison_()
    assert torch.equal(ar, torch.arange(ar.numel(), dtype=torch.int32))


def test_missing_phase_is_clear() -> None:
    pool = BufferPool(CONFIGS[0])
    for phase in (Phase.VERIFY, Phase.DRAFT, Phase.ENCODER, Phase.LOCAL):
        with pytest.raises(attnpool.MissingPhaseError, match=phase.value):
            pool.phase(phase)
    assert isinstance(attnpool.MissingPhaseError("x"), ValueError)


def test_layout_error_for_absent_buffer() -> None:
    pool = BufferPool(CONFIGS[1])  # FLASH_ATTN only
    with pytest.raises(attnpool.LayoutError, match="kv_indptr"):
        pool.arena.buffer(Phase.DECODE, "kv_indptr")


def test_lean_import() -> None:
    code = (
        "import sys, attnpool, torch\n"
        "bad = [m for m in ('triton', 'flash_attn', 'flashinfer', 'flash_attn_interface')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_phase_by_name_or_enum() -> None:
    from attnpool import BufferPool, InputError, Phase, PoolConfig

    pool = BufferPool(PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu"))
    assert pool.phase("decode") is pool.phase(Phase.DECODE) is pool.decode
    with pytest.raises(InputError, match="one of"):
        pool.phase("decoder")
    with pytest.raises(InputError, match="int"):
        pool.phase(3)  # type: ignore[arg-type]

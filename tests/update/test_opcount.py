"""Op counts of the update paths (docs/design.md, Budgets): the fused path is one Triton launch and
no aten op; the reference path is a fixed number of aten ops whatever the batch size (no loop over
rows).

The counters (tests/helpers/opcount.py) are checked first on things whose counts are known.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool.update import reference as ref
from attnpool.update import triton as tt
from attnpool.update.parts import FlashMLAPart
from attnpool.update.reference import PagedBuffers

from tests.helpers.batches import tree_mask
from tests.helpers.opcount import Counts, count

pytestmark = pytest.mark.triton

I32 = torch.int32


def _bufs(rows: int, width: int, pt: bool = True, fi: bool = True) -> PagedBuffers:
    def t(*shape: int) -> Tensor:
        return torch.full(shape, -1, dtype=I32)

    return PagedBuffers(t(rows), t(rows + 1), t(rows, width) if pt else None,
                        t(rows + 1) if fi else None, t(rows * width + 1) if fi else None,
                        t(rows) if fi else None)


# ---- the counters themselves --------------------------------------------------------------------
def _copy_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        o = tl.arange(0, BLOCK)
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=o < n), mask=o < n)

    return copy_kernel


def test_launch_counter_counts_each_launch() -> None:
    kernel = _copy_kernel()
    x, y = torch.arange(5, dtype=I32), torch.zeros(5, dtype=I32)

    def two() -> None:
        kernel[(1,)](x, y, 5, BLOCK=8)
        kernel[(2,)](x, y, 5, BLOCK=8)

    c = count(two)
    assert c.launches == 2 and c.kernels == ["copy_kernel", "copy_kernel"]
    assert torch.equal(x, y)  # the counted launches really ran
    assert c.num_ops == 0  # whatever the interpreter does inside a launch is not a hot-path op
    assert count(lambda: None).launches == 0


def test_op_counter_counts_aten_ops() -> None:
    x = torch.arange(8, dtype=I32)
    c = count(lambda: torch.cumsum(x.add_(1)[2:], 0))
    assert c.launches == 0
    assert c.ops == {"aten.add_.Tensor": 1, "aten.slice.Tensor": 1, "aten.cumsum.default": 1}
    assert count(lambda: x.new_empty(3)).ops["aten.new_empty.default"] == 1  # allocations too


# ---- fused path: 1 launch, 0 aten ops -----------------------------------------------------------
def _paged_args(bs: int, n: int, device_n: bool) -> dict[str, object]:
    gen = torch.Generator().manual_seed(bs)
    rows = bs if device_n else n
    args: dict[str, object] = dict(
        bs=bs, seq_lens=torch.randint(1, 200, (rows,), generator=gen),
        req_pool_indices=torch.randint(0, 4, (rows,), generator=gen),
        req_to_token=torch.randint(0, 9999, (4, 256), generator=gen, dtype=I32),
        extra=2, page_size=16, pad_seq_len=1, pad_page=0)
    if device_n:
        args["num_real"] = torch.tensor([n], dtype=I32)
    return args


@pytest.mark.parametrize("layout", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("device_n", [False, True])
@pytest.mark.parametrize("extras", ["none", "offset", "keep", "query"])
def test_fused_paged_is_one_launch_and_no_aten_op(layout: tuple[bool, bool], device_n: bool,
                                                 extras: str) -> None:
    bs, n = 8, 5
    b = _bufs(bs, 16, *layout)
    args = _paged_args(bs, n, device_n)
    rows = bs if device_n else n
    if extras == "offset":
        args["token_offset"] = torch.full((rows,), 16, dtype=torch.int64)
    elif extras == "keep":
        args["keep"] = torch.ones(bs, dtype=torch.int8)
    elif extras == "query":
        args["q_lens"] = torch.ones(rows, dtype=I32)
        args["cu_seqlens_q"] = torch.zeros(bs + 1, dtype=I32)
    tt.paged_update_(b, **args)  # type: ignore[arg-type]  # warm (interpreter rewrite / compile)
    c = count(lambda: tt.paged_update_(b, **args))  # type: ignore[arg-type]
    assert c.launches == 1 and c.kernels == ["paged_kernel"]
    assert c.num_ops == 0, c.ops


@pytest.mark.parametrize("device_n", [False, True])
def test_fused_tree_expand_is_one_launch_and_no_aten_op(device_n: bool) -> None:
    bs, n, nd = 4, 3, 4
    e = _bufs(bs * nd, nd)
    rows = bs if device_n else n
    args: dict[str, object] = dict(
        bs=bs, tree_mask=tree_mask(rows, nd),
        seq_lens=torch.full((rows,), 7), req_pool_indices=torch.arange(rows),
        req_to_token=torch.arange(4 * 64, dtype=I32).view(4, 64), pad_len=1, pad_id=0)
    if device_n:
        args["num_real"] = torch.tensor([n])
    tt.tree_expand_update_(e, **args)  # type: ignore[arg-type]
    c = count(lambda: tt.tree_expand_update_(e, **args))  # type: ignore[arg-type]
    assert c.launches == 1 and c.kernels == ["tree_expand_kernel"]
    assert c.num_ops == 0, c.ops


def _local_args(bs: int, n: int, device_n: bool) -> dict[str, object]:
    per, rows = 2, bs if device_n else n
    args: dict[str, object] = dict(
        cu_seqlens_q=torch.zeros(bs * per + 1, dtype=I32), bs=bs,
        seq_lens=torch.arange(rows) * 7 + 30, req_pool_indices=torch.arange(rows) % 4,
        req_to_token=torch.arange(4 * 128, dtype=I32).view(4, 128), extra=3, num_queries=3,
        rows_per_request=per, chunk=32, page_size=16, pad_len=1, pad_page=0)
    if device_n:
        args["num_real"] = torch.tensor([n])
    return args


@pytest.mark.parametrize("device_n", [False, True])
def test_fused_local_is_one_launch_and_no_aten_op(device_n: bool) -> None:
    bs = 4
    b = _bufs(bs * 2, 2)
    args = _local_args(bs, 3, device_n)
    tt.local_update_(b, **args)  # type: ignore[arg-type]
    c = count(lambda: tt.local_update_(b, **args))  # type: ignore[arg-type]
    assert c.launches == 1 and c.kernels == ["local_kernel"]
    assert c.num_ops == 0, c.ops


def test_fused_draft_round_is_one_launch_per_part() -> None:
    """A tree round: prefix (whole pages) + the expand rows of all S steps; a chain round: all S
    steps' lengths and the shared table. One launch each, no aten op."""
    bs, n, steps, topk, page = 4, 3, 3, 2, 16
    table = torch.arange(4 * 64, dtype=I32).view(4, 64)
    seq, rpi = torch.tensor([5, 17, 40]), torch.tensor([0, 2, 3])
    loc = torch.arange(n * steps * topk).view(n, steps, topk)
    prefix = _bufs(bs, 4)
    width, rows = page - 1 + steps, bs * topk
    e = PagedBuffers(torch.zeros((steps, rows), dtype=I32), torch.zeros((steps, rows + 1), dtype=I32),
                     torch.zeros((rows, width), dtype=I32),
                     torch.zeros((steps, rows + 1), dtype=I32),
                     torch.zeros((steps, rows * width + 1), dtype=I32),
                     torch.zeros((steps, rows), dtype=I32))
    chain = PagedBuffers(torch.zeros((steps, bs), dtype=I32), torch.zeros((steps, bs + 1), dtype=I32),
                         torch.zeros((bs, 4), dtype=I32), None, None, None)
    common: dict[str, object] = dict(bs=bs, seq_lens=seq, req_pool_indices=rpi,
                                     req_to_token=table, page_size=page)
    calls: dict[str, Callable[[], None]] = {
        "tree prefix": lambda: tt.paged_update_(prefix, extra=0, pad_seq_len=1, pad_page=0,
                                                full_pages=True, **common),  # type: ignore[arg-type]
        "tree expand": lambda: tt.draft_tree_expand_update_(e, out_cache_loc=loc, pad_len=1,
                                                            pad_id=0, **common),  # type: ignore[arg-type]
        "chain steps": lambda: tt.paged_update_(chain, extra=1, pad_seq_len=1, pad_page=0,
                                                steps=steps, **common),  # type: ignore[arg-type]
    }
    for name, call in calls.items():
        call()
        c = count(call)
        assert c.launches == 1, name
        assert c.num_ops == 0, (name, c.ops)


# ---- reference path: a fixed op count, whatever bs ----------------------------------------------
def _reference_paged(bs: int, layout: tuple[bool, bool]) -> Counts:
    n, page, width = bs // 2 + 1, 16, 16
    args = _paged_args(bs, n, False)
    b = _bufs(bs, width, *layout)
    arange = torch.arange(max(bs, width) + 1, dtype=I32)
    seq, rpi, table = args["seq_lens"], args["req_pool_indices"], args["req_to_token"]
    assert isinstance(seq, Tensor) and isinstance(rpi, Tensor) and isinstance(table, Tensor)

    def update() -> None:
        pages = ref.gather_pages(table, rpi, page, width)
        ref.lengths_(b.cache_seqlens, seq, 2, bs, 1)
        ref.paged_(b, bs=bs, pages=pages, page_size=page, pad_page=0, pad_pages=1, arange=arange)

    update()  # the first call in a process lifts one constant (aten.lift_fresh) once: not counted
    return count(update)


def _reference_tree(bs: int) -> Counts:
    n, nd = bs // 2 + 1, 4
    e = _bufs(bs * nd, nd)
    mask = tree_mask(n, nd)
    seq, rpi = torch.full((n,), 7), torch.arange(n) % 4
    table = torch.arange(4 * 64, dtype=I32).view(4, 64)
    arange = torch.arange(bs * nd + 1, dtype=I32)

    def update() -> None:
        lens, slots = ref.tree_expand(mask, seq, rpi, table)
        ref.lengths_(e.cache_seqlens, lens, 0, bs * nd, 1)
        ref.paged_(e, bs=bs * nd, pages=slots, page_size=1, pad_page=0, pad_pages=1,
                   arange=arange)

    return count(update)


def _reference_local(bs: int) -> Counts:
    """The reference local phase's writes (phases/local.py) on plain buffers."""
    n, per, page, width = bs // 2 + 1, 2, 16, 2
    args = _local_args(bs, n, False)
    seq, rpi, table, cu_q = (args[k] for k in ("seq_lens", "req_pool_indices", "req_to_token",
                                               "cu_seqlens_q"))
    assert isinstance(seq, Tensor) and isinstance(rpi, Tensor) and isinstance(table, Tensor)
    assert isinstance(cu_q, Tensor)
    b = _bufs(bs * per, width)
    arange = torch.arange(bs * per + 1, dtype=I32)

    def update() -> None:
        q_lens, kv_lens, off, valid = ref.local_rows(seq + 3, 3, 32, per, 1)
        pages = ref.gather_pages(table, rpi.repeat_interleave(per), page, width, off)
        pages = torch.where(valid[:, None], pages, 0)
        rows, real = bs * per, q_lens.shape[0]
        ref.cumsum_(cu_q, q_lens)
        pad = torch.div(arange[: rows - real], per, rounding_mode="floor").add_(1).mul_(3)
        torch.add(pad, cu_q[real : real + 1], out=cu_q[real + 1 : rows + 1])
        ref.lengths_(b.cache_seqlens, kv_lens, 0, rows, 1)
        ref.paged_(b, bs=rows, pages=pages, page_size=page, pad_page=0, pad_pages=1,
                   arange=arange)

    return count(update)


@pytest.mark.parametrize("part", ["paged both", "paged page_table", "paged csr", "tree expand",
                                  "local"])
def test_reference_op_count_is_fixed(part: str, record_property: Callable[[str, object], None]) -> None:
    sizes = (4, 16, 160)  # every batch has padded rows (a full one skips the padding fills)
    if part == "tree expand":
        got = [_reference_tree(bs) for bs in sizes]
    elif part == "local":
        got = [_reference_local(bs) for bs in sizes]
    else:
        layout = {"paged both": (True, True), "paged page_table": (True, False),
                  "paged csr": (False, True)}[part]
        got = [_reference_paged(bs, layout) for bs in sizes]
    ops = [c.num_ops for c in got]
    record_property("reference_aten_ops_per_update", ops[0])
    print(f"reference path, {part}: {ops[0]} aten ops per update, bs in {sizes}: {ops}")
    assert all(c.launches == 0 for c in got)
    assert ops[0] > 0 and ops == [ops[0]] * len(sizes)
    # the same kernels, not just as many (a full-range slice may dispatch as an alias: both views)
    assert all(_compute(c) == _compute(got[0]) for c in got)


_VIEWS = ("aten.alias.", "aten.slice.", "aten.view.", "aten.unsqueeze.", "aten.expand.",
          "aten.select.", "aten.as_strided.", "aten._reshape_alias.")


def _compute(c: Counts) -> dict[str, int]:
    return {k: v for k, v in c.ops.items() if not k.startswith(_VIEWS)}


# ---- FlashMLA's scheduler part ------------------------------------------------------------------
def _flashmla_args(bs: int, n: int, parts: int, device_n: bool) -> tuple[PagedBuffers, dict[str, Any]]:
    b = _bufs(bs, 4, fi=False)
    b.cache_seqlens.copy_(torch.arange(bs, dtype=I32) * 97 + 1)
    args: dict[str, Any] = dict(bs=bs, n=bs if device_n else n,
                                tile_scheduler_metadata=torch.zeros((parts, 8), dtype=I32),
                                num_splits=torch.zeros(bs + 1, dtype=I32), num_parts=parts)
    if device_n:
        args["num_real"] = torch.tensor([n])
    return b, args


@pytest.mark.parametrize("device_n", [False, True])
def test_fused_flashmla_is_one_launch_and_no_aten_op(device_n: bool) -> None:
    b, args = _flashmla_args(8, 5, 12, device_n)
    tt.flashmla_launch(b, FlashMLAPart(**args))()
    c = count(lambda: tt.flashmla_launch(b, FlashMLAPart(**args))())
    assert c.launches == 1 and c.kernels == ["flashmla_sched_kernel"]
    assert c.num_ops == 0, c.ops


def test_reference_flashmla_ops_grow_with_parts_not_rows() -> None:
    """The torch port is a loop over the parts (a few ops each): fixed in the batch size, linear
    in ``num_sm_parts``, the launches the fused kernel saves."""
    def ops(bs: int, parts: int) -> int:
        b, args = _flashmla_args(bs, bs - 1, parts, False)
        c = count(lambda: ref.flashmla_launch(b, FlashMLAPart(**args))())
        assert c.launches == 0
        return c.num_ops

    by_rows = [ops(bs, 8) for bs in (4, 16, 160)]
    assert by_rows == [by_rows[0]] * 3
    per_part = ops(16, 16) - ops(16, 8)
    assert per_part > 0 and ops(16, 24) - ops(16, 16) == per_part
    print(f"reference flashmla: {by_rows[0]} aten ops at 8 parts, {per_part // 8} more per part")

"""One update interface: the reference and fused modules expose the same part functions with the
same signatures, write the same bytes when called the same way, and phases never branch on the
update path (docs/design.md, Update paths and Adding a phase)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import given

from attnpool import phases as phases_pkg
from attnpool.update import reference as ref
from attnpool.update import triton as triton_update
from attnpool.update.parts import PagedPart

from tests.update.triton.test_launches import SETTINGS, Case, assert_read_region_equal, cases, pair, tt

PARTS = ("paged", "tree_expand", "draft_tree_expand", "local")
PHASES_DIR = Path(phases_pkg.__file__).resolve().parent
assert len(list(PHASES_DIR.glob("*.py"))) > 5  # (a wrong folder would leave nothing to check)


@pytest.mark.parametrize("part", PARTS)
def test_both_modules_expose_the_same_part_functions(part: str) -> None:
    for suffix in ("_launch", "_update_"):
        assert callable(getattr(ref, part + suffix)) and callable(getattr(triton_update,
                                                                          part + suffix))
    a = inspect.signature(getattr(ref, part + "_launch")).parameters
    b = inspect.signature(getattr(triton_update, part + "_launch")).parameters
    assert list(a.values()) == list(b.values())


def test_the_prefill_shape_of_local_attention_is_the_reference_part_on_both_paths() -> None:
    """Its rows per request vary, which no fixed-stride kernel covers (LocalPhase says why)."""
    assert triton_update.local_extend_launch is ref.local_extend_launch


def test_keep_flags_take_the_same_arguments_and_the_reference_path_keeps_nothing() -> None:
    """The incremental page table is a fused-path saving: the reference path writes every live
    page (the same bytes), so its flags are all 0 and a phase copies none."""
    assert (inspect.signature(ref.keep_flags).parameters.keys()
            == inspect.signature(triton_update.keep_flags).parameters.keys())
    assert triton_update.keep_flags([3, 5], [3, 5], 3) == [1, 1, 0]
    assert ref.keep_flags([3, 5], [3, 5], 3) == [0, 0, 0]


def _branches_on_path(tree: ast.AST) -> list[str]:
    """Reads of ``.fused`` / ``.impl`` / ``Impl``, and imports from an update module other than
    the part buffers' and records' (both paths take them: a phase reaches the update functions
    through ``ops`` only)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("fused", "impl", "_tt"):
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Name) and node.id == "Impl":
            found.append(f"line {node.lineno}: Impl")
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("update")
                and node.module not in ("update.buffers", "update.parts")
                and [a.name for a in node.names] != ["PagedBuffers"]):
            found.append(f"line {node.lineno}: from ..{node.module} import "
                         f"{', '.join(a.name for a in node.names)}")
    return found


@pytest.mark.parametrize("module", sorted(p.name for p in PHASES_DIR.glob("*.py")
                                          if p.name not in ("base.py", "__init__.py",
                                                            "bound.py", "_views.py",
                                                            "host_lane.py")))
def test_phase_modules_do_not_branch_on_the_update_path(module: str) -> None:
    """A phase declares its parts once over ``ops`` (either module); only the base class knows
    which one runs, and the host lane (a CPU pool's straight line, which exists only on the
    reference path and says so once, in ``HostLane.maybe``)."""
    tree = ast.parse((PHASES_DIR / module).read_text())
    assert _branches_on_path(tree) == []


def test_the_branch_check_sees_a_branch() -> None:
    tree = ast.parse("if self.fused:\n    x = 1\nfrom ..update import triton\n"
                     "from ..update.reference import PagedBuffers\n")
    assert len(_branches_on_path(tree)) == 2


class _Shared(NamedTuple):
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor


class _Values(NamedTuple):
    inputs: _Shared
    token_offset: torch.Tensor | None


def _kwargs(c: Case) -> dict[str, object]:
    return {"bs": c.bs, "seq_lens": c.seq, "req_pool_indices": c.rpi, "req_to_token": c.table,
            "extra": c.extra, "page_size": c.page, "pad_seq_len": c.pad_seq_len,
            "pad_page": c.pad_page, "token_offset": c.off}


@pytest.mark.triton
@SETTINGS
@given(cases())
def test_the_same_call_of_either_module_writes_the_same_bytes(c: Case) -> None:
    a, b = pair(c)
    ref.paged_update_(a, **_kwargs(c))
    tt.paged_update_(b, **_kwargs(c))
    assert_read_region_equal(a, b, c.bs, c.page)


@pytest.mark.triton
@SETTINGS
@given(cases())
def test_a_bound_reference_call_replays_with_new_inputs(c: Case) -> None:
    """``*_launch(...).take(values)`` then a call with new values: the same bytes as a direct
    update with those values (the protocol phases cache parts by: a value record whose first
    field holds the shared inputs, each read by name)."""
    a, b = pair(c)
    names = ("seq_lens", "req_pool_indices", "req_to_token", "token_offset")
    zeros = {k: torch.zeros_like(v) for k, v in _kwargs(c).items()  # ok: a stale first input
             if k in names and isinstance(v, torch.Tensor)}
    values = _Values(_Shared(c.seq, c.rpi, c.table), c.off)
    call = ref.paged_launch(a, PagedPart(**{**_kwargs(c), **zeros})).take(values)
    call(values)
    tt.paged_update_(b, **_kwargs(c))
    assert_read_region_equal(a, b, c.bs, c.page)

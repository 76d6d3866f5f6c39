"""Debug validation of an update's device values (``BufferPool(cfg, validate=True)``).

The fast path never reads device memory, so some bad inputs are invisible to it: lengths out of
range, rows outside ``req_to_token``, host copies that disagree with the device values (a silently
wrong ``max_seqlen_k``), a tree mask whose diagonal is not all True. In validation mode an update
copies all of its device inputs to the host in **one** read (one sync on CUDA) and rejects those
before any write, so a rejected call leaves the pool unchanged. It costs a sync per update: turn it
on while integrating an engine or in tests, never in a captured or timed loop (a host read inside
a CUDA graph capture is illegal; validation is skipped there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import CapacityError, InputError


@dataclass
class Values:
    """What one update asks to validate; names are the update's parameter names.

    Attributes:
        n: real rows (Python count; with ``num_real`` the device count replaces it).
        num_real: the capturable count, or None.
        table_rows: rows of the request table, ``req_to_token`` or ``block_table``
            (``req_pool_indices`` must index one).
        ranges: ``(name, tensor, lo, hi)``: every real value in ``[lo, hi]``.
        host: ``(name of the host copy, host values or None, device tensor)``: equal when given.
        at_most: ``(a, b)`` names: ``a[i] <= b[i]`` for every real row.
        sum_at_most: ``(name, bound)``: the real values sum to at most ``bound``.
        sum_pair_at_most: ``(a, b, bound)``: ``a[i] + b[i] <= bound``.
        tree_mask: ``[rows, N, N]`` bool whose real rows' diagonals must be all True.
    """

    n: int
    num_real: Tensor | None
    table_rows: int
    ranges: list[tuple[str, Tensor, int, int]] = field(default_factory=list)
    host: list[tuple[str, Sequence[int] | Tensor | None, str]] = field(default_factory=list)
    at_most: list[tuple[str, str]] = field(default_factory=list)
    sum_at_most: tuple[str, int] | None = None
    sum_pair_at_most: tuple[str, str, int] | None = None
    tree_mask: Tensor | None = None


def validate(v: Values) -> None:
    """Read every value of ``v`` to the host at once and raise a :class:`PoolError` naming the
    first bad one (see the module docstring)."""
    names = [name for name, *_ in v.ranges]
    parts = [t.reshape(-1).to(torch.int64) for _, t, _, _ in v.ranges]
    if v.num_real is not None:
        parts.append(v.num_real.reshape(-1).to(torch.int64))
    if v.tree_mask is not None:
        parts.append(v.tree_mask.diagonal(dim1=1, dim2=2).all(-1).to(torch.int64))
    flat = torch.cat(parts).tolist() if parts else []  # the one host read
    vals: dict[str, list[int]] = {}
    at = 0
    for name, t in zip(names, (t for _, t, _, _ in v.ranges), strict=True):
        vals[name] = flat[at : at + t.numel()]
        at += t.numel()
    n = v.n
    if v.num_real is not None:
        n = max(0, min(flat[at], len(vals[names[0]]) if names else 0))
        at += 1
    for name, _, lo, hi in v.ranges:
        hi = v.table_rows - 1 if name == "req_pool_indices" else hi
        for i, x in enumerate(vals[name][:n]):
            if not lo <= x <= hi:
                raise CapacityError(f"validate: {name}[{i}] must be in [{lo}, {hi}], got {x}")
    for cpu_name, host, dev_name in v.host:
        if host is None:
            continue
        want = host.tolist() if isinstance(host, Tensor) else list(host)
        got = vals[dev_name][:n]
        if want != got:
            i = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                     min(len(want), len(got)))
            raise InputError(f"validate: {cpu_name} disagrees with {dev_name} on the device at "
                             f"row {i}: host {want[i] if i < len(want) else None}, device "
                             f"{got[i] if i < len(got) else None}")
    for a, b in v.at_most:
        for i, (x, y) in enumerate(zip(vals[a][:n], vals[b][:n], strict=True)):
            if x > y:
                raise CapacityError(f"validate: {a}[{i}] must be <= {b}[{i}]={y}, got {x}")
    if v.sum_at_most is not None:
        name, bound = v.sum_at_most
        total = sum(vals[name][:n])
        if total > bound:
            raise CapacityError(f"validate: sum({name}) must be <= {bound}, got {total}")
    if v.sum_pair_at_most is not None:
        a, b, bound = v.sum_pair_at_most
        for i, (x, y) in enumerate(zip(vals[a][:n], vals[b][:n], strict=True)):
            if x + y > bound:
                raise CapacityError(f"validate: {a}[{i}] + {b}[{i}] must be <= {bound}, got "
                                    f"{x} + {y}")
    if v.tree_mask is not None:
        diag = flat[at : at + v.tree_mask.shape[0]]
        bad = next((i for i, ok in enumerate(diag[:n]) if not ok), None)
        if bad is not None:
            raise InputError(f"validate: tree_mask[{bad}] must have an all-True diagonal (each "
                             "draft token attends to itself)")

"""FlashMLA's tile scheduler port: hand-worked schedules, a plain loop over requests (the way the
metadata kernel walks them, in Python ints), and the invariants the decode kernel relies on."""

from __future__ import annotations

import random

import pytest
import torch

from attnpool import InputError
from attnpool.update.reference.flashmla import (
    SchedLayout,
    get_mla_metadata,
    num_sm_parts,
)

from tests.helpers.flashmla_loop import loop_schedule as _loop

ARGS, META = SchedLayout.ARGUMENTS, SchedLayout.DECODING_SCHED_META


def test_hand_worked() -> None:
    # lengths 64 and 200: 1 and 4 blocks, 15 with overheads, payload ceil(15 / 2) + 5 = 13
    md, ns = get_mla_metadata(torch.tensor([64, 200], dtype=torch.int32), 2)
    assert md.tolist() == [[0, 0, 1, 2, 0, 0, 0, 0], [1, 2, 1, 4, 1, 0, 0, 0]]
    assert ns.tolist() == [0, 1, 3] and md.dtype == ns.dtype == torch.int32
    md, _ = get_mla_metadata(torch.tensor([64, 200]), 2, layout=META)
    assert md.tolist() == [[0, 1, 0, 2, 0, 0, 1, 0], [1, 1, 2, 4, 1, 1, 1, 0]]
    # more parts than work: idle parts begin at b, in both layouts
    buf = torch.full((4,), 99, dtype=torch.int32)
    md, ns = get_mla_metadata(torch.tensor([1]), 3, num_splits=buf)
    assert md.tolist() == [[0, 0, 0, 1, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0, 0, 0],
                           [1, 0, 0, 1, 0, 0, 0, 0]]
    assert ns is buf and buf.tolist() == [0, 1, 1, 1]  # padded rows: the last value repeated
    md, _ = get_mla_metadata(torch.tensor([1]), 3, layout=META)
    assert md[1:, 0].tolist() == [1, 1]
    # ... or at the kernel call's batch, when it has rows past the scheduled ones
    md, _ = get_mla_metadata(torch.tensor([1]), 3, layout=META, batch=5)
    assert md[1:, 0].tolist() == [5, 5]
    md, _ = get_mla_metadata(torch.tensor([1]), 3, batch=5)
    assert md[1:, 0].tolist() == [5, 5]
    # an idle part's begin block is read past FlashMLA's first-block array: request 0's last
    # block (2 for 130 tokens)
    md, ns = get_mla_metadata(torch.tensor([130]), 4)
    assert md.tolist()[:3] == [[0, 0, 0, 2, 0, 0, 0, 0], [0, 2, 0, 3, 1, 0, 0, 0],
                               [1, 2, 0, 3, 0, 0, 0, 0]]
    assert ns.tolist() == [0, 2]
    # a row of length 0 costs one block and ends at block 0
    md, ns = get_mla_metadata(torch.tensor([0, 5]), 1)
    assert md.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0]] and ns.tolist() == [0, 1, 2]


def test_num_sm_parts() -> None:
    assert num_sm_parts(132, 128, 1) == 66  # V3 decode, 128 heads on one KV head: 2 tiles
    assert num_sm_parts(132, 128 * 4, 1) == 16  # verify of 4 rows: s_q * h_q = 512
    assert num_sm_parts(132, 16, 1) == 132
    assert num_sm_parts(132, 128, 1, fp8=True) == 66  # half the SMs, tiles of 128
    assert num_sm_parts(8, 1024, 1) == 1


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_loop_and_covers_every_block_once(seed: int) -> None:
    rng = random.Random(seed)
    b = rng.randint(1, 40)
    lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 5000)]) for _ in range(b)]
    parts = rng.choice([1, 2, 3, 7, 16, 66, 132])
    rows, splits = _loop(lens, parts)
    md, ns = get_mla_metadata(torch.tensor(lens, dtype=torch.int64), parts)
    assert md.tolist() == rows and ns.tolist() == splits
    # coverage: the parts' block ranges tile every request exactly once, in split order
    nb = [0 if n == 0 else -(-n // 64) for n in lens]
    seen: list[list[tuple[int, int, int]]] = [[] for _ in range(b)]  # (split, lo, hi)
    for p in md.tolist():
        if p[0] < 0:
            continue
        for r in range(p[0], p[2] + 1):
            lo = p[1] if r == p[0] else 0
            hi = p[3] if r == p[2] else nb[r]
            seen[r].append((p[4] if r == p[0] else 0, lo, hi))
    for r in range(b):
        s = seen[r]
        assert [x[0] for x in s] == list(range(len(s)))  # splits numbered 0, 1, ...
        assert len(s) == ns[r + 1] - ns[r]
        assert s[0][1] == 0 and s[-1][2] == nb[r]
        assert all(s[i][2] == s[i + 1][1] for i in range(len(s) - 1))
    # struct layout: same ranges, flags say which requests are cut
    meta, _ = get_mla_metadata(torch.tensor(lens, dtype=torch.int32), parts, layout=META)
    for p, q in zip(md.tolist(), meta.tolist(), strict=True):
        assert (q[0], q[1], q[3], q[4]) == (b if p[0] < 0 else p[0], p[2], p[3], p[4])


def test_refusals() -> None:
    with pytest.raises(InputError, match="batch must be an int >= b=2, got 1"):
        get_mla_metadata(torch.tensor([3, 4]), 2, batch=1)
    with pytest.raises(InputError, match="non-empty"):
        get_mla_metadata(torch.tensor([], dtype=torch.int32), 2)
    with pytest.raises(InputError, match="num_parts"):
        get_mla_metadata(torch.tensor([3]), 0)
    with pytest.raises(InputError, match=r"num_splits must be a contiguous \[>= 3\] int32"):
        get_mla_metadata(torch.tensor([3, 4]), 2, num_splits=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(InputError, match=r"tile_scheduler_metadata must be a contiguous \[2, 8\]"):
        get_mla_metadata(torch.tensor([3]), 2,
                         tile_scheduler_metadata=torch.zeros(3, 8, dtype=torch.int32))

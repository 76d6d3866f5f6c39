"""FlashMLA's schedule the plain way: one request at a time, in Python ints (the oracle of the
torch port and of the pool's metadata buffers)."""

from __future__ import annotations


def loop_schedule(lens: list[int], parts: int, idle: int | None = None
                  ) -> tuple[list[list[int]], list[int]]:
    """The schedule in the argument layout, one request at a time (64-token blocks, 5 blocks of
    overhead per request, a payload of ceil(total / parts) + 5 per part); a part with no work
    begins at ``idle`` (default the batch, as FlashMLA's planner writes it)."""
    b = len(lens)
    idle = b if idle is None else idle
    last = [max(n - 1, 0) // 64 for n in lens]
    nb = [x + 1 for x in last]
    payload = -(-sum(x + 5 for x in nb) // parts) + 5
    req = blk = split = cum = 0
    splits, rows = [0], []
    for _ in range(parts):
        begin = (idle if req >= b else req, blk + (last[0] if req >= b else 0), split)
        left = payload
        while req < b:
            if left >= nb[req] - blk + 5:
                cum += split + 1
                splits.append(cum)
                left -= nb[req] - blk + 5
                req, blk, split = req + 1, 0, 0
            else:
                if left - 5 > 0:
                    blk += left - 5
                    split += 1
                break
        end_req = req if blk > 0 else req - 1
        end_blk = blk if blk > 0 else (0 if lens[req - 1] == 0 else last[req - 1] + 1)
        rows.append([begin[0], begin[1], end_req, end_blk, begin[2], 0, 0, 0])
    assert req == b and blk == 0 and split == 0
    return rows, splits

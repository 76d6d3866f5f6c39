"""The reference path's refill costs what the step's real rows and tokens cost, not the pool's
capacity: the op budget of an engine step (vLLM's block table, host lengths) and token work that
follows the real tokens, with the same bytes as the full-size computation."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnpool import BufferPool, Impl, Layout, PoolConfig
from attnpool.update import host

from tests.helpers.opcount import count

PAGE = 16
#: aten ops of one reference update from a block table with host lengths (what an engine's
#: builder calls per step and KV-cache group), by step kind and window part: decode runs 5
#: (15 with a window part), a mixed step 14; a mixed step's window part adds 11 (its rows'
#: first columns, lengths and gathered pages), past the 15 of the other kinds
STEP_BUDGET = {("decode", False): 15, ("decode", True): 15, ("extend", False): 15,
               ("extend", True): 25}


def _pool(t: int, window: int | None = None) -> BufferPool:
    cfg = PoolConfig(max_bs=16, max_context_len=1024, page_size=PAGE, device="cpu",
                     layout=Layout.FLASH_ATTN, max_extend_tokens=t, pad_page=0, num_pages=512,
                     impl=Impl.REFERENCE, sliding_window=window)
    return BufferPool(cfg, poison=True)


def _step(n: int, seed: int) -> dict[str, Any]:
    """A vLLM-shaped mixed step: ``n`` requests (decode rows and a prefill chunk) on a block
    table of the pool's own pages."""
    rng = random.Random(seed)
    ext = [1] * n
    ext[rng.randrange(n)] = 5
    seq = [rng.randint(e, 900) for e in ext]
    g = torch.Generator().manual_seed(seed)
    table = (torch.randint(0, 511, (16, 64), generator=g) + 1).to(torch.int32)  # page 0: pad
    return {"seq_lens": torch.tensor(seq, dtype=torch.int32),
            "extend_lens": torch.tensor(ext, dtype=torch.int32), "block_table": table[:n]}


@pytest.mark.parametrize("route", ["host", "host_offsets", "general"])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("kind", ["decode", "extend"])
@pytest.mark.parametrize("n", [1, 8, 16])
def test_an_engine_step_is_within_the_op_budget(kind: str, window: int | None, n: int,
                                                route: str) -> None:
    """Decode and mixed steps, with and without a sliding-window part, from a block table with
    the inputs themselves as host copies (a CPU engine's builder): on the host route
    (``host_step``, the C step of :mod:`attnpool.update.host`) no torch op at all, on the
    general path (``update_``) within the budget."""
    if route.startswith("host") and host.load() is None:
        pytest.skip(f"the C step is not built here: {host.why()}")
    pool = _pool(64, window)
    s = _step(n, 1)
    seq, ext, table = s["seq_lens"], s["extend_lens"], s["block_table"]
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(ext, 0)

    def update() -> None:
        if route.startswith("host"):
            if kind == "decode":
                pool.decode.host_step(n, seq, table)
            elif route == "host":
                pool.extend.host_step(n, seq, ext, table)
            else:
                pool.extend.host_step_offsets(n, seq, cu, table)
        elif kind == "decode":
            pool.decode.update_(n, seq_lens=seq, block_table=table, seq_lens_cpu=seq)
        else:
            pool.extend.update_(n, seq_lens=seq, extend_lens=ext, block_table=table,
                                seq_lens_cpu=seq, extend_lens_cpu=ext)

    update()
    c = count(update)
    assert c.num_ops <= (0 if route != "general" else STEP_BUDGET[(kind, window is not None)]), \
        c.ops


class _Sizes(TorchDispatchMode):
    """The element count of every ``searchsorted`` (the per-token row lookup) dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if "searchsorted" in str(func):
            self.sizes.append(out.numel())
        return out


def test_extend_token_work_follows_the_real_tokens() -> None:
    """With ``extend_lens_cpu`` the per-token work runs over the step's real tokens: the same
    ops whatever ``max_extend_tokens`` is, and the same bytes as without the host copies."""
    ops = []
    for t in (64, 2048):
        pool, ref = _pool(t), _pool(t)
        s = _step(6, 2)
        total = int(s["extend_lens"].sum())
        slots, ref_slots = (torch.empty(t, dtype=torch.int64) for _ in range(2))

        def update(p: BufferPool = pool, sl: torch.Tensor = slots, s: dict[str, Any] = s,
                   ) -> None:
            p.extend.update_(6, **s, seq_lens_cpu=s["seq_lens"],
                             extend_lens_cpu=s["extend_lens"], out_slots=sl)

        update()
        with _Sizes() as seen:
            update()
        assert seen.sizes == [total], seen.sizes
        ops.append(count(update).num_ops)
        view = ref.extend.update_(6, **s, out_slots=ref_slots)  # no host copies: all T tokens
        assert torch.equal(pool.extend.view(6).positions.view(torch.uint8),
                           view.positions.view(torch.uint8))
        assert torch.equal(slots.view(torch.uint8), ref_slots.view(torch.uint8))
        assert torch.equal(slots[total:], torch.full((t - total,), -1))
    assert ops[0] == ops[1], ops

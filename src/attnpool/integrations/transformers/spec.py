"""One speculative decoding round (chain, greedy) over the running requests.

With ``L = len(tokens)`` of a request, the target's cache holds positions ``< L - 1`` and the
draft's ``< L``, and the draft has already proposed ``d_1`` (from the forward that read token
``L - 1``). A round:

1. **Draft steps** (``pool.draft``, ``S = N - 1`` chain steps in one update): step ``s`` feeds
   ``d_s`` at position ``L + s - 1`` and proposes ``d_{s+1}``. The proposals stay on the device.
2. **Verify** (``pool.verify``, ``N + 1`` queries per request, causal): the target reads
   ``[tokens[L-1], d_1 .. d_N]`` at positions ``L-1 .. L+N-1`` and predicts ``t_1 .. t_{N+1}``.
   Greedy acceptance: the longest prefix with ``d_j == t_j`` (``m`` tokens) is accepted, and
   ``t_{m+1}`` comes free, so ``m + 1`` tokens are committed: exactly what target-only greedy
   decoding would produce, since each ``t_j`` was computed from committed tokens only. The target
   cache now holds positions ``< L + m`` (the inputs ``x_0 .. x_m``); rejected positions beyond
   are overwritten later.
3. **Draft extend** (``pool.draft_extend``, ``m + 1`` queries per request): the draft reads the
   committed ``t_1 .. t_{m+1}`` at positions ``L .. L+m`` (rewriting the accepted ones it had
   already seen, which is harmless) and its last logits give the next round's ``d_1``.

Three metadata updates and ``N + 1`` forwards per round; two host reads (the accepted tokens, the
next proposals). Acceptance counts go to
:class:`~attnpool.integrations.transformers.state.GenerationStats`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ...config import Phase
from ...pool import BufferPool
from ...views import LocalView
from .attention import as_decode
from .runner import ModelRunner
from .state import GenerationStats, Request, Tables


class RoundHost(Protocol):
    """What a round needs from the generator that runs it (``PagedGenerator`` is one).

    Spelled out here so that this module never imports the generator back: the generator calls
    :func:`spec_round` with itself, and the import points one way.
    """

    pool: BufferPool
    target: ModelRunner
    draft: ModelRunner | None
    tables: Tables
    num_draft_tokens: int
    stats: GenerationStats

    def slots(self, r: Request, start: int, count: int) -> list[int]: ...

    def window_slots(self, r: Request, start: int, count: int) -> list[int]: ...

    def step_pages(self, running: Sequence[Request]) -> None: ...

    def local(self, runner: ModelRunner, n: int, **inputs: Any) -> LocalView | None: ...

    def host_block(self, rows: Sequence[Sequence[int]]) -> Tensor: ...

    def _metadata(self, t0: float) -> None: ...


def _draft_steps(gen: RoundHost, running: list[Request], rows: list[int]) -> list[Tensor]:
    """Proposals ``d_1 .. d_N`` as ``N`` device tensors ``[n]`` (``d_1`` from the host)."""
    draft, n, steps = gen.draft, len(running), gen.num_draft_tokens - 1
    assert draft is not None
    t0 = time.perf_counter()
    base = [r.draft_len for r in running]
    # step s's new-token slots (position L + s) are row 3 + s: all steps in one host block
    per_step = list(zip(*(gen.slots(r, r.draft_len, steps) for r in running), strict=True))
    window = list(zip(*(gen.window_slots(r, r.draft_len, steps) for r in running), strict=True))
    blk = gen.host_block([base, rows, [r.proposal for r in running], *per_step, *window])
    props = [blk[2]]
    if not steps:
        gen._metadata(t0)
        return props
    dview = gen.pool.draft.update_(n, seq_lens=blk[0], req_pool_indices=blk[1],
                                   seq_lens_cpu=base, **gen.tables)
    for s in range(steps):
        if s:
            t0 = time.perf_counter()
        draft.set_slots(blk[3 + s], blk[3 + steps + s] if window else None)
        step = dview.steps[s]
        pos = blk[0] + s
        local = gen.local(draft, n, seq_lens=pos + 1, req_pool_indices=blk[1])
        ctx = draft.context(as_decode(step.prefix, step.window), n, local=local)
        gen._metadata(t0)
        props.append(draft.forward(ctx, props[-1], pos).argmax(-1))
        gen.stats.draft_forwards += 1
    return props


def _verify(gen: RoundHost, running: list[Request], rows: list[int],
            props: list[Tensor]) -> list[list[int]]:
    """Target verify; per request the committed tokens ``t_1 .. t_{m+1}`` (host ints)."""
    n, nq = len(running), gen.num_draft_tokens + 1
    t0 = time.perf_counter()
    kvl = [r.kv_len for r in running]
    flat_pos = [p + j for p in kvl for j in range(nq)]
    flat_slots = [s for r in running for s in gen.slots(r, r.kv_len, nq)]
    wslots = [s for r in running for s in gen.window_slots(r, r.kv_len, nq)]
    blk = gen.host_block([kvl, rows, [r.tokens[-1] for r in running]])
    tok = gen.host_block([flat_slots, flat_pos, *([wslots] if wslots else [])])
    ids = torch.stack([blk[2], *props], dim=1).view(-1)  # [n * (N + 1)]: request-major
    view = gen.pool.verify.update_(n, seq_lens=blk[0], req_pool_indices=blk[1],
                                   seq_lens_cpu=kvl, **gen.tables)
    gen.target.set_slots(tok[0], tok[2] if wslots else None)
    local = gen.local(gen.target, n, seq_lens=blk[0], req_pool_indices=blk[1],
                      for_phase=Phase.VERIFY, seq_lens_cpu=kvl)
    ctx = gen.target.context(view, n * nq, local=local)
    gen._metadata(t0)
    t = gen.target.forward(ctx, ids, tok[1]).argmax(-1).view(n, nq)
    d = ids.view(n, nq)[:, 1:]
    m = (d == t[:, :-1]).cumprod(1).sum(1)  # accepted proposals: the longest matching prefix
    res: list[list[int]] = torch.cat([t, m[:, None]], 1).tolist()
    gen.stats.decode_steps += 1
    return [row[: row[-1] + 1] for row in res]


def _draft_extend(gen: RoundHost, live: list[Request], new: list[list[int]]) -> None:
    """The draft reads each request's committed tokens; its last logits are the next ``d_1``."""
    draft = gen.draft
    assert draft is not None
    t0 = time.perf_counter()
    acc = [len(t) for t in new]
    start = [r.draft_len for r in live]
    seq = [s + a for s, a in zip(start, acc, strict=True)]
    last, total = [], 0
    for a in acc:
        total += a
        last.append(total - 1)
    blk = gen.host_block([seq, acc, [r.alloc.row for r in live if r.alloc is not None], last])
    wslots = [x for r, s, a in zip(live, start, acc, strict=True)
              for x in gen.window_slots(r, s, a)]
    flat = gen.host_block([
        [t for ts in new for t in ts],
        [s + j for s, a in zip(start, acc, strict=True) for j in range(a)],
        [x for r, s, a in zip(live, start, acc, strict=True) for x in gen.slots(r, s, a)],
        *([wslots] if wslots else [])])
    view = gen.pool.draft_extend.update_(len(live), seq_lens=blk[0], accept_lens=blk[1],
                                         req_pool_indices=blk[2], seq_lens_cpu=seq,
                                         accept_lens_cpu=acc, **gen.tables)
    draft.set_slots(flat[2], flat[3] if wslots else None)
    local = gen.local(draft, len(live), seq_lens=blk[0], extend_lens=blk[1],
                      req_pool_indices=blk[2], for_phase=Phase.EXTEND, seq_lens_cpu=seq,
                      extend_lens_cpu=acc)
    ctx = draft.context(view, total, local=local)
    gen._metadata(t0)
    props: list[int] = draft.forward(ctx, flat[0], flat[1], keep=blk[3]).argmax(-1).tolist()
    gen.stats.draft_forwards += 1
    for r, p, s in zip(live, props, seq, strict=True):
        r.draft_len, r.proposal = s, p


def spec_round(gen: RoundHost, running: list[Request]) -> None:
    """One round for every running request (see the module docstring)."""
    gen.step_pages(running)
    rows = [r.alloc.row for r in running if r.alloc is not None]
    props = _draft_steps(gen, running, rows)
    committed = _verify(gen, running, rows, props)
    live, new = [], []
    for r, toks in zip(running, committed, strict=True):
        gen.stats.proposed += gen.num_draft_tokens
        gen.stats.accepted += len(toks) - 1
        r.extend(toks)
        r.kv_len += len(toks)
        if not r.done:
            live.append(r)
            new.append(toks)
    if live:
        _draft_extend(gen, live, new)

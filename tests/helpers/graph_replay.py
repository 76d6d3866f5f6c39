"""What the CUDA-graph replay tests share: a captured forward (a real graph on CUDA, a
simulated one on CPU) and random mixed prefill + decode batches."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor


def capture(forward: Callable[[], Tensor], dev: torch.device) -> tuple[Callable[[], None], Tensor]:
    """``(replay, out)``: on CUDA a graph of ``forward`` (warmed up on a side stream first: FA4
    JIT-compiles on its first call, never inside a capture); on CPU a simulated one whose replay
    re-runs ``forward`` on the same captured view and static input into the captured output."""
    if dev.type == "cuda":
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward()
        return graph.replay, out
    for _ in range(2):
        forward()
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return replay, out


def mixed_batch(n: int, t: int, c: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """``(seq_lens, extend_lens)`` of ``n`` requests, each a decode row (``extend_len`` 1), a
    prefill chunk on a cached prefix, or a whole prompt (no prefix), lengths up to ``c``; the
    new tokens sum to at most ``t``. With ``n >= 2`` the batch has at least one decode row and one
    prefill chunk, so every step is really mixed."""
    kinds = [rng.choice(["decode", "chunk", "whole"]) for _ in range(n)]
    if n >= 2:
        kinds[:2] = ["decode", "chunk"]
        rng.shuffle(kinds)
    seq: list[int] = []
    ext: list[int] = []
    for i, kind in enumerate(kinds):
        budget = t - sum(ext) - (n - i - 1)  # leave >= 1 token for each later request
        if kind == "decode":
            e = 1
            s = rng.choice([1, c, rng.randint(1, c)])
        else:
            hi = min(c, budget)
            e = rng.choice([1, hi, rng.randint(1, hi)])  # hi: sometimes the batch fills T
            prefix = 0 if kind == "whole" else rng.choice(
                [c - e, rng.randint(0, c - e)])
            s = e + prefix
        seq.append(s)
        ext.append(e)
    return seq, ext

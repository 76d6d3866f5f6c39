"""A vLLM-style model runner on attnpool: continuous batching with chunked prefill over a
page-level block table, prefill chunks and decode rows mixed in one forward.

vLLM's conventions, and what attnpool takes for them:

* ``block_table [max_num_reqs, max_blocks_per_req]``: row ``i`` lists the KV blocks (pages) of the
  request in batch row ``i``; block 0 is never handed out (here: attnpool's pad page).
* ``slot_mapping``: the new tokens' slots, ``block_table[i, pos // block_size] * block_size +
  pos % block_size``, written into the :class:`attnpool.KVCachePool`'s static ``slot_mapping``.
* attnpool's phase updates take the block table itself (``block_table=``, instead of SGLang's
  token-level ``req_to_token``) and no ``req_pool_indices``: batch row ``i`` is block table row
  ``i``, vLLM's convention.

Each step runs one forward over every live request, as vLLM v1 schedules: a request still
prefilling gets its next chunk of at most ``CHUNK`` prompt tokens, a request past its prompt one
decode token. A step with any prefill chunk is *mixed* (or pure prefill) and is ONE
``pool.extend`` update: a decode row is an extend row with one new token (``extend_lens[i] = 1``,
``seq_lens[i]`` its total length), a chunk row has more, and the whole batch reads one
``ExtendView`` (eagerly, as vLLM runs such batches, or with attention outside the graph in its
piecewise mode). A step where every row decodes is a uniform decode batch: ``pool.decode``, CUDA
graphs per padded batch size on a GPU, eager on CPU. Requests return their blocks when done.
Everything generated is checked against greedy decoding of the same toy model computed without
any cache (examples/toy_model.py).

Run: ``python examples/vllm_runner.py`` (``--device cuda`` on a GPU: captures CUDA graphs).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnpool import BufferPool, KVCacheConfig, KVCachePool, Phase, PoolConfig
from attnpool.graphs import GraphRunner

from toy_model import DTYPE, HEAD_DIM, KV_HEADS, VOCAB, ToyLM, greedy_reference

MAX_BS, CONTEXT, BLOCK = 4, 128, 16
MAX_BLOCKS = CONTEXT // BLOCK
NUM_BLOCKS = 24  # fewer than MAX_BS full contexts: requests also wait for blocks
CHUNK = 16  # prompt tokens a request prefills per step (chunked prefill)
STEP_TOKENS = MAX_BS * CHUNK  # the most tokens one forward packs (max_extend_tokens)


@dataclass
class Req:
    rid: int
    prompt: list[int]
    max_new: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose K/V the cache holds

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.prompt)


def _rows(n: int) -> str:
    return f"{n} decode row{'' if n == 1 else 's'}"


class Runner:
    def __init__(self, device: torch.device) -> None:
        self.dev = device
        self.pool = BufferPool(PoolConfig(max_bs=MAX_BS, max_context_len=CONTEXT, page_size=BLOCK,
                                          device=device, max_extend_tokens=STEP_TOKENS))
        self.kv = KVCachePool(KVCacheConfig(
            num_pages=NUM_BLOCKS, page_size=BLOCK, max_tokens=STEP_TOKENS, num_kv_heads=KV_HEADS,
            head_dim=HEAD_DIM, dtype=DTYPE, device=device))
        self.block_table = torch.zeros(MAX_BS, MAX_BLOCKS, dtype=torch.int32, device=device)
        self.free_blocks = list(range(1, NUM_BLOCKS))  # block 0: the pad block
        self.batch: list[Req] = []  # batch row i serves self.batch[i]
        self.model = ToyLM(seed=0, device=device)
        self.kv.slot_view(MAX_BS)  # slots a captured store reads start at -1 (skipped)
        self.graphs = GraphRunner(self.pool, Phase.DECODE, self._forward,
                                  example=torch.zeros(1, dtype=torch.int64, device=device))

    def _forward(self, view: object, tokens: Tensor) -> Tensor:
        return self.model.forward(view, tokens, self.kv, 0)

    def _ints(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.dev)

    def _tables(self) -> Tensor:
        """Write the live rows of the block table (what attnpool's updates read)."""
        for i, r in enumerate(self.batch):
            row = r.blocks + [0] * (MAX_BLOCKS - len(r.blocks))
            self.block_table[i] = torch.tensor(row, dtype=torch.int32)
        return self.block_table

    def _slots(self, rows: list[int], positions: list[int]) -> Tensor:
        """vLLM's slot mapping from the block table."""
        r, p = self._ints(rows), self._ints(positions)
        return self.block_table[r, p // BLOCK].long() * BLOCK + p % BLOCK

    def admit(self, waiting: list[Req]) -> list[Req]:
        """Move waiting requests into free batch rows while their blocks fit (their prompts are
        prefilled chunk by chunk by the next steps)."""
        new: list[Req] = []
        while waiting and len(self.batch) < MAX_BS:
            need = -(-(len(waiting[0].prompt) + waiting[0].max_new) // BLOCK)
            if need > len(self.free_blocks):
                break
            r = waiting.pop(0)
            r.blocks = [self.free_blocks.pop(0) for _ in range(need)]
            r.tokens = list(r.prompt)
            self.batch.append(r)
            new.append(r)
        return new

    def step(self) -> str:
        """One forward over every live request; returns what it ran."""
        if any(r.prefilling for r in self.batch):
            return self._extend()
        return self._decode()

    def _extend(self) -> str:
        """Prefill chunks, with the decode rows of the other requests when there are any: one
        ``pool.extend`` update, one forward, every row an extend row."""
        table, n = self._tables(), len(self.batch)
        q = [min(CHUNK, len(r.prompt) - r.computed) if r.prefilling else 1 for r in self.batch]
        seq = [r.computed + k for r, k in zip(self.batch, q, strict=True)]
        view = self.pool.extend.update_(n, seq_lens=self._ints(seq), extend_lens=self._ints(q),
                                        block_table=table, seq_lens_cpu=seq, extend_lens_cpu=q)
        pos = [list(range(r.computed, s)) for r, s in zip(self.batch, seq, strict=True)]
        slots = torch.cat([self._slots([i] * len(p), p) for i, p in enumerate(pos)])
        tokens = self._ints([r.tokens[p] for r, ps in zip(self.batch, pos, strict=True) for p in ps])
        logits = self.model.forward(view, tokens, self.kv, 0, slots)
        last = (torch.tensor(q).cumsum(0) - 1).to(self.dev)  # each row's last query
        decodes = sum(not r.prefilling for r in self.batch)
        chunks = ", ".join(f"request {r.rid} tokens {r.computed}-{s - 1} of {len(r.prompt)}"
                           for r, s in zip(self.batch, seq, strict=True) if r.prefilling)
        for r, s, t in zip(self.batch, seq, logits[last].argmax(-1).tolist(), strict=True):
            r.computed = s
            if not r.prefilling:  # a decode row, or a prompt's last chunk: a new token
                r.tokens.append(t)
        kind = "mixed" if decodes else "prefill"
        return (f"{kind} pool.extend: {_rows(decodes)} + prefill chunks [{chunks}] "
                f"({sum(q)} tokens, one forward)")

    def _decode(self) -> str:
        """A uniform decode batch: ``pool.decode``, replayed from a CUDA graph on a GPU."""
        n = len(self.batch)
        table = self._tables()
        pos = [r.computed for r in self.batch]  # the pending token's position
        padded = self.graphs.padded_size(n) if self.graphs.use_graphs else None
        bs = padded or n
        self.kv.update_slots_(self._slots(list(range(n)), pos), bs=bs)
        lens = [p + 1 for p in pos]
        logits = self.graphs.run(self._ints([r.tokens[-1] for r in self.batch]),
                                 seq_lens=self._ints(lens), block_table=table, seq_lens_cpu=lens)
        for r, t in zip(self.batch, logits.argmax(-1).tolist(), strict=True):
            r.tokens.append(t)
            r.computed += 1
        return f"decode pool.decode: {_rows(n)} at bs={bs}"

    def retire(self) -> list[Req]:
        """Finished requests leave the batch (rows behind them move up) and free their blocks."""
        done = [r for r in self.batch if len(r.tokens) - len(r.prompt) >= r.max_new]
        for r in done:
            self.free_blocks += r.blocks
        self.batch = [r for r in self.batch if r not in done]
        return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--requests", type=int, default=10)
    a = ap.parse_args()
    t0 = time.perf_counter()
    runner = Runner(torch.device(a.device))
    print(f"pool: {runner.pool.nbytes} bytes in one allocation; KV cache: {NUM_BLOCKS - 1} usable "
          f"blocks of {BLOCK} tokens; decode capture sizes {runner.graphs.capture_sizes} ("
          + ("CUDA graphs" if runner.graphs.use_graphs else "eager: no CUDA here") + ")")
    rng = random.Random(0)
    waiting = [Req(i, [rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))], rng.randint(4, 12))
               for i in range(a.requests)]
    finished: list[Req] = []
    step, mixed = 0, 0
    while waiting or runner.batch:
        new = runner.admit(waiting)
        what = runner.step()
        mixed += what.startswith("mixed")
        done = runner.retire()
        finished += done
        print(f"step {step:2d}: admitted {[r.rid for r in new]}; {what}; finished "
              f"{[r.rid for r in done]}, free blocks {len(runner.free_blocks)}")
        step += 1
    for r in finished:
        new_tokens = r.tokens[len(r.prompt):]
        if new_tokens != greedy_reference(runner.model, r.prompt, len(new_tokens)):
            raise SystemExit(f"request {r.rid}: generated tokens differ from greedy decoding")
    print(f"{len(finished)} requests, {sum(r.max_new for r in finished)} tokens ({mixed} mixed "
          f"steps: prefill chunks and decode rows in one pool.extend forward), all equal to "
          f"greedy decoding without a cache: ok ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""An SGLang-style model runner on attnpool: a request-to-token table, decode graphs, and one
speculative round (draft steps, target verify, draft extend).

SGLang's conventions, and what attnpool takes for them:

* ``req_to_token [max_running_requests, max_context_len]`` (SGLang's ``ReqToTokenPool``): row
  ``r`` holds the KV token slot of every position of the request living in row ``r``. Every
  phase's update takes it as ``req_to_token=`` with ``req_pool_indices=`` (the rows of the batch).
* ``out_cache_loc``: where a forward's new tokens store their K/V, here the
  :class:`attnpool.KVCachePool` ``slot_mapping`` (a static buffer a captured graph reads).
* One :class:`attnpool.BufferPool` for every phase, built once; decode graphs captured per batch
  size by :class:`attnpool.graphs.GraphRunner`. On CPU each decode step runs eagerly but padded
  the same way (the update at the captured size, the real rows first), so the output shows what
  a replay reads.

The models are a toy target and a draft close to it (examples/toy_model.py), so the output can be
checked: everything generated must equal greedy decoding computed without any cache or pool.

Run: ``python examples/sglang_runner.py`` (``--device cuda`` on a GPU: captures CUDA graphs).
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

MAX_BS, CONTEXT, PAGE = 8, 128, 16
SPEC_STEPS = 2  # S draft tokens per round, chain (topk = 1) ...
NUM_DRAFT = SPEC_STEPS + 1  # ... verified with the pending token: N = S + 1 queries per request
PREFILL_TOKENS = 256  # packed prompt tokens of one prefill forward (max_extend_tokens)
TARGET, DRAFT = 0, 1  # the two models' layers in the shared KV cache pool


@dataclass
class Req:
    row: int  # its row in req_to_token (SGLang's req_pool_idx)
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # prompt + generated; the last one is pending
    cached: int = 0  # positions whose K/V both caches hold (the pending token's is not yet stored)
    pages: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, device: torch.device) -> None:
        self.dev = device
        # One pool for every phase this engine runs: sized once, allocated once.
        self.pool = BufferPool(PoolConfig(
            max_bs=MAX_BS, max_context_len=CONTEXT, page_size=PAGE, device=device,
            num_draft_tokens=NUM_DRAFT, spec_steps=SPEC_STEPS, max_extend_tokens=PREFILL_TOKENS))
        num_pages = MAX_BS * CONTEXT // PAGE + 1  # page 0 is the pad page padded rows point at
        self.kv = KVCachePool(KVCacheConfig(
            num_pages=num_pages, page_size=PAGE, max_tokens=PREFILL_TOKENS, num_layers=2,
            num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE, device=device))
        self.req_to_token = torch.zeros(MAX_BS, CONTEXT, dtype=torch.int32, device=device)
        self.free_pages = list(range(1, num_pages))
        self.free_rows = list(range(MAX_BS))
        self.target = ToyLM(seed=0, device=device)
        self.draft = ToyLM(seed=1, device=device, like=self.target, noise=0.15)
        # Capture: one graph per batch size (1, 2, 4, 8), each on pool.decode.view(bs). Warm-up
        # and capture run the stores too: every slot they read starts at -1 (skipped).
        self.kv.slot_view(MAX_BS)
        self.decode_graphs = GraphRunner(self.pool, Phase.DECODE, self._decode_forward,
                                         example=torch.zeros(1, dtype=torch.int64, device=device))

    def _decode_forward(self, view: object, tokens: Tensor) -> Tensor:
        """One decode forward: the target's logits; the draft also stores the token's K/V."""
        self.draft.forward(view, tokens, self.kv, DRAFT)
        return self.target.forward(view, tokens, self.kv, TARGET)

    # ---- engine state --------------------------------------------------------------------------
    def _reserve(self, r: Req, upto: int) -> None:
        """Give ``r`` the pages positions ``< upto`` need, written into its req_to_token row."""
        while len(r.pages) * PAGE < upto:
            page, base = self.free_pages.pop(0), len(r.pages) * PAGE
            r.pages.append(page)
            self.req_to_token[r.row, base : base + PAGE] = torch.arange(
                page * PAGE, (page + 1) * PAGE, dtype=torch.int32)

    def _ints(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.dev)

    # ---- forwards ------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]]) -> list[Req]:
        reqs = [Req(self.free_rows.pop(0), p, list(p)) for p in prompts]
        for r in reqs:
            self._reserve(r, len(r.prompt))
        lens = [len(r.prompt) for r in reqs]
        view = self.pool.extend.update_(
            len(reqs), seq_lens=self._ints(lens), extend_lens=self._ints(lens),
            req_pool_indices=self._ints([r.row for r in reqs]), req_to_token=self.req_to_token,
            seq_lens_cpu=lens, extend_lens_cpu=lens, out_slots=self.kv.slot_view(PREFILL_TOKENS))
        tokens = self._ints([t for r in reqs for t in r.prompt])
        slots = self.kv.slot_mapping[: tokens.shape[0]]  # out_slots: the prompt tokens' slots
        self.draft.forward(view, tokens, self.kv, DRAFT, slots)
        logits = self.target.forward(view, tokens, self.kv, TARGET, slots)
        last = torch.tensor(lens).cumsum(0) - 1
        for r, t in zip(reqs, logits[last.to(self.dev)].argmax(-1).tolist(), strict=True):
            r.tokens.append(t)
            r.cached = len(r.prompt)
        return reqs

    def decode(self, reqs: list[Req]) -> tuple[int, list[int]]:
        """One decode step, padded to the next captured batch size: a graph replay on CUDA, the
        same update and forward run eagerly on CPU. Returns the batch size and the
        ``cache_seqlens`` the step's attention read (padded rows included)."""
        n = len(reqs)
        for r in reqs:
            self._reserve(r, r.cached + 1)
        rows = self._ints([r.row for r in reqs])
        pos = self._ints([r.cached for r in reqs])
        bs = self.decode_graphs.padded_size(n) or n
        self.kv.update_slots_(self.req_to_token[rows, pos], bs=bs)  # out_cache_loc, -1 padded
        lens = [r.cached + 1 for r in reqs]
        tokens = self._ints([r.tokens[-1] for r in reqs])
        inputs = dict(seq_lens=self._ints(lens), req_pool_indices=rows,
                      req_to_token=self.req_to_token, seq_lens_cpu=lens)
        if self.decode_graphs.use_graphs:
            logits = self.decode_graphs.run(tokens, **inputs)
            view = self.pool.decode.view(bs)  # the bytes the replay read (no write: still valid)
        else:  # what a replay at bs does, eagerly: the update pads rows n..bs-1 (pad page, length
            # pad_seq_len), padded rows' tokens store nothing (slot -1), their logits are dropped
            view = self.pool.decode.update_(bs, **inputs)
            padded = torch.cat([tokens, tokens.new_zeros(bs - n)])
            logits = self._decode_forward(view, padded)[:n]
        for r, t in zip(reqs, logits.argmax(-1).tolist(), strict=True):
            r.tokens.append(t)
            r.cached += 1
        return bs, view.cache_seqlens.tolist()

    def speculative_round(self, reqs: list[Req]) -> list[int]:
        """Draft S tokens per request, verify them with the target in one forward, store the
        accepted ones in the draft's cache; returns how many drafts each request accepted."""
        n, steps = len(reqs), SPEC_STEPS
        for r in reqs:
            self._reserve(r, r.cached + NUM_DRAFT)
        committed = [r.cached for r in reqs]
        rows, seq = self._ints([r.row for r in reqs]), self._ints(committed)
        # Draft decode: one update writes the metadata of all S steps (one graph in SGLang).
        view = self.pool.draft.update_(n, seq_lens=seq, req_pool_indices=rows,
                                       req_to_token=self.req_to_token, seq_lens_cpu=committed)
        inp, drafts = self._ints([r.tokens[-1] for r in reqs]), []
        for d, step in enumerate(view.steps):  # step d+1 attends to seq_lens + d + 1 keys
            out_cache_loc = self.req_to_token[rows, seq + d]
            inp = self.draft.forward(step, inp, self.kv, DRAFT, out_cache_loc).argmax(-1)
            drafts.append(inp)
        # Target verify: the pending token and the S drafts, causal over seq_lens + N keys.
        vview = self.pool.verify.update_(n, seq_lens=seq, req_pool_indices=rows,
                                         req_to_token=self.req_to_token, seq_lens_cpu=committed)
        queries = torch.stack([inp.new_tensor([r.tokens[-1] for r in reqs]), *drafts], 1)
        loc = self.req_to_token[rows[:, None], seq[:, None] + torch.arange(NUM_DRAFT, device=self.dev)]
        best = self.target.forward(vview, queries.reshape(-1), self.kv, TARGET, loc.reshape(-1))
        best = best.argmax(-1).view(n, NUM_DRAFT).tolist()
        proposed = queries[:, 1:].tolist()
        accepted = []
        for r, prop, want in zip(reqs, proposed, best, strict=True):
            a = 0
            while a < steps and prop[a] == want[a]:
                a += 1
            accepted.append(a)
            r.tokens += [*prop[:a], want[a]]  # the accepted drafts, then the target's own token
        # Draft extend: the draft's cache gets the accepted tokens (the pending token + a drafts).
        acc = [a + 1 for a in accepted]
        lens = [c + a for c, a in zip(committed, acc, strict=True)]
        eview = self.pool.draft_extend.update_(
            n, seq_lens=self._ints(lens), accept_lens=self._ints(acc), req_pool_indices=rows,
            req_to_token=self.req_to_token, seq_lens_cpu=lens, accept_lens_cpu=acc)
        keep = [i * NUM_DRAFT + j for i, a in enumerate(acc) for j in range(a)]
        pick = torch.tensor(keep, device=self.dev)
        self.draft.forward(eview, queries.reshape(-1)[pick], self.kv, DRAFT, loc.reshape(-1)[pick])
        for r, length in zip(reqs, lens, strict=True):
            r.cached = length
        return accepted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--decode-steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="speculative rounds after decoding")
    a = ap.parse_args()
    dev = torch.device(a.device)
    t0 = time.perf_counter()
    runner = ModelRunner(dev)
    pool = runner.pool
    print(f"pool: {pool.nbytes} bytes in one allocation for phases "
          f"{[p.value for p in pool.phases]} (decode/verify/draft/draft_extend/extend overlay)")
    graphs = runner.decode_graphs
    print(f"decode capture sizes {graphs.capture_sizes}: "
          + ("CUDA graphs captured" if graphs.use_graphs else "no CUDA here: each step runs "
             "eagerly, padded to a captured size as a replay would be"))
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    reqs = runner.prefill(prompts)
    print(f"prefill: {len(reqs)} prompts of {[len(p) for p in prompts]} tokens through pool.extend")
    for step in range(a.decode_steps):
        bs, read = runner.decode(reqs)
        print(f"decode step {step}: {len(reqs)} requests padded to bs={bs}, cache_seqlens "
              f"{read} ({bs - len(reqs)} padded rows of length {pool.cfg.pad_seq_len} on the pad "
              f"page)")
    total = 0
    for k in range(a.rounds):
        acc = runner.speculative_round(reqs)
        total += sum(acc)
        print(f"speculative round {k}: drafted {SPEC_STEPS} per request, accepted {acc} "
              f"(+1 target token each)")
    print(f"acceptance {total / (a.rounds * SPEC_STEPS * len(reqs)):.2f}")
    for r in reqs:
        new = r.tokens[len(r.prompt):]
        want = greedy_reference(runner.target, r.prompt, len(new))
        if new != want:
            raise SystemExit(f"request {r.row}: {new} differs from greedy decoding {want}")
    print(f"all {sum(len(r.tokens) - len(r.prompt) for r in reqs)} generated tokens equal greedy "
          f"decoding without a cache: ok ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

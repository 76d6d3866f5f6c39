"""``PagedGenerator``: greedy continuous batching of a transformers model through one pool.

Per call of :meth:`PagedGenerator.generate`:

* **Admission** (FIFO): a waiting prompt joins when a ``req_to_token`` row and every KV page it
  can need are free (:class:`.paging.PageAllocator`), at most ``max_bs`` run at once and a
  prefill batch holds at most ``max_prefill_tokens`` tokens. A prompt that does not fit waits for
  running requests to finish and return their pages.
* **Prefill** of the joining prompts: one packed forward through ``pool.extend`` (queries causal
  over each request's own tokens), which also writes the new tokens' KV slots into the cache's
  slot mapping; the last token's logits give each request its first token.
* **Decode**: one forward per step for every running request through ``pool.decode``. On CUDA
  the batch is padded to the next captured size and replays that size's CUDA graph; eagerly
  (CPU, or ``cuda_graphs=False``) it runs the real rows only, since padding buys nothing without
  a graph. With a draft model, a step is one speculative round, run eagerly
  (:mod:`attnpool.integrations.transformers.spec`).
* Finished requests (``max_new_tokens`` or ``eos_token_id``) leave between steps.
* **Sliding-window layers** keep their KV in a cache of their own, addressed by
  ``window_req_to_token``: a request holds only the window pages its next step can read or
  write; the pages behind every future window go back to the free list between steps
  (:mod:`.window_paging`), so a long generation holds ``O(W)`` of them, not ``O(L)``.
* **Chunked attention layers** (Llama 4) read ``pool.local``, updated for each forward in the
  shape of its phase (decode, verify, or prefill for an extend or draft extend); such models
  run eagerly (no CUDA graphs: the decode graphs refill the decode view only).
* **Mixture-of-experts models** with transformers' ``eager`` experts run eagerly too: their
  routing has data-dependent shapes, which a CUDA graph cannot capture.

The arguments are checked and every size (pool, caches, prefill budget) derived by
:mod:`attnpool.integrations.transformers.sizing` before anything is allocated.

Host data (token lists, page ids) stays on the host; each step moves one small int64 block of
inputs (lengths, rows, ids, positions, slots) to the device, and reads back the chosen tokens.
Everything runs under ``torch.inference_mode()``: a step issues hundreds of small view and
metadata ops, and without autograd's version and view bookkeeping each costs less host time.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...adapters.backends import Backend
from ...config import Phase
from ...errors import CapacityError, InputError
from ...pool import BufferPool
from ...views import LocalView
from .model import ModelSpec, attnpool_attention_on
from .paging import PageAllocator
from .runner import DecodeGraphs, ModelRunner
from .sizing import check_int, check_prompts, size
from .spec import spec_round
from .state import GenerationStats, Request, Tables


class PagedGenerator:
    """Greedy generation of a transformers (>= 5) model whose attention metadata, KV cache and
    (optionally) speculative phases come from attnpool.

    Args:
        model: a decoder-only transformers model (Llama, Qwen2, ... : any whose attention goes
            through ``AttentionInterface``), in eval mode. It is not moved or copied; its
            attention implementation is switched to ``"attnpool"`` only while generating.
        max_bs: most requests decoded together (the pool's captured batch sizes go up to it).
        max_context_len: longest prompt + new tokens of any request.
        page_size: tokens per KV page (a power of two).
        device: ``"auto"`` (the model's device) or a device equal to it.
        draft_model: a smaller model with the same vocabulary for speculative decoding.
        num_draft_tokens: N, tokens the draft proposes per round (needs ``draft_model``); the
            target verifies them in one ``N + 1``-token forward.
        cuda_graphs: ``"auto"`` (on CUDA), True or False: replay decode steps from CUDA graphs.
            ``"auto"`` runs eagerly for chunked and mixture-of-experts models, and True is
            refused for those no graph can hold (see
            :func:`attnpool.integrations.transformers.model.graph_blocker`).
        num_pages: KV pages per cache, the pad page included (default: enough for ``max_bs``
            requests of ``max_context_len``). Fewer pages make requests wait for each other.
        max_prefill_tokens: most prompt tokens in one prefill forward (default: a batch of
            ``max_bs`` contexts, at most 8192, at least one context).
        backend: attention kernel (:class:`~attnpool.adapters.backends.Backend`).
        capture_sizes: padded batch sizes to capture (default: 1, 2, 4, 8, 16, 24, ...).
        num_window_pages: pages of the sliding-window layers' cache, the pad page included
            (models with such layers; default: every running request's steady window span, plus
            one prefill batch of prompts, at most what the full cache would take).
    """

    def __init__(
        self,
        model: Any,
        *,
        max_bs: int,
        max_context_len: int,
        page_size: int = 16,
        device: str | torch.device = "auto",
        draft_model: Any = None,
        num_draft_tokens: int = 0,
        cuda_graphs: bool | str = "auto",
        num_pages: int | None = None,
        max_prefill_tokens: int | None = None,
        backend: Backend = Backend.AUTO,
        capture_sizes: Sequence[int] | None = None,
        num_window_pages: int | None = None,
    ) -> None:
        sizing = size(model, max_bs=max_bs, max_context_len=max_context_len, page_size=page_size,
                  device=device, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                  cuda_graphs=cuda_graphs, num_pages=num_pages,
                  max_prefill_tokens=max_prefill_tokens, num_window_pages=num_window_pages)
        spec, dspec, cfg = sizing.spec, sizing.draft, sizing.pool
        pages, wpages, max_tokens = sizing.pages, sizing.window_pages, sizing.max_tokens
        self.chunk, self.max_context_len, self.num_draft_tokens = \
            sizing.chunk, max_context_len, sizing.num_draft_tokens
        self.context, self.max_prefill_tokens = sizing.context, sizing.max_prefill_tokens
        self.has_full, self.window_alloc = sizing.has_full, sizing.window_alloc
        self.pool = BufferPool(cfg)

        def runner(m: Any, ms: ModelSpec) -> ModelRunner:
            r = ModelRunner(m, ms, num_pages=pages, page_size=page_size, max_tokens=max_tokens,
                            backend=backend, window_pages=wpages)
            for kv in r.caches_used:  # one update writes pool metadata and cache slots
                kv.check_pool_config(dataclasses.replace(cfg, num_pages=kv.cfg.num_pages))
            return r

        self.target = runner(model, spec)
        self.draft = None if dspec is None else runner(draft_model, dspec)
        self.alloc = PageAllocator(pages, page_size, max_bs)
        # The engine-side request -> token-slot table, whole pages wide. Zero-filled once: a row
        # is read only up to its request's pages, which admission writes first; zeros keep any
        # stray read in the pad page.
        self.req_to_token = torch.zeros(  # ok: engine table, once
            max_bs, cfg.max_pages * page_size, dtype=torch.int32, device=spec.device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int32, device=spec.device)
        # The window layers' table: entries of pages behind the window keep stale ids (never
        # read); a request's new window pages are written as it takes them.
        self.window_req_to_token = (None if self.window_alloc is None
                                    else torch.zeros_like(self.req_to_token))  # ok: table, once
        self.tables = Tables(req_to_token=self.req_to_token,
                             window_req_to_token=self.window_req_to_token)
        self.use_graphs, self.capture_sizes = sizing.graphs, capture_sizes
        self._graphs: DecodeGraphs | None = None
        self.stats = GenerationStats()

    @property
    def device(self) -> torch.device:
        return self.target.spec.device

    # ---- public --------------------------------------------------------------------------------
    def poison_(self) -> None:
        """Fill the pool's metadata and every model's KV caches with sentinels (NaN, int
        max; pad pages re-zeroed): a debugging aid, so that a read of anything no update or
        store wrote in this run (a freed window page, a stale padded row) changes the output."""
        self.pool.poison_()
        for runner in (self.target, self.draft):
            for kv in () if runner is None else runner.caches_used:
                kv.poison_()

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: int | None = None) -> list[list[int]]:
        """Greedy new tokens for each prompt (the same tokens ``model.generate(do_sample=False)``
        gives each prompt on its own, up to floating-point ties).

        Raises:
            InputError: an empty prompt, a token outside the vocabulary, ``max_new_tokens < 1``.
            CapacityError: a prompt + ``max_new_tokens`` longer than ``max_context_len``, or
                needing more pages than the whole KV cache has.
        """
        reqs = self._requests(prompts, max_new_tokens, eos_token_id)
        self.stats = st = GenerationStats(requests=len(reqs))
        t0 = time.perf_counter()
        models = [self.target.model] + ([] if self.draft is None else [self.draft.model])
        try:
            with torch.inference_mode(), attnpool_attention_on(models):
                self._run(reqs)
        finally:  # an exception mid-run (the model's, say) must not leak pages or rows
            for r in reqs:
                self._release(r)
        st.wall_s = time.perf_counter() - t0
        st.new_tokens = sum(len(r.out) for r in reqs)
        return [r.out for r in reqs]

    def _run(self, reqs: list[Request]) -> None:
        """The scheduling loop: admit and prefill, then one decode step or speculative round."""
        if self.use_graphs and self._graphs is None:
            self._graphs = DecodeGraphs(self.target, self.pool, self.capture_sizes)
        waiting, running = deque(reqs), list[Request]()
        while waiting or running:
            joined = self._admit(waiting, len(running))
            if joined:
                self._prefill(joined)
                running = self._retire(running + joined)
            if running:
                self.stats.batch_sizes.append(len(running))
                if self.draft is None:
                    self._decode(running)
                else:
                    spec_round(self, running)
                running = self._retire(running)
            elif waiting and not joined:  # unreachable: an idle cache fits any admitted size
                raise CapacityError("no request can be admitted into an empty cache")

    # ---- requests, pages -----------------------------------------------------------------------
    def _requests(self, prompts: Sequence[Sequence[int]], max_new: int, eos: int | None
                  ) -> list[Request]:
        check_int("max_new_tokens", max_new, 1)
        if eos is not None:
            check_int("eos_token_id", eos, 0)
        if self.target.model.training:
            raise InputError("the model is in training mode; call model.eval() first")
        out = []
        for i, toks in enumerate(check_prompts(prompts, self.target.spec.vocab_size, max_new,
                                               self.max_context_len, self.max_prefill_tokens)):
            need = self._tokens_needed(len(toks), max_new)
            self.alloc.check_fits(need if self.has_full else 0)
            if self.window_alloc is not None:
                self.window_alloc.check_fits(len(toks), need)
            out.append(Request(i, toks, len(toks), max_new, eos))
        return out

    def _tokens_needed(self, prompt_len: int, max_new: int) -> int:
        """KV positions a request can ever write: its prompt and outputs except the last (never
        an input), plus the N positions a verify looks ahead."""
        return prompt_len + max_new - 1 + self.num_draft_tokens

    def _admit(self, waiting: deque[Request], running: int) -> list[Request]:
        """Pop the waiting requests that fit now (FIFO; the first that does not fit waits)."""
        joined: list[Request] = []
        budget = self.max_prefill_tokens
        while waiting and running + len(joined) < self.pool.cfg.max_bs:
            r = waiting[0]
            if r.prompt_len + 1 > budget:
                break
            need = self._tokens_needed(r.prompt_len, r.max_new)
            alloc = self.alloc.admit(need if self.has_full else 0)
            if alloc is None:
                break
            if self.window_alloc is not None:
                r.window_allocation = self.window_alloc.admit(alloc.row, r.prompt_len, need)
                if r.window_allocation is None:
                    self.alloc.release(alloc)
                    break
            waiting.popleft()
            r.alloc, budget = alloc, budget - r.prompt_len - 1
            if alloc.pages:  # the request's row of req_to_token: every position of its pages
                pages = torch.tensor(alloc.pages, dtype=torch.int32).to(self.device)
                p = self.alloc.page_size
                row = (pages[:, None] * p + self._page_offsets).view(-1)
                self.req_to_token[alloc.row, : row.shape[0]].copy_(row)
            joined.append(r)
        self._window_pages(joined, [0] * len(joined), [r.prompt_len for r in joined])
        return joined

    def _window_pages(self, reqs: Sequence[Request], first: Sequence[int],
                      end: Sequence[int]) -> None:
        """Move each request's window pages: free those no query from ``first[i]`` on can see,
        take those for positions ``< end[i]``, and write the new ones into the window table
        (one device write for all)."""
        window_alloc, table = self.window_alloc, self.window_req_to_token
        if window_alloc is None or table is None:
            return
        new = [(held.row, j, page) for r, f, e in zip(reqs, first, end, strict=True)
               if (held := r.window_allocation) is not None
               for j, page in window_alloc.advance(held, f, e)]
        if new:
            idx = torch.tensor(new, dtype=torch.int64).to(self.device)
            p = window_alloc.page_size
            table[idx[:, :1], idx[:, 1:2] * p + self._page_offsets] = \
                (idx[:, 2:] * p + self._page_offsets).to(table.dtype)

    def _pages_held(self, running: Sequence[Request]) -> None:
        st = self.stats
        st.full_pages_peak = max(st.full_pages_peak, sum(
            len(r.alloc.pages) for r in running if r.alloc is not None))
        st.window_pages_peak = max(st.window_pages_peak, sum(
            r.window_allocation.held for r in running if r.window_allocation is not None))

    def _release(self, r: Request) -> None:
        if r.alloc is not None:
            self.alloc.release(r.alloc)
            r.alloc = None
        if r.window_allocation is not None and self.window_alloc is not None:
            self.window_alloc.release(r.window_allocation)
            r.window_allocation = None

    def _retire(self, reqs: list[Request]) -> list[Request]:
        """Release finished requests' pages and rows; return the others."""
        keep = []
        for r in reqs:
            if r.done:
                self._release(r)
            else:
                keep.append(r)
        return keep

    def slots(self, r: Request, start: int, count: int) -> list[int]:
        """Full-cache token slots of positions ``start .. start + count - 1`` of ``r`` (-1 when
        no model has full-attention layers: nothing is stored there)."""
        assert r.alloc is not None  # only live requests run
        if not self.has_full:
            return [-1] * count
        return [self.alloc.slot(r.alloc, pos) for pos in range(start, start + count)]

    def window_slots(self, r: Request, start: int, count: int) -> list[int]:
        """Window-cache token slots of the same positions (empty without window layers)."""
        if self.window_alloc is None:
            return []
        held = r.window_allocation
        assert held is not None  # only live requests run
        return [self.window_alloc.slot(held, pos) for pos in range(start, start + count)]

    def step_pages(self, running: Sequence[Request]) -> None:
        """Before a step: each request's window pages cover what the step reads and writes
        (from its first query ``kv_len`` to the positions it may write, its ``lookahead``)."""
        if self.window_alloc is not None:
            ahead = self.window_alloc.lookahead
            self._window_pages(running, [r.kv_len for r in running], [
                min(r.kv_len + ahead, self._tokens_needed(r.prompt_len, r.max_new))
                for r in running])
        self._pages_held(running)

    def local(self, runner: ModelRunner, n: int, **inputs: Any) -> LocalView | None:
        """``pool.local`` updated for a forward of ``runner`` over ``n`` requests (``inputs``
        as :meth:`attnpool.phases.local.LocalPhase.update_` takes them, the request table
        added), or None when the model has no chunked layer."""
        if not runner.spec.chunked_layers:
            return None
        return self.pool.local.update_(n, req_to_token=self.req_to_token, **inputs)

    def host_block(self, rows: Sequence[Sequence[int]]) -> Tensor:
        """Equal-length int rows as one int64 tensor on the device (one copy, no-op on CPU)."""
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, runner: ModelRunner, reqs: list[Request], tokens: list[list[int]],
                prefix: list[int]) -> list[int]:
        """One packed forward of ``runner`` over ``tokens[i]`` appended to ``prefix[i]`` cached
        positions of ``reqs[i]``, through ``pool.extend`` (which also writes the new tokens' slots
        into the runner's slot mapping); return each request's argmax after its last token."""
        t0 = time.perf_counter()
        ext = [len(t) for t in tokens]
        seq = [p + e for p, e in zip(prefix, ext, strict=True)]
        rows = [r.alloc.row for r in reqs if r.alloc is not None]
        total, last, acc = sum(ext), [], 0
        for e in ext:
            acc += e
            last.append(acc - 1)
        blk = self.host_block([seq, ext, rows, last])
        ids = self.host_block([[t for ts in tokens for t in ts]])[0]
        kv, window_kv = runner.kv, runner.window_kv
        view = self.pool.extend.update_(
            len(reqs), seq_lens=blk[0], extend_lens=blk[1], req_pool_indices=blk[2],
            seq_lens_cpu=seq, extend_lens_cpu=ext, **self.tables,
            out_slots=None if kv is None else kv.slot_mapping[:total],
            window_out_slots=None if window_kv is None else window_kv.slot_mapping[:total])
        local = self.local(runner, len(reqs), seq_lens=blk[0], extend_lens=blk[1],
                           req_pool_indices=blk[2], for_phase=Phase.EXTEND, seq_lens_cpu=seq,
                           extend_lens_cpu=ext)
        ctx = runner.context(view, total, prefix_free=not any(prefix), local=local)
        self._metadata(t0)
        logits = runner.forward(ctx, ids, view.positions[:total], keep=blk[3])
        out: list[int] = logits.argmax(-1).tolist()
        return out

    def _prefill(self, joined: list[Request]) -> None:
        st = self.stats
        first = self.prefill(self.target, joined, [r.tokens for r in joined], [0] * len(joined))
        st.prefill_forwards += 1
        for r, t in zip(joined, first, strict=True):
            r.kv_len = r.prompt_len
            r.extend([t])
        if self.draft is not None:
            live = [r for r in joined if not r.done]
            if live:  # the draft reads the prompt and the first token: it proposes the next
                props = self.prefill(self.draft, live, [r.tokens for r in live], [0] * len(live))
                st.draft_forwards += 1
                for r, d in zip(live, props, strict=True):
                    r.draft_len, r.proposal = len(r.tokens), d
        if self.window_alloc is not None:  # the prompt's early pages are behind every future window
            self._window_pages(joined, [r.kv_len for r in joined], [0] * len(joined))
            for r in joined:
                if r.window_allocation is not None:
                    self.window_alloc.settle(r.window_allocation,
                                             self._tokens_needed(r.prompt_len, r.max_new))

    # ---- decode --------------------------------------------------------------------------------
    def _decode(self, running: list[Request]) -> None:
        """One greedy decode step of every running request."""
        t0 = time.perf_counter()
        n = len(running)
        self.step_pages(running)
        pos = [r.kv_len for r in running]
        wslots = [s for r in running for s in self.window_slots(r, r.kv_len, 1)]
        blk = self.host_block([
            [p + 1 for p in pos], [r.alloc.row for r in running if r.alloc is not None],
            [r.tokens[-1] for r in running], pos,
            [s for r in running for s in self.slots(r, r.kv_len, 1)], *([wslots] if wslots else [])])
        seq = [p + 1 for p in pos]
        wrow = blk[5] if wslots else None
        g = self._graphs
        if g is not None:
            self.target.set_slots(blk[4], wrow, g.padded_size(n))
            toks = g.run(blk[2:4].T, seq_lens=blk[0], req_pool_indices=blk[1], seq_lens_cpu=seq,
                         **self.tables)
            self.stats.metadata_s += g.prepared_at - t0
            self.stats.metadata_calls += 1
        else:
            self.target.set_slots(blk[4], wrow)
            view = self.pool.decode.update_(n, seq_lens=blk[0], req_pool_indices=blk[1],
                                            seq_lens_cpu=seq, **self.tables)
            local = self.local(self.target, n, seq_lens=blk[0], req_pool_indices=blk[1],
                               seq_lens_cpu=seq)
            ctx = self.target.context(view, n, local=local)
            self._metadata(t0)
            toks = self.target.forward(ctx, blk[2], blk[3]).argmax(-1)
        self.stats.decode_steps += 1
        for r, t in zip(running, toks.tolist(), strict=True):
            r.kv_len += 1
            r.extend([t])

    def _metadata(self, t0: float) -> None:
        self.stats.metadata_s += time.perf_counter() - t0
        self.stats.metadata_calls += 1

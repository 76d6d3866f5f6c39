"""The pool of an SGLang model runner and its refill from one ``ForwardBatch``, without SGLang.

SGLang's scheduler hands its attention backend one ``ForwardBatch`` per forward: the requests'
rows of the request table (``req_pool_indices`` into ``req_to_token``, each position's token
slot in the KV pool), their total lengths (``seq_lens``, with a host copy ``seq_lens_cpu``) and,
for an extend batch, the new tokens per request (``extend_seq_lens`` and its host list
``extend_seq_lens_cpu``). That is attnpool's own input convention (``req_to_token`` +
``req_pool_indices``), so the table is read directly, never copied or converted:

- a decode batch (one new token per request) is a :attr:`attnpool.BufferPool.decode` update;
- an extend batch (prefill, a chunk of a long prompt, or a mixed chunk whose decode rows extend
  by one token, ``--enable-mixed-chunk``) is a :attr:`attnpool.BufferPool.extend` update. Rows
  come in SGLang's order; a row with a cached prefix (radix cache, an earlier chunk) reads it
  from the table like every other key;
- speculative decoding's batches: a target verify (``N`` drafts per request over the committed
  ``seq_lens``, a chain or a tree with its mask) is a :attr:`attnpool.BufferPool.verify` update
  (:meth:`BatchFiller.verify`), a round of the draft model's decode steps one
  :attr:`attnpool.BufferPool.draft` update (:meth:`BatchFiller.draft`) and the draft model's
  extend after a verify a :attr:`attnpool.BufferPool.draft_extend` update
  (:meth:`BatchFiller.draft_extend`). Each draft's K/V slot is the request table's entry
  after the committed tokens, where SGLang stores it;
- an encoder-decoder model's batches (each table row: the encoder's tokens, then the
  decoder's) are a :attr:`attnpool.BufferPool.encoder` update (:meth:`BatchFiller.encoder`):
  one row per request in decode, one per new token in extend.

On a CPU the host copies SGLang already keeps are passed as the pool's host lengths: bounds are
checked, ``max_seqlen_*`` are the batch's own (the SDPA adapter gathers only live lanes) and
pages are written only as far as the longest row reaches. Once a shape's views exist, a refill
allocates nothing (the pool's arena holds every buffer; the adapter's gather plan is made per
forward by the first layer that reads a part: :class:`attnpool.adapters.binding.Run`), except
an encoder-decoder extend batch, whose per-token rows (request rows, lengths) are made for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...adapters.backends import Backend
from ...adapters.binding import Run, bind
from ...adapters.flashinfer_step import LayerFacts
from ...config import Impl
from ...errors import CapacityError, InputError, LayoutError
from ...views import DecodeView, DraftView, EncoderView, ExtendView
from ..engine import Filler, PoolSizes

#: The backend's name in SGLang's registry and on its command line.
NAME = "attnpool"
#: The environment variable that forces one adapter (``flashinfer``, ``fa3``, ``fa4``, ``fa2``,
#: ``sdpa``).
KERNEL = "ATTNPOOL_SGLANG_KERNEL"


@dataclass(frozen=True, slots=True)
class RunnerSizes:
    """What a pool is sized from, read once from SGLang's model runner when its attention
    backend is built.

    Fields:
        max_requests: rows of the request table (``req_to_token_pool.size``): no batch has
            more requests. The pool's ``max_bs``.
        max_context_len: the request table's width (``req_to_token.shape[1]``): every length a
            batch can carry. The pool's ``max_context_len``.
        max_extend_tokens: the most new tokens one extend batch packs: the pool's ``T``
            (prefill budget, chunk size or a whole prompt, plus a mixed chunk's decode rows).
        page_size: tokens per KV page (``model_runner.page_size``; 1 is SGLang's default).
        sliding_window: ``W`` keys (itself included) of the sliding-window layers, or None.
            SGLang's layers carry ``sliding_window_size = W - 1`` (the keys before the query).
        num_pages: pages of the KV pool (its ``size + page_size`` slots over ``page_size``):
            the page-id bound of the pool's checks. Page 0 holds SGLang's padding slot, the
            pool's pad page.
        device: the model runner's device.
        num_draft_tokens, topk, spec_steps: speculative decoding's ``N``, ``K`` and ``S``
            (SGLang's ``speculative_num_draft_tokens``, ``speculative_eagle_topk``,
            ``speculative_num_steps``; NGRAM's irregular tree: ``K = max(2, breadth)``, as any
            ``K > 1`` makes verify a tree); 0, 1, 0 without speculation. They enable ``pool.verify``,
            ``pool.draft_extend`` (``N > 0``) and ``pool.draft`` (``S > 0``).
        max_encoder_len: the longest encoder input of an encoder-decoder model (its tokens
            first in each request's table row): enables ``pool.encoder``
            (:meth:`BatchFiller.encoder`); 0 without.
    """

    max_requests: int
    max_context_len: int
    max_extend_tokens: int
    page_size: int
    sliding_window: int | None
    num_pages: int
    device: torch.device
    num_draft_tokens: int = 0
    topk: int = 1
    spec_steps: int = 0
    max_encoder_len: int = 0

    def pool(self) -> PoolSizes:
        """The pool's sizes (:func:`attnpool.integrations.engine.pool_config` makes its config:
        pad page 0, SGLang's padding slot's page)."""
        return PoolSizes(max_bs=self.max_requests, max_context_len=self.max_context_len,
                         max_extend_tokens=self.max_extend_tokens, page_size=self.page_size,
                         sliding_window=self.sliding_window, num_pages=self.num_pages,
                         device=self.device, num_draft_tokens=self.num_draft_tokens,
                         topk=self.topk, spec_steps=self.spec_steps,
                         max_encoder_len=self.max_encoder_len)


class BatchFiller(Filler):
    """The runner's pool and its per-forward refill (see the module doc; what it holds besides
    the sizes and ``masked``: :class:`attnpool.integrations.engine.Filler`).

    Args:
        sizes: from the model runner (:class:`RunnerSizes`).
        backend: the adapter that attends (resolved: SDPA on a CPU).
        num_heads, num_kv_heads: query and KV heads of this rank's attention layers.
        dtype: the queries' dtype (SDPA's additive masks are built for it once per forward).
        masked: the layers need the adapter's mask even for a prefill with nothing cached
            (softcapping or sinks): never take SDPA's prefix-free causal shortcut.
        facts: what every layer shares, for FlashInfer's plans (required when ``backend`` is
            FlashInfer: the pool then keeps CSR page lists, each forward's parts are planned
            when it is refilled, a captured size's decode steps on its graph wrapper).
    """

    def __init__(self, sizes: RunnerSizes, backend: Backend, num_heads: int, num_kv_heads: int,
                 dtype: torch.dtype, masked: bool = False,
                 facts: LayerFacts | None = None) -> None:
        super().__init__(sizes.pool(), backend, num_heads, num_kv_heads, dtype, facts)
        self.sizes, self.masked = sizes, masked
        #: per captured size, the real-row count a recorded refill reads (:meth:`replay`)
        self._real: dict[int, Tensor] = {}

    def fill(self, *, decode: bool, req_pool_indices: Tensor, req_to_token: Tensor,
             seq_lens: Tensor, seq_lens_cpu: Tensor | None, num_tokens: int,
             extend_seq_lens: Tensor | None = None,
             extend_seq_lens_cpu: Sequence[int] | None = None,
             extend_prefix_lens_cpu: Sequence[int] | None = None) -> Run:
        """Refill the pool from one forward's batch and bind the adapter call every layer of
        the forward makes.

        Args:
            decode: a decode batch (one query per request), else an extend batch.
            req_pool_indices, req_to_token, seq_lens, seq_lens_cpu: the batch's fields
                (``seq_lens_cpu``: SGLang's host copy; on CUDA pass None, no host read).
            num_tokens: query rows the layers will pass (the batch's new tokens).
            extend_seq_lens, extend_seq_lens_cpu, extend_prefix_lens_cpu: an extend batch's
                new tokens per request (device and host) and cached prefix lengths (host; all 0
                and no mask needed: SDPA's own causal mask serves the forward).

        Raises:
            CapacityError: more requests or new tokens than the pool was sized for.
            InputError: an extend batch without its new-token counts.
        """
        n = seq_lens.shape[0]
        if n > self.sizes.max_requests or num_tokens > self.sizes.max_extend_tokens:
            raise CapacityError(f"a batch of {n} requests and {num_tokens} new tokens is past "
                                f"the pool's max_requests={self.sizes.max_requests}, "
                                f"max_extend_tokens={self.sizes.max_extend_tokens}")
        host = seq_lens_cpu if self.host else None
        view: DecodeView | ExtendView
        prefix_free = False
        if decode:
            view = self.pool.decode.update_(n, seq_lens=seq_lens,
                                            req_pool_indices=req_pool_indices,
                                            req_to_token=req_to_token, seq_lens_cpu=host)
        else:
            if extend_seq_lens is None:
                raise InputError("an extend batch needs extend_seq_lens (new tokens per "
                                 "request), got None")
            view = self.pool.extend.update_(
                n, seq_lens=seq_lens, extend_lens=extend_seq_lens,
                req_pool_indices=req_pool_indices, req_to_token=req_to_token,
                seq_lens_cpu=host, extend_lens_cpu=extend_seq_lens_cpu if self.host else None)
            prefix_free = (not self.masked and extend_prefix_lens_cpu is not None
                           and not any(extend_prefix_lens_cpu))
        return self.bind(view, num_tokens, prefix_free=prefix_free)

    def _check_requests(self, n: int, tokens: int) -> None:
        if n > self.sizes.max_requests:
            raise CapacityError(f"a batch of {n} requests ({tokens} query rows) is past the "
                                f"pool's max_requests={self.sizes.max_requests}")

    def verify(self, *, req_pool_indices: Tensor, req_to_token: Tensor, seq_lens: Tensor,
               seq_lens_cpu: Tensor | None, tree_mask: Tensor | None) -> Run:
        """Refill ``pool.verify`` from a target-verify batch (SGLang's ``TARGET_VERIFY``) and
        bind the layers' call: ``N`` query rows per request, request after request.

        Args:
            seq_lens, seq_lens_cpu: the committed lengths (SGLang's ``forward_batch.seq_lens``
                of a verify batch: the drafts not included); the drafts' K/V slots are
                ``req_to_token[r, seq_len .. seq_len + N - 1]``.
            tree_mask: ``[n, N, N]`` bool (a tree pool: ``topk > 1`` or NGRAM), row ``j`` the
                drafts draft ``j`` sees (its ancestors and itself); None for a chain.
        """
        n, nd = seq_lens.shape[0], self.pool.cfg.num_draft_tokens
        self._check_requests(n, n * nd)
        view = self.pool.verify.update_(n, seq_lens=seq_lens, tree_mask=tree_mask,
                                        req_pool_indices=req_pool_indices,
                                        req_to_token=req_to_token,
                                        seq_lens_cpu=seq_lens_cpu if self.host else None)
        return bind(self.backend, view, n * nd, self.num_heads, self.num_kv_heads, self.dtype)

    def draft(self, *, req_pool_indices: Tensor, req_to_token: Tensor, seq_lens: Tensor,
              seq_lens_cpu: Tensor | None, out_cache_loc: Tensor | None) -> list[Run]:
        """Refill ``pool.draft`` for one speculative round of the draft model and bind one
        call per draft decode step SGLang runs (``S - 1`` of them: the round's first draft
        token comes from the draft extend before it, so SGLang's step ``i`` is the pool's step
        ``d = i + 1``, reading ``seq_len + i + 1`` keys).

        Args:
            seq_lens, seq_lens_cpu: the committed lengths before the round.
            out_cache_loc: tree rounds (``topk > 1``): the round's draft slots as SGLang lays
                them out, ``[n * K * S]`` in request, branch, step order (branch ``k`` of
                request ``r`` owns ``req_to_token[r, seq_len + k*S .. seq_len + (k+1)*S - 1]``);
                passed to the pool as ``[n, S, K]``. None for a chain (its slots are read from
                the request table, ``req_to_token[r, seq_len + d - 1]`` at step ``d``).

        Each step's query rows are ``n * K``, request-major (branch ``k`` of request ``r`` at
        row ``r*K + k``).
        """
        cfg = self.pool.cfg
        n, k, steps = seq_lens.shape[0], cfg.topk, cfg.spec_steps
        self._check_requests(n, n * k)
        loc = None
        if k > 1:
            if out_cache_loc is None:
                raise InputError("a tree draft round needs its out_cache_loc, got None")
            loc = out_cache_loc.view(n, k, steps).transpose(1, 2)
        view: DraftView = self.pool.draft.update_(
            n, seq_lens=seq_lens, out_cache_loc=loc, req_pool_indices=req_pool_indices,
            req_to_token=req_to_token, seq_lens_cpu=seq_lens_cpu if self.host else None)
        return [bind(self.backend, step, n * k, self.num_heads, self.num_kv_heads, self.dtype)
                for step in view.steps[:steps - 1]]

    def draft_extend(self, *, req_pool_indices: Tensor, req_to_token: Tensor,
                     seq_lens: Tensor, seq_lens_cpu: Tensor | None, extend_seq_lens: Tensor,
                     extend_seq_lens_cpu: Sequence[int] | None, num_tokens: int) -> Run:
        """Refill ``pool.draft_extend`` from the draft model's extend after a verify
        (SGLang's ``DRAFT_EXTEND_V2``) and bind the layers' call.

        Request ``i`` runs ``extend_seq_lens[i]`` queries (1..N; SGLang's v2 worker runs all
        ``N`` verified positions), causally, over ``seq_lens[i]`` keys that include them: the
        draft extend phase's own semantics (``accept_lens`` queries over ``seq_lens``), read
        from the request table like every other phase.
        """
        n = seq_lens.shape[0]
        self._check_requests(n, num_tokens)
        view = self.pool.draft_extend.update_(
            n, seq_lens=seq_lens, accept_lens=extend_seq_lens,
            accept_lens_cpu=extend_seq_lens_cpu if self.host else None,
            req_pool_indices=req_pool_indices, req_to_token=req_to_token,
            seq_lens_cpu=seq_lens_cpu if self.host else None)
        return bind(self.backend, view, num_tokens, self.num_heads, self.num_kv_heads,
                    self.dtype)

    def encoder(self, *, req_pool_indices: Tensor, req_to_token: Tensor, seq_lens: Tensor,
                seq_lens_cpu: Tensor | None, encoder_lens: Tensor,
                encoder_lens_cpu: Sequence[int], extend_seq_lens: Tensor | None = None,
                extend_seq_lens_cpu: Sequence[int] | None = None) -> tuple[Run, Run]:
        """Refill ``pool.encoder`` from an encoder-decoder model's batch and bind the calls of
        its decoder layers and of its cross layers: ``(decoder, cross)``.

        Each request's table row holds its ``encoder_lens[i]`` encoder tokens first, then its
        ``seq_lens[i]`` decoder tokens (SGLang's layout; ``seq_lens`` counts decoder tokens
        only). The encoder phase's rows have one query each: a decode batch is one row per
        request; an extend batch (``extend_seq_lens``: new decoder tokens per request) one row
        per new token, token ``j`` of ``q`` new ones a decode row of ``seq_lens[i] - q + j +
        1`` decoder keys, which is causal attention over the request's prefix and the tokens
        before it, exactly; its cross row sees all the request's encoder tokens (cross
        attention is not causal). Rows are request-major, token order: the packed queries'
        order. So the phase's ``max_bs`` must cover an extend batch's new tokens.

        Raises:
            CapacityError: more rows than the pool has.
            InputError: an extend batch without its host new-token counts.
        """
        rows, enc_cpu = seq_lens.shape[0], list(encoder_lens_cpu)
        dec_cpu = seq_lens_cpu
        if extend_seq_lens is not None:
            if extend_seq_lens_cpu is None:
                raise InputError("an encoder-decoder extend batch needs extend_seq_lens_cpu "
                                 "(new tokens per request, host), got None")
            q = torch.as_tensor(list(extend_seq_lens_cpu), dtype=torch.int64)
            rows = int(q.sum())
            self._check_rows(rows)
            dev = seq_lens.device
            ends = torch.repeat_interleave(seq_lens, extend_seq_lens, output_size=rows)
            # each token's place from its request's end: q - 1 .. 0
            back = (torch.repeat_interleave(torch.cumsum(q, 0), q, output_size=rows)
                    - torch.arange(1, rows + 1))
            seq_lens = ends - back.to(dev)
            req_pool_indices = torch.repeat_interleave(req_pool_indices, extend_seq_lens,
                                                       output_size=rows)
            encoder_lens = torch.repeat_interleave(encoder_lens, extend_seq_lens,
                                                   output_size=rows)
            enc_cpu = torch.repeat_interleave(torch.as_tensor(enc_cpu), q).tolist()
            dec_cpu = None if seq_lens_cpu is None else (
                torch.repeat_interleave(seq_lens_cpu.to(torch.int64), q) - back)
        self._check_rows(rows)
        view: EncoderView = self.pool.encoder.update_(
            rows, seq_lens=seq_lens, encoder_lens=encoder_lens,
            encoder_lens_cpu=enc_cpu if self.host else None,
            req_pool_indices=req_pool_indices, req_to_token=req_to_token,
            seq_lens_cpu=dec_cpu if self.host else None)
        heads, kv_heads, dtype = self.num_heads, self.num_kv_heads, self.dtype
        return (bind(self.backend, view.decoder, rows, heads, kv_heads, dtype),
                bind(self.backend, view.cross, rows, heads, kv_heads, dtype))

    def _check_rows(self, rows: int) -> None:
        if rows > self.pool.cfg.max_bs:
            raise CapacityError(f"an encoder-decoder batch of {rows} query rows is past the "
                                f"pool's max_bs={self.pool.cfg.max_bs}")

    def capture(self, bs: int) -> Run:
        """The adapter call a decode CUDA graph of ``bs`` rows captures: bound to
        ``pool.decode.view(bs)``, whose tensors every later :meth:`replay` refills in place
        (the addresses the graph bakes in) and whose host bounds are the static ones
        (``max_seqlen_k = C``), which a replay keeps. FlashInfer: ``bs`` becomes a captured
        size, whose graph wrapper (on the pool's CSR buffers) is built and planned here, before
        the capture, and planned again by every :meth:`replay`."""
        if self.plans is not None:
            self.plans.capture_size(bs)
        return self.bind(self.pool.decode.view(bs), bs)

    @property
    def recordable(self) -> bool:
        """Whether the decode refill can be recorded in a CUDA graph: the fused path, and no
        FlashInfer plan to make on the host after it."""
        return self.pool.decode.impl is Impl.TRITON and self.plans is None

    def replay(self, bs: int, *, req_pool_indices: Tensor, req_to_token: Tensor,
               seq_lens: Tensor, recorded: bool = False) -> DecodeView:
        """Refill the captured ``bs``-row decode view from SGLang's graph inputs: all ``bs``
        rows, the padded ones with the fill value the backend declares (``pad_seq_len``) and
        an in-range request row. No host copy is passed, so nothing is read back from the
        device and the view keeps the capture's static bounds.

        ``recorded``: the capturable update (``num_real``, the fused path), to be recorded
        inside the graph (SGLang's ``init_forward_metadata_in_graph``): every replay then
        refills the view from the graph's input buffers by itself. Otherwise an ordinary
        update, run before each replay (with FlashInfer, followed by the plan of the size's
        graph wrapper: host work a recorded refill could not be followed by)."""
        real = None
        if recorded and self.plans is not None:
            raise LayoutError("a recorded refill cannot be followed by FlashInfer's plan "
                              "(host work): refill before each replay instead")
        if recorded:
            real = self._real.get(bs)
            if real is None:  # one [1] count per captured size, made at capture time
                real = self._real[bs] = torch.full((1,), bs, dtype=torch.int32,
                                                   device=self.sizes.device)
        view = self.pool.decode.update_(bs, seq_lens=seq_lens[:bs],
                                        req_pool_indices=req_pool_indices[:bs],
                                        req_to_token=req_to_token, num_real=real)
        if self.plans is not None:
            self.plans.prepare(view)
        return view


def kv_pages(buffer: Tensor, page_size: int) -> Tensor:
    """One layer's key or value buffer of SGLang's KV pool, ``[slots, H_kv, D]`` with token
    slot ``s`` at row ``s``, seen as pages ``[slots / P, P, H_kv, D]`` (page ``s // P``, offset
    ``s % P``): the adapters' cache shape, never a copy (SGLang writes new K/V into the
    buffer itself, and a captured graph would bake its address).

    Raises:
        InputError: the buffer is not ``[slots, H_kv, D]`` with rows back to back and a slot
            count divisible by ``page_size``.
    """
    slots = buffer.shape[0] if buffer.dim() == 3 else -1
    if (slots < 0 or slots % page_size or buffer.stride(2) != 1
            or buffer.stride(1) != buffer.shape[2] or buffer.stride(0) != buffer.shape[1] *
            buffer.shape[2]):
        raise InputError(f"an SGLang KV buffer must be [slots, H_kv, D], contiguous, slots "
                         f"divisible by page_size={page_size}; got {tuple(buffer.shape)} with "
                         f"strides {buffer.stride()}")
    return buffer.view(slots // page_size, page_size, buffer.shape[1], buffer.shape[2])

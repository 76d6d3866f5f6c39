"""One KV-cache group's pool and its per-step refill from vLLM's batch, without vLLM itself.

vLLM's model runner builds a ``CommonAttentionMetadata`` per step and KV-cache group (layers of
one cache spec: the full layers, or the sliding-window ones) and asks that group's metadata
builder for what its layers read. attnpool's builder (:mod:`.backend`) owns one
:class:`StepFiller` per group: a :class:`attnpool.BufferPool` sized once from vLLM's config
(:meth:`EngineSizes.pool`; the pool, plans and layer facts every engine filler holds:
:mod:`attnpool.integrations.engine`) and a few staging buffers, and :meth:`StepFiller.fill`
refills the pool's views in place from vLLM's tensors, with vLLM's block table read directly
(``block_table=``).

**Mixed batches.** vLLM's scheduler puts prefill chunks and decode rows in one forward, in any
order. Every such batch is one :attr:`attnpool.BufferPool.extend` update: a decode row is an
extend row with one new token (``extend_lens = query_start_loc[1:] - query_start_loc[:-1]``,
``seq_lens`` its whole length), so no reordering is needed and every layer reads one
:class:`attnpool.ExtendView`. A batch in which every row has one query (``max_query_len == 1``)
is a :attr:`attnpool.BufferPool.decode` update instead: the shape CUDA graphs capture per batch
size, and the cheaper SDPA path on a CPU. The phases overlay the same bytes; a step's
metadata is read by that step's forward before the next step is built (vLLM builds and runs
steps in order on one stream), which is the overlay's contract.

**Speculative verify.** With speculative decoding (``speculative_config``, ``k`` draft tokens),
a step in which every request runs ``N = 1 + k`` queries (the last sampled token and its
``k`` drafts) is a :attr:`attnpool.BufferPool.verify` update (a chain: one causal pass of
``N`` query rows per request over its committed prefix ``seq_lens - N``): the shape vLLM's
runner calls a uniform decode batch (:func:`uniform_verify`: ``max_query_len == N`` and
``num_actual_tokens == N * num_reqs``), the one a ``UNIFORM_BATCH`` CUDA graph replays. Every
other speculative step (requests with fewer drafts, prefill chunks beside verify rows) stays
an extend update: a verify row is an extend row of ``N`` new tokens, so both give the same
attention. vLLM's drafter model (``method="draft_model"``) builds its own group's metadata
through the same builder, so its steps follow the same rule.

**Per step, nothing is allocated** once the pool's views for a shape exist: the query lengths are
computed into a staging buffer (:func:`query_lens_`), the host copies vLLM already keeps on a CPU
are passed as the pool's host lengths (tight ``max_seqlen_*``: the SDPA adapter gathers only live
lanes), and each token's cache block and offset for the K/V store are computed once per step into
two more staging buffers (:func:`attnpool.integrations.vllm.cache.slot_index_`). On CUDA no host
copy is passed (no sync): views keep static bounds, which the kernels bound by tensors.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from ...adapters.backends import Backend
from ...adapters.binding import Run, bind
from ...adapters.flashinfer_step import LayerFacts
from ...errors import CapacityError, LayoutError
from ...update import host
from ...views import DecodeView, ExtendView, PagedView, VerifyView
from ..engine import Filler, PoolSizes
from .cache import slot_index_
from .cpu_kernel import CPUKernel, KernelStep
from .decode_cpu import BlockPlan, plan_blocks
from .served import Kind, corrupting, counts_from_env


@dataclass(frozen=True, slots=True)
class EngineSizes:
    """What a pool is sized from, read once from vLLM's config when the engine starts.

    Fields:
        max_num_seqs: requests in one step (``scheduler_config.max_num_seqs``): ``max_bs``.
        max_num_batched_tokens: tokens in one step (``scheduler_config``): the extend phase's
            packed query capacity ``T`` and the store's token capacity.
        max_model_len: the longest sequence (``model_config.max_model_len``):
            ``max_context_len``.
        block_size: tokens per KV block of this group (``kv_cache_spec.block_size``).
        sliding_window: ``W`` shared by the group's sliding-window layers, or None.
        num_blocks: blocks of the group's cache when known (``cache_config.num_gpu_blocks``):
            the page-id bound of the pool's checks.
        device: the engine's device.
        num_draft_tokens: ``N = 1 + num_speculative_tokens`` query rows of a verify step
            with speculative decoding (the pool's verify phase), else 0 (no verify phase).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    sliding_window: int | None
    num_blocks: int | None
    device: torch.device
    num_draft_tokens: int = 0

    def pool(self, window_part: bool = True) -> PoolSizes:
        """The pool's sizes (:func:`attnpool.integrations.engine.pool_config` makes its config:
        pad page 0, vLLM's null block); ``window_part=False``: no window part (vLLM's CPU
        kernel applies each layer's window over the full part itself)."""
        return PoolSizes(max_bs=self.max_num_seqs, max_context_len=self.max_model_len,
                         max_extend_tokens=self.max_num_batched_tokens,
                         page_size=self.block_size,
                         sliding_window=self.sliding_window if window_part else None,
                         num_pages=self.num_blocks, device=self.device,
                         num_draft_tokens=self.num_draft_tokens)


def uniform_verify(num_reqs: int, num_actual_tokens: int, max_query_len: int,
                   num_draft_tokens: int) -> bool:
    """Whether a step is a uniform verify batch: every one of its ``num_reqs`` requests runs
    ``N = num_draft_tokens`` queries (``N > 1``). vLLM's runner calls the same batches uniform
    decode batches (a longest query of ``1 + num_speculative_tokens`` and that many tokens per
    request), the ones a ``UNIFORM_BATCH`` CUDA graph replays: the rule must be the runner's,
    so that a graph captured over the verify view is refilled through it at every replay. Host
    ints only (no read of a device tensor)."""
    return (num_draft_tokens > 1 and max_query_len == num_draft_tokens
            and num_actual_tokens == num_draft_tokens * num_reqs)


def query_lens_(query_start_loc: Tensor, out: Tensor) -> Tensor:
    """``out[i] = query_start_loc[i + 1] - query_start_loc[i]`` for the ``n = len(out)`` rows
    of a step (vLLM's packed query offsets to each request's query length), one torch op into
    ``out`` (a staging buffer: nothing allocated); ``query_start_loc`` has ``>= n + 1`` rows.

    ``torch.diff`` when ``query_start_loc`` has exactly ``n + 1`` rows, else ``torch.sub`` of
    its two shifted slices: measured with ``timeit`` on a CPU (int32, one thread, torch 2.13,
    the best of 7 x 20,000 calls), ``diff`` of the exact tensor 2.9-3.0 us for 1, 8 and 64
    rows, ``sub`` of the two slices 3.7 us, and ``diff`` of a taller tensor's first ``n + 1``
    rows 4.3-4.4 us (its slice is a dispatched op of its own)."""
    n = out.shape[0]
    if query_start_loc.shape[0] == n + 1:
        return torch.diff(query_start_loc, out=out)
    return torch.sub(query_start_loc[1:n + 1], query_start_loc[:n], out=out)


@dataclass(slots=True)
class StepMetadata:
    """What every layer of a group reads in one step (vLLM's ``attn_metadata`` for the group).

    Not frozen, for one field: vLLM's cross-attention builder (a subclass of the group's
    builder, :mod:`vllm.model_executor.layers.attention.cross_attention`) sets
    ``slot_mapping`` on the metadata :meth:`StepFiller.fill` returns, and its layers store the
    encoder's K/V there. Nothing of attnpool's changes a field after ``fill``.

    Fields:
        view: the refilled :class:`attnpool.DecodeView`, :class:`attnpool.ExtendView` or
            (a uniform speculative verify step) chain :class:`attnpool.VerifyView`.
        run: the adapter call bound to ``view`` for every layer of the step (SDPA plans are
            computed by the first layer that reads a part and reused by the others); None
            when vLLM's kernel attends (``kernel``).
        blocks, offsets: ``[num_tokens]`` int64 views of staging buffers: each new token's
            cache block and offset (padded tokens: block 0, vLLM's null block); empty when
            vLLM's kernel attends (its store op takes the slots themselves).
        num_actual_tokens: the step's real query tokens (rows of ``query`` past it are
            vLLM's padding).
        kernel: vLLM's CPU kernel's inputs for this step (:mod:`.cpu_kernel`), when the
            group attends with it; else None (attnpool's torch paths).
        encoder_cache, encoder_slots: an encoder-only step's scratch cache and each token's
            slot in it (:mod:`.encoder_only`), else None.
        block_plans: the CPU decode path's per-part plans (:mod:`.decode_cpu`), made by the
            first layer that reads a part and reused by the step's other layers (None until
            then: no dict is made for a step that never needs one).
        slot_mapping: ``[tokens]`` the encoder tokens' cache slots of a cross-attention step,
            set by vLLM's cross-attention builder (see above); None otherwise.
    """

    view: DecodeView | ExtendView | VerifyView
    run: Run | None
    blocks: Tensor
    offsets: Tensor
    num_actual_tokens: int
    kernel: KernelStep | None = None
    encoder_cache: Tensor | None = None
    encoder_slots: Tensor | None = None
    block_plans: dict[tuple[int, int], BlockPlan] | None = None
    slot_mapping: Tensor | None = None

    def block_plan(self, part: PagedView, num_kv_heads: int) -> BlockPlan:
        """The :class:`~.decode_cpu.BlockPlan` of ``part`` (this step's decode view or its
        window part), computed once per step."""
        key = (id(part), num_kv_heads)  # the view holds its parts for the step: ids stay unique
        plans = self.block_plans
        if plans is None:
            plans = self.block_plans = {}
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = plan_blocks(part, part.bs, num_kv_heads)
        return plan


def kernel_metadata(none: Tensor) -> Callable[[DecodeView | ExtendView | VerifyView, int,
                                                KernelStep], StepMetadata]:
    """``make(view, num_actual_tokens, kernel_step)``: a step's :class:`StepMetadata` when
    vLLM's kernel attends (no run, ``none`` for the block/offset pair). Where the host route's
    C module is built it is a copy of one template with those three fields set, made in one C
    call (``with_slots``): the dataclass's ``__init__`` is a Python frame of ten stores, which
    cost 2.5 us of a 30 us build on the caches a forward leaves; else the constructor."""
    module = host.load()
    if module is None:
        return lambda view, tokens, step: StepMetadata(view, None, none, none, tokens, step)
    template = StepMetadata(None, None, none, none, 0)  # type: ignore[arg-type]
    offsets = struct.pack("<3q", *(module.slot_offset(getattr(StepMetadata, name))
                                   for name in ("view", "num_actual_tokens", "kernel")))
    return partial(module.with_slots, template, offsets)


class StepFiller(Filler):
    """One KV-cache group's pool, staging buffers and per-step refill (see the module doc)."""

    def __init__(self, sizes: EngineSizes, backend: Backend, num_heads: int, num_kv_heads: int,
                 dtype: torch.dtype, window_part: bool = True,
                 facts: LayerFacts | None = None) -> None:
        """``window_part``: give the pool the window part of ``sizes.sliding_window`` (False
        when vLLM's CPU kernel attends: it applies each layer's window over the full part).
        ``facts``: what every layer shares, for FlashInfer's plans (required when ``backend``
        is FlashInfer: the pool then keeps CSR page lists, and each step's parts are planned
        in :meth:`fill`)."""
        super().__init__(sizes.pool(window_part), backend, num_heads, num_kv_heads, dtype,
                         facts)
        self.sizes = sizes
        #: the pool's two phases, looked up once (``pool.decode`` is a checked lookup), and
        #: their ``host_step`` calls (a CPU pool's refill from host tensors)
        self._decode, self._extend = self.pool.decode, self.pool.extend
        self._decode_step = self._decode.host_step
        #: the extend step reading vLLM's query offsets itself (the C step), else None: the
        #: query lengths are made into staging first (:func:`query_lens_`)
        self._extend_offsets = (self._extend.host_step_offsets
                                if self.host and self._extend.host_route else None)
        #: the verify phase and its ``N`` with speculative decoding, else None and 0
        self._nd = sizes.num_draft_tokens
        self._verify = self.pool.verify if self._nd else None
        if self.host:  # (the first step of each size: no slicing in a build)
            for phase in (self._decode, self._extend, self._verify):
                if phase is not None:
                    phase.prepare_views(range(1, sizes.max_num_seqs + 1))
        self._caps = (sizes.max_num_seqs, sizes.max_num_batched_tokens)
        dev, t = sizes.device, sizes.max_num_batched_tokens
        # staging, allocated once: query lengths, each token's block and offset
        self._q_lens = torch.empty(sizes.max_num_seqs, dtype=torch.int32, device=dev)
        #: its first n rows for every n (a slice per step is a dispatched op)
        self._q_rows = [self._q_lens[:k] for k in range(sizes.max_num_seqs + 1)]
        self._blocks = torch.empty(t, dtype=torch.int64, device=dev)
        self._offsets = torch.empty(t, dtype=torch.int64, device=dev)
        self._none = self._blocks[:0]  # (no block/offset pair: vLLM's kernel stores by slot)
        #: a kernel step's metadata (:func:`kernel_metadata`)
        self._kernel_md = kernel_metadata(self._none)
        #: a verify step's committed lengths (``seq_lens - N``), and their first n rows
        self._committed = torch.empty(sizes.max_num_seqs if self._nd else 0, dtype=torch.int32,
                                      device=dev)
        self._committed_rows = [self._committed[:k] for k in range(self._committed.shape[0] + 1)]
        #: refill counts per phase (:mod:`.served`: only when asked for), and the test hook
        self.served = counts_from_env()
        self._corrupt = corrupting()
        #: vLLM's CPU kernel, when the group attends with it (set by the builder)
        self.kernel: CPUKernel | None = None
        #: every batch an extend update, one-query rows included (set by the builder in vLLM's
        #: FULL graph mode: one graph per size serves decode and mixed batches alike, so the
        #: phase a replay reads must not depend on the batch; :func:`mixed_graphs`)
        self.one_phase = False

    def fill(self, *, num_reqs: int, num_actual_tokens: int, max_query_len: int,
             query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
             slot_mapping: Tensor) -> StepMetadata:
        """Refill the pool from one step of vLLM's batch (``CommonAttentionMetadata``'s
        fields: ``query_start_loc [>= num_reqs + 1]``, ``seq_lens [>= num_reqs]``,
        ``block_table [>= num_reqs, >= max_pages]``, ``slot_mapping [num_tokens]``): the
        keyword form of :meth:`step`."""
        return self.step(num_reqs, num_actual_tokens, max_query_len, query_start_loc, seq_lens,
                         block_table, slot_mapping)

    def step(self, num_reqs: int, num_actual_tokens: int, max_query_len: int,
             query_start_loc: Tensor, seq_lens: Tensor, block_table: Tensor,
             slot_mapping: Tensor) -> StepMetadata:
        """:meth:`fill` with positional arguments, in its order: the builder's call, once per
        step and group (keywords cost a step more than the Python frame they name).

        This is the builder's whole per-step cost, run between two forwards: inputs vLLM
        already sliced to the step's rows are not sliced again, and with vLLM's kernel
        attending no adapter call is bound (the kernel reads the pool's buffers itself).

        On a CPU, vLLM's lengths are host tensors: the phase's ``host_step`` takes them as the
        view's host lengths too (``update_(n, seq_lens=..., block_table=...,
        seq_lens_cpu=seq_lens)``, extend: with ``extend_lens_cpu`` the query lengths), with
        ``seq_lens`` cut to ``n`` rows and the block table as vLLM hands it (its first ``n``
        rows are read). On CUDA ``update_`` with no host copy (no sync)."""
        n, (max_seqs, max_tokens) = num_reqs, self._caps
        # (slots: staging the store reads, checked before any write; vLLM's kernel stores by
        # slot itself, so with it attending nothing reads their count)
        if n > max_seqs or num_actual_tokens > max_tokens or (
                self.kernel is None and slot_mapping.shape[0] > max_tokens):
            raise CapacityError(f"a step of {n} requests, {num_actual_tokens} tokens and "
                                f"{slot_mapping.shape[0]} slots is past the pool's "
                                f"max_num_seqs={max_seqs}, max_num_batched_tokens={max_tokens} "
                                "(nothing written)")
        extend = max_query_len != 1 or self.one_phase
        # (shape[0]: a third of len()'s cost, which is a Python method of torch.Tensor)
        lens = seq_lens if seq_lens.shape[0] == n else seq_lens[:n]
        if (extend and self._verify is not None and not self.one_phase
                and uniform_verify(n, num_actual_tokens, max_query_len, self._nd)):
            verified = self._verify_step(n, lens, block_table)
            if verified is not None:
                return self._verify_metadata(verified, n, num_actual_tokens, slot_mapping)
        view: DecodeView | ExtendView
        if self.host:  # (vLLM's lengths are their own host copies)
            if not extend:
                view = self._decode_step(n, lens, block_table)
            elif self._extend_offsets is not None:  # (the C step reads vLLM's query offsets
                # itself: no op makes the lengths, which would be the step's first op)
                view = self._extend_offsets(n, lens, query_start_loc, block_table)
            else:
                view = self._extend.host_step(n, lens, query_lens_(query_start_loc,
                                                                   self._q_rows[n]), block_table)
        else:
            q_lens = query_lens_(query_start_loc, self._q_rows[n]) if extend else None
            table = block_table if block_table.shape[0] == n else block_table[:n]
            view = (self._decode.update_(n, seq_lens=lens, block_table=table)
                    if q_lens is None else
                    self._extend.update_(n, seq_lens=lens, extend_lens=q_lens,
                                         block_table=table))
        if self.served is not None:
            self.served.count(Kind.EXTEND if extend else Kind.DECODE)
        if self.kernel is not None:  # vLLM's kernel stores by slot itself: no block/offset pair
            return self._kernel_md(view, num_actual_tokens, self.kernel.step(view, n))
        return self._slot_metadata(view, self.bind(view, num_actual_tokens), num_actual_tokens,
                                   slot_mapping)

    def _slot_metadata(self, view: DecodeView | ExtendView | VerifyView, run: Run,
                       num_actual_tokens: int, slot_mapping: Tensor) -> StepMetadata:
        """The metadata of a step attended through ``run``: each new token's block and
        offset written to staging from ``slot_mapping`` (attnpool's store reads them; vLLM's
        kernel stores by slot itself and needs neither). :meth:`step` checked the count."""
        tokens = slot_mapping.shape[0]
        slot_index_(slot_mapping, self.sizes.block_size, self._blocks, self._offsets)
        return StepMetadata(view, run, self._blocks[:tokens], self._offsets[:tokens],
                            num_actual_tokens)

    def _verify_step(self, n: int, lens: Tensor, block_table: Tensor) -> VerifyView | None:
        """The verify update of a uniform verify step (:func:`uniform_verify`): the committed
        lengths ``seq_lens - N`` go to a staging buffer (vLLM's ``seq_lens`` count the step's
        ``N`` new tokens; the view's ``cache_seqlens`` adds them back). On a CPU they are also
        the view's host lengths, and a step with a request that has nothing committed (a new
        prompt of exactly ``N`` tokens) returns None: the extend update serves it (the verify
        phase reads a cached prefix of at least one token). On CUDA no host copy is read
        (no sync): such a row's committed length 0 gives ``cache_seqlens = N``, its whole
        prompt, which is what attention reads (the update's host range check needs the host
        copy), and the step keeps the phase vLLM's uniform-batch graph replays."""
        verify = self._verify
        if verify is None:
            raise LayoutError("a verify step needs the pool's verify phase (num_draft_tokens)")
        committed = torch.sub(lens, self._nd, out=self._committed_rows[n])
        table = block_table if block_table.shape[0] == n else block_table[:n]
        if not self.host:
            return verify.update_(n, seq_lens=committed, block_table=table)
        if int(committed.min()) < 1:
            return None
        return verify.update_(n, seq_lens=committed, block_table=table, seq_lens_cpu=committed)

    def _verify_metadata(self, view: VerifyView, n: int, num_actual_tokens: int,
                         slot_mapping: Tensor) -> StepMetadata:
        """A verify step's metadata: vLLM's kernel reads the chain's one causal pass
        (``view.prefix``); the adapters take the view itself (its window part included)."""
        if self.served is not None:
            self.served.count(Kind.VERIFY)
        if self._corrupt:  # (the tests' negative control: .served)
            view.prefix.cache_seqlens[0] -= 1
        if self.kernel is not None:
            return self._kernel_md(view, num_actual_tokens, self.kernel.step(view.prefix, n))
        return self._slot_metadata(view, bind(self.backend, view, num_actual_tokens,
                                              self.num_heads, self.num_kv_heads, self.dtype),
                                   num_actual_tokens, slot_mapping)


def mixed_graphs(backends: set[Backend], device: str) -> bool:
    """Whether a group's layers attend with kernels that a full CUDA graph of a mixed batch can
    replay: flash-attn FA3 or FA4 on CUDA, which read only device lengths and the extend view's
    static bounds (``max_seqlen_q = T``, ``max_seqlen_k = C``), so that one extend graph per
    size serves every padded batch of that size. Not FlashInfer (its plan is host work per
    step), FA2 (its mixed parts fall back to SDPA) or SDPA (its gather plan is made on the
    host). The builder then declares ``AttentionCGSupport.ALWAYS``."""
    return device == "cuda" and bool(backends) and backends <= {Backend.FA3, Backend.FA4}


def uniform_graphs(backends: set[Backend], device: str, num_draft_tokens: int) -> bool:
    """Whether a group's layers attend with kernels that a full CUDA graph of a uniform verify
    step replays (vLLM's ``UNIFORM_BATCH``): speculative decoding (``N > 1``) with flash-attn
    (FA2, FA3, FA4) on CUDA, which read the verify view's tensors and its static bounds
    (``max_seqlen_q = N``, ``max_seqlen_k = C``). Not FlashInfer (its verify steps are extend
    updates, planned per step on the host) or SDPA (its gather plan is made on the host)."""
    return (device == "cuda" and num_draft_tokens > 1 and bool(backends)
            and backends <= {Backend.FA2, Backend.FA3, Backend.FA4})


def group_window(windows: set[int | None]) -> int | None:
    """The window of a KV-cache group from its layers' ``sliding_window`` values: None when
    no layer slides, ``W`` when the sliding layers agree (full layers may share the group:
    they read the view's full part, sliding ones its window part); two windows are refused."""
    slid = {w for w in windows if w is not None}
    if len(slid) > 1:
        raise LayoutError(f"attnpool serves one sliding window per KV-cache group, got "
                          f"{sorted(slid)}")
    return next(iter(slid), None)

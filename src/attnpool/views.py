"""Typed views: frozen, slotted dataclasses of slices of the pool's arena.

A view never owns memory and never aliases a caller's tensor: every tensor field is a slice of the
arena, so its ``data_ptr()`` is the same for the pool's life and a CUDA graph captured on it reads
whatever the next ``update_`` wrote. Host ints (``max_seqlen_*``) are frozen into a graph at capture:
views handed out by ``view(bs)`` carry the static bounds, and kernels must bound their reads by the
tensors, not by these ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from .config import FlashMLAConfig


class Stamp(Protocol):
    """Who produced a view: answers whether its bytes are still that producer's.

    Phases of a pool share arena bytes (the overlay), so a view stays meaningful only until
    another phase writes them. Every view a pool hands out carries its phase's stamp; a view built
    by hand has none and counts as current.
    """

    def current(self) -> bool: ...

    def describe(self) -> str: ...


@dataclass(frozen=True, slots=True)
class _Stamped:
    """The ``stamp`` field and ``is_current`` of every view class.

    ``stamp`` holds the producer. It is keyword-only, so each view's own fields keep their
    positions (and may come without defaults after it), and left out of ``==`` and ``repr``: two
    views of the same slices are equal whoever produced them.
    """

    stamp: Stamp | None = field(default=None, kw_only=True, compare=False, repr=False)

    @property
    def is_current(self) -> bool:
        """False once another phase (or poison) has written this view's bytes since the write
        that produced it: attention over it would read another phase's metadata. One lookup,
        no device access."""
        return self.stamp is None or self.stamp.current()


@dataclass(frozen=True, slots=True)
class FlashMLAMetadata(_Stamped):
    """FlashMLA's scheduler metadata of one part, in the pool (``PoolConfig(flashmla=...)``):
    what FlashMLA's ``get_mla_metadata`` returns, passed to its decode kernel as
    ``tile_scheduler_metadata`` and ``num_splits``. Written by every update of the phase from
    the part's ``cache_seqlens`` (docs/design.md, FlashMLA metadata), so a captured graph reads
    the current step's schedule.

    The schedule covers the ``n`` real rows only: padded rows get no work (idle parts hold
    ``begin_req = bs``, which every build of the kernel skips; ``num_splits`` repeats its last
    value past row ``n``).

    Attributes:
        tile_scheduler_metadata: ``[num_sm_parts, 8] int32``, per part ``[begin_req,
            begin_block, end_req, end_block, begin_split, 0, 0, 0]`` (requests inclusive,
            64-token blocks ``[begin, end)`` in the first and last request; ``begin_req = bs``:
            no work), or with ``config.layout = SchedLayout.DECODING_SCHED_META`` FlashMLA's
            struct ``[begin_req, end_req, begin_block, end_block, begin_split, first_split,
            last_split, 0]`` (``begin_req = bs``: no work).
        num_splits: ``[bs+1] int32``, ``[0, cumsum(splits per row)]``.
        num_sm_parts: host int, the rows of ``tile_scheduler_metadata``.
        s_q: host int, query rows per request the schedule was sized for (1 decode, ``N``
            verify): the kernel call must use the same.
        config: the pool's :class:`~attnpool.config.FlashMLAConfig` (SMs, query and KV heads,
            fp8, row layout) the parts were sized for: what an adapter checks its call against.
    """

    tile_scheduler_metadata: Tensor
    num_splits: Tensor
    num_sm_parts: int
    s_q: int
    config: FlashMLAConfig


@dataclass(frozen=True, slots=True)
class PagedView(_Stamped):
    """One batch of paged-attention metadata: the shape every phase part shares.

    Row ``i < bs`` reads KV tokens ``0 .. cache_seqlens[i]-1`` through its pages. Rows at or past the
    caller's real count ``n`` are padding: ``cache_seqlens = pad_seq_len``, pages = ``pad_page``,
    FlashInfer rows empty, so kernels run on valid, in-range data and their outputs are discarded.

    Attributes:
        bs: rows in the view (the captured batch size, or its multiple for expand parts).
        cache_seqlens: ``[bs] int32``, KV length of each row.
        cu_seqlens_q: ``[bs+1] int32``, query offsets: ``[0, cumsum(query lengths)]``.
        cu_seqlens_k: ``[bs+1] int32``, ``[0, cumsum(cache_seqlens)]``; element 0 is written by
            every update, never assumed zero.
        page_table: ``[bs, width] int32`` page ids (``Layout.FLASH_ATTN``), else None. Row ``i``
            is read up to column ``ceil(cache_seqlens[i] / page_size)``.
        kv_indptr: ``[bs+1] int32`` CSR row pointers (``Layout.FLASHINFER``), else None.
        kv_indices: ``[capacity] int32`` CSR page ids, the whole buffer (FlashInfer's graph
            wrappers take it at full size); read up to ``kv_indptr[bs]``. Else None.
        kv_last_page_len: ``[bs] int32`` in ``[1, page_size]`` for a row that owns pages, 0 for
            one that owns none (a padded or empty row) (``Layout.FLASHINFER``), else None.
        max_seqlen_q: host int, upper bound of any row's query length.
        max_seqlen_k: host int, upper bound of any ``cache_seqlens`` (the static
            ``max_context_len`` unless the update was given host lengths).
        page_size: tokens per page.
        causal: whether queries use a causal mask (aligned to the end of the KV row).
        window_left: keys a query sees to its left (flash-attn's ``window_size[0]``,
            FlashInfer's ``window_left``): ``W - 1`` for a sliding-window part, -1 (no window)
            otherwise. Keyword-only.
        window: a phase view's sliding-window part (``PoolConfig(sliding_window=W)``): the same
            rows from each row's window start, ``window_left = W - 1``; None without a window
            and on the parts themselves. Keyword-only; :class:`VerifyView` and
            :class:`DraftStepView` carry one too.
        flashmla: FlashMLA's scheduler metadata of this part (``PoolConfig(flashmla=...)``: the
            decode view and the verify view's ``prefix``), else None. Keyword-only.
    """

    bs: int
    cache_seqlens: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    page_table: Tensor | None
    kv_indptr: Tensor | None
    kv_indices: Tensor | None
    kv_last_page_len: Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    page_size: int
    causal: bool
    window_left: int = field(default=-1, kw_only=True)
    window: PagedView | None = field(default=None, kw_only=True)
    flashmla: FlashMLAMetadata | None = field(default=None, kw_only=True)


@dataclass(frozen=True, slots=True)
class DecodeView(PagedView):
    """Decode: one query per row (``cu_seqlens_q = arange(bs+1)``, ``max_seqlen_q = 1``).

    Same fields as :class:`PagedView`; ``cache_seqlens[i]`` is request ``i``'s sequence length
    including the token being decoded.
    """


@dataclass(frozen=True, slots=True)
class VerifyView(_Stamped):
    """Target verify of ``N`` draft tokens per request.

    Chain (``topk == 1``): ``prefix`` is the single causal pass, ``cache_seqlens = seq_lens + N``,
    ``cu_seqlens_q`` step N, ``max_seqlen_q = N``; ``expand`` is None.
    Tree (``topk > 1``): two non-causal passes merged by log-sum-exp. ``prefix``: every draft query
    of request ``i`` attends to the committed prefix (``cache_seqlens = seq_lens``, ``cu_seqlens_q``
    step N). ``expand``: ``bs*N`` one-query rows (row ``i*N + j`` is draft token ``j`` of request
    ``i``); its ``page_table`` lists raw KV token slots (``page_size = 1``) of the draft tokens the
    tree mask allows, allowed first; ``cache_seqlens`` is the allowed count.

    Attributes:
        bs: requests in the view.
        prefix: :class:`PagedView` with ``bs`` rows.
        expand: :class:`PagedView` with ``bs*N`` rows (tree), else None.
    """

    bs: int
    prefix: PagedView
    expand: PagedView | None
    window: PagedView | None = field(default=None, kw_only=True)  # (as PagedView.window)

    @property
    def flashmla(self) -> FlashMLAMetadata | None:
        """FlashMLA's metadata of the ``prefix`` part (``N`` query rows per request), or None."""
        return self.prefix.flashmla


@dataclass(frozen=True, slots=True)
class DraftStepView(_Stamped):
    """Metadata of draft decode step ``d`` (1-based) of one speculative round.

    Chain (``topk == 1``): ``prefix`` is a decode view with ``cache_seqlens = seq_lens + d`` over
    the round's shared page table; ``expand`` is None. Tree (``topk > 1``): ``prefix`` is the
    round's shared prefix pass (``K`` queries per request over the full pages of ``seq_lens``,
    non-causal, the same object for every step) and ``expand`` has ``bs*K`` one-query rows, each
    listing raw token slots (``page_size = 1``): the last partial prefix page, then its branch's
    first ``d`` draft tokens.
    """

    step: int
    prefix: PagedView
    expand: PagedView | None
    window: PagedView | None = field(default=None, kw_only=True)  # (as PagedView.window)


@dataclass(frozen=True, slots=True)
class DraftView(_Stamped):
    """All ``S`` draft steps of a round: they are captured in one graph, so they coexist.

    Attributes:
        bs: requests in the view.
        steps: ``S`` :class:`DraftStepView` s, step ``d`` at index ``d - 1``.
    """

    bs: int
    steps: tuple[DraftStepView, ...]


@dataclass(frozen=True, slots=True)
class DraftExtendView(PagedView):
    """Draft extend: request ``i`` has ``accept_lens[i]`` queries (``cu_seqlens_q`` is their
    cumsum; a padded row has one query), causal, ``cache_seqlens = seq_lens``."""


@dataclass(frozen=True, slots=True)
class ExtendView(PagedView):
    """Prefill with a cached prefix: request ``i`` appends ``extend_lens[i]`` new tokens to a
    prefix of ``seq_lens[i] - extend_lens[i]`` tokens already in the KV cache.

    The new tokens' K/V are stored into the cache (at ``req_to_token[r_i, prefix_i + j]``, the
    slots an update can write into ``out_slots``) before attention runs, so a row reads the whole
    sequence: ``cache_seqlens = seq_lens``, pages as in decode. Causal: query ``j`` of request
    ``i`` sits at absolute position ``prefix_i + j`` and sees the keys at positions ``<=`` it,
    which is the end-aligned causal mask flash-attn, FlashInfer and the SDPA adapter apply when a
    row has fewer queries than keys.

    Query rows are packed: request ``i``'s queries are ``cu_seqlens_q[i] .. cu_seqlens_q[i+1]-1``.
    **Padded rows** (``n <= i < bs``) keep ``cache_seqlens = pad_seq_len`` and the pad page; the
    first one takes the query slack ``T - sum(extend_lens)`` (``T = max_extend_tokens``) and the
    others none, so ``cu_seqlens_q[n+1:bs+1] = T``. A batch with a padded row thus always ends at
    ``cu_seqlens_q[bs] = T``, and so does the capture state (all rows padded) of every ``bs``: a
    graph captured at ``bs`` sees the same query total at every replay, which FlashInfer's
    graph-mode prefill plan needs (a replay's total query rows may never exceed those planned at
    capture), and its query buffer is ``T`` rows whatever ``bs`` is. A batch without padded rows
    (``n == bs``) ends at ``sum(extend_lens) <= T``, still within that total. The padded row's
    queries see its ``pad_seq_len`` keys through the end-aligned causal mask (all but its last
    ``pad_seq_len`` queries have none, and output 0); padded outputs are discarded.

    Attributes (beyond :class:`PagedView`):
        positions: ``[max_extend_tokens] int32``: absolute position of every packed query token
            (token ``cu_seqlens_q[i] + j`` of a real row: ``prefix_i + j``, the position for
            rotary embeddings); every token of a padded row and every entry past the batch's
            total holds 0, so a graph over all ``T`` rows reads valid positions.

    ``max_seqlen_q`` bounds every row's query count, padded rows included (tight from
    ``extend_lens_cpu``, else ``T``). :attr:`qo_indptr` is FlashInfer's name for
    ``cu_seqlens_q``.
    """

    positions: Tensor

    @property
    def qo_indptr(self) -> Tensor | None:
        """``cu_seqlens_q`` (the same tensor) in the ``FLASHINFER`` layout, else None: the
        ``qo_indptr [bs+1]`` of FlashInfer's batch prefill wrapper."""
        return self.cu_seqlens_q if self.kv_indptr is not None else None


@dataclass(frozen=True, slots=True)
class EncoderView(_Stamped):
    """Encoder-decoder attention for one decode step.

    Attributes:
        bs: requests in the view.
        cross: non-causal :class:`PagedView` over each request's first ``encoder_lens[i]`` token
            slots (``cache_seqlens = encoder_lens``), one query per row.
        decoder: the decode view whose page rows start at column ``encoder_lens[i]`` of the
            request's ``req_to_token`` row (its own self-attention KV).
    """

    bs: int
    cross: PagedView
    decoder: DecodeView


@dataclass(frozen=True, slots=True)
class LocalView(PagedView):
    """Chunked local attention as virtual batches (one row per chunk a request's queries touch).

    Request ``i`` owns rows ``i*V .. i*V+V-1`` (``V = rows_per_request``: 1 in decode). A row
    attends only to keys of its chunk up to its queries (causal, aligned to the row's end);
    ``page_table`` rows start at the chunk's first page. Rows a request does not need have no
    queries and padded lengths; the queries of request ``i`` stay packed in order, so
    ``cu_seqlens_q[i*V] = i*q``.

    Attributes:
        rows_per_request: ``V``.
    """

    rows_per_request: int

"""Part records: what a phase asks an update path to write, one named record per kind of part.

A phase builds one record per part (:class:`PagedPart`, :class:`TreeExpandPart`,
:class:`DraftExpandPart`, :class:`LocalPart`, :class:`LocalExtendPart`, :class:`FlashMLAPart`)
and hands it, with the part's buffers, to its update path: ``ops.paged_launch(b, part)``. Both
paths (:mod:`.reference`, :mod:`.triton`) read the fields by name, so an input is declared here
once, documented once, and a new one is one field plus the code that reads it.

Records are built when a batch shape is first seen (a launch is cached per shape and replayed
with new inputs after, :mod:`.launch_cache`), so their cost is not on the per-step path. They
are slotted keyword-only dataclasses, not frozen: the reference path's
:class:`attnpool.update.reference.Call` owns the record it was bound with and sets its
per-update fields in place for each call (then clears them), instead of rebuilding a record of
up to 28 fields per update; a phase keeps no reference to a record it handed over.
The caller's inputs are checked by the phases; the fused launchers check what the kernels
assume (shapes, dtypes, devices, capacities) before any write.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..config import SchedLayout
from .buffers import PagedBuffers


@dataclass(slots=True, kw_only=True)
class RowsPart:
    """What every per-request part reads: the rows and the request table.

    Attributes:
        bs: rows to write (the captured size); the fused grid is ``bs`` programs.
        seq_lens: ``[n]`` int32/int64 device lengths (``[bs]`` with ``num_real``).
        req_pool_indices: ``[n]`` int32/int64 device request rows (``[bs]`` with ``num_real``).
        req_to_token: ``[R, C]`` int32/int64 device request table (token slots), or a page-level
            block table with ``block_size``.
        num_real: capturable mode (fused path only): a ``[1]`` device count of real rows, the
            inputs padded to ``bs`` (:mod:`attnpool.update.triton`).
        block_size: ``req_to_token`` is a page-level block table of pages of this many tokens
            (its token slot at position ``t`` is ``table[r, t // B] * B + t % B``); None: a
            token-level table. Same bytes as the equivalent token-level table.
    """

    bs: int
    seq_lens: Tensor
    req_pool_indices: Tensor
    req_to_token: Tensor
    num_real: Tensor | None = None
    block_size: int | None = None


@dataclass(slots=True, kw_only=True)
class PagedPart(RowsPart):
    """One paged part: decode, verify chain, draft extend and extend (with their query parts),
    encoder cross and decoder rows (``token_offset``), all chain draft steps of a round
    (``steps``), a draft tree's prefix pass (``full_pages``), with its sliding-window twin
    (``window``).

    What it writes (both paths, the same bytes in every read region): ``cache_seqlens =
    seq_lens + extra`` (``pad_seq_len`` for padded rows), ``cu_seqlens_k = [0, cumsum]``,
    page-table rows = live page ids (padded rows: ``pad_page`` in their first
    ``ceil(pad_seq_len / P)`` columns), CSR rows = live pages with ``kv_last_page_len =
    (len-1) % P + 1`` (padded and empty rows own no pages: ``kv_last_page_len = 0``).

    Attributes (beyond :class:`RowsPart`):
        extra: added to every real length (verify chain N, draft step d).
        page_size: ``P`` of this part (1 for token-slot parts).
        pad_seq_len, pad_page: what padded rows hold.
        token_offset: ``[n]`` (``[bs]`` with ``num_real``) int: row ``i``'s pages start this many
            tokens into its request (encoder decoder rows, window parts).
        keep: incremental page table, ``[bs]`` device flags (:mod:`attnpool.update.triton`).
        q_lens, cu_seqlens_q: optional query part: ``cu_seqlens_q = [0, cumsum(q_lens)]`` with
            ``pad_q`` queries per padded row (draft extend), written by the same launch.
        steps: chain draft steps in one launch: ``b.cache_seqlens`` / ``b.cu_seqlens_k`` are then
            ``[steps, rows]`` / ``[steps, rows+1]``, step ``d`` (0-based) holding ``seq_lens +
            extra + d`` and its cumsum; the page table is written once, for the last step's
            lengths (its row prefixes serve every earlier step). No CSR (``LayoutError``).
        full_pages: lengths rounded down to whole pages (a draft tree's prefix pass).
        max_len: real lengths (``seq_lens + extra``; with ``steps``, the last step's) are clamped
            into ``[0, max_len]`` (default: the page table's width in tokens). In-contract inputs
            never reach the bound; an out-of-contract device value, which only a sync could
            detect, then gives wrong but valid metadata (a read region inside the buffers).
        max_q: ``q_lens`` are clamped into ``[0, max_q]`` likewise (default: no bound but int32).
        q_total: with the query part, padded rows' offsets end at ``max(q_total, real total)``
            instead of growing by ``pad_q`` each (extend: the first padded row takes the slack).
        positions, out_slots: with ``q_total``, optional ``[T]`` int32 / ``[L]`` int32/int64
            token buffers: packed query token ``j`` of real row ``i`` gets position ``len_i -
            q_i + j`` (``len_i = seq_lens[i] + extra``) and slot ``req_to_token[r_i, off_i +
            position]``; every later element gets 0 / -1.
        width: a host bound on the page columns any real row needs; only the reference path
            uses it (to gather fewer columns): each fused program loops over its own row's pages.
        tokens: the real query tokens (``sum(q_lens)``) when the caller knows it on the host;
            only the reference path uses it: it computes the token buffers (``positions``,
            ``out_slots``) over those tokens alone and writes the tail with one fill each, the
            same bytes as over the whole buffer (a CPU step of a few tokens then costs what its
            tokens cost, not ``T``'s). The fused programs walk their own row's tokens.
        exact_tokens: the host copy behind ``tokens`` is ``q_lens`` itself (a CPU pool given its
            own input as the host copy, which the phase checked value by value), so ``tokens``
            is exactly ``sum(q_lens)`` and every ``q_lens`` value is in contract: the reference
            path may size a per-token temporary from it (:mod:`.reference.lean`). Static for a
            launch (part of the phase's launch key).
        window: the part's sliding-window twin (docs/design.md, Sliding windows), written by
            the same launch: row ``i`` of length ``L`` with ``q`` queries (``q_lens[i]``, else
            ``max(extra, 1)``) starts ``shift = floor(max(0, L - q - window_size + 1) / P) * P``
            tokens into its request: ``cache_seqlens = L - shift``, pages from the table's
            position ``shift``; same layouts and padding as the part, never incremental.
        window_size: ``W`` (keys a query sees, itself included); only with ``window``.
        window_table: the table the window part reads (an engine's sliding-window KV group), of
            ``req_to_token``'s kind and dtype and at least its width; default ``req_to_token``.
        window_out_slots: with ``out_slots``, the window table's slots of the same query tokens
            (-1 past the real ones): the window group's slot mapping, by the same launch.
    """

    extra: int = 0
    page_size: int
    pad_seq_len: int
    pad_page: int
    token_offset: Tensor | None = None
    keep: Tensor | None = None
    q_lens: Tensor | None = None
    cu_seqlens_q: Tensor | None = None
    pad_q: int = 1
    steps: int = 1
    full_pages: bool = False
    max_len: int | None = None
    max_q: int | None = None
    q_total: int | None = None
    positions: Tensor | None = None
    out_slots: Tensor | None = None
    width: int | None = None
    tokens: int | None = None
    exact_tokens: bool = False
    window: PagedBuffers | None = None
    window_size: int | None = None
    window_table: Tensor | None = None
    window_out_slots: Tensor | None = None


@dataclass(slots=True, kw_only=True)
class TreeExpandPart(RowsPart):
    """A verify tree's *expand* part: ``bs*N`` token-slot rows (page size 1). Row ``i*N + j``
    lists the slots ``req_to_token[r_i, seq_lens[i] + k]`` of the drafts ``k`` that
    ``tree_mask[i, j, k]`` allows, allowed first in increasing ``k``; its length is the allowed
    count. Rows of padded requests get ``pad_len`` copies of ``pad_id`` (the pad page's first
    slot).

    Attributes (beyond :class:`RowsPart`):
        tree_mask: ``[n, N, N]`` bool device (``[bs, N, N]`` with ``num_real``).
        pad_len, pad_id: what padded rows hold.
    """

    tree_mask: Tensor
    pad_len: int
    pad_id: int


@dataclass(slots=True, kw_only=True)
class DraftExpandPart(RowsPart):
    """A draft tree round's expand rows of all ``S`` steps (``e`` stacked ``[S, ...]``, one
    shared table): step ``d`` (1-based) has ``cache_seqlens = part + d`` with ``part = seq_lens
    % P`` the tokens of the last, partial prefix page, listing those token slots then branch
    ``k``'s first ``d`` drafts ``out_cache_loc[i, :d, k]``. Padded requests' rows: ``pad_len``
    copies of ``pad_id``, no CSR entries, ``kv_last_page_len = 0``.

    Attributes (beyond :class:`RowsPart`):
        out_cache_loc: ``[n, S, K]`` int32/int64 token slots (``[bs, S, K]`` with ``num_real``).
        page_size: ``P`` of the prefix pages.
        pad_len, pad_id: what padded rows hold.
    """

    out_cache_loc: Tensor
    page_size: int
    pad_len: int
    pad_id: int


@dataclass(slots=True, kw_only=True)
class LocalPart(RowsPart):
    """Chunked local attention's virtual rows (``bs * rows_per_request``): ``seq_lens + extra``
    with ``num_queries`` queries per request, pages gathered from each row's chunk start (rows
    past a request's last chunk: ``pad_len`` keys on ``pad_page``), and ``cu_seqlens_q`` where a
    padded request's first row takes ``num_queries`` queries so request ``i``'s queries start at
    row ``i * rows_per_request``.

    Attributes (beyond :class:`RowsPart`):
        cu_seqlens_q: ``[bs * rows_per_request + 1]`` int32 buffer written by the part.
        extra, num_queries, rows_per_request, chunk, page_size: the phase's shape.
        pad_len, pad_page: what padded rows hold.
    """

    cu_seqlens_q: Tensor
    extra: int
    num_queries: int
    rows_per_request: int
    chunk: int
    page_size: int
    pad_len: int
    pad_page: int


@dataclass(slots=True, kw_only=True)
class LocalExtendPart(RowsPart):
    """Chunked local attention for a prefill (extend or draft extend): ``bs`` virtual rows, one
    per chunk each request's new tokens touch, laid out request after request; padded rows read
    the pad page and take no query. Both paths run the reference part's ops (rows per request
    vary with the new tokens: no fixed-stride program covers them); ``num_real`` is refused.

    Attributes (beyond :class:`RowsPart`):
        extend_lens: ``[n]`` int new tokens per request.
        cu_seqlens_q: ``[bs + 1]`` int32 buffer written by the part.
        chunk, page_size: the phase's shape.
        pad_len, pad_page: what padded rows hold.
    """

    extend_lens: Tensor
    cu_seqlens_q: Tensor
    chunk: int
    page_size: int
    pad_len: int
    pad_page: int


@dataclass(slots=True, kw_only=True)
class FlashMLAPart:
    """FlashMLA's schedule of the first ``n`` rows of a part's ``cache_seqlens`` (``num_real``'s
    count with ``num_real``: then ``n`` is ``bs``), run after that part in stream order.

    Attributes:
        bs: the captured rows; ``num_splits[: bs + 1]`` is written.
        n: real rows (host count).
        tile_scheduler_metadata: ``[num_parts, 8]`` int32 buffer (in ``layout``).
        num_splits: ``[>= bs + 1]`` int32 buffer.
        num_parts: FlashMLA's ``num_sm_parts``.
        num_real: capturable mode (fused path only), as in :class:`RowsPart`.
        layout: the metadata's layout (:class:`attnpool.SchedLayout`).
    """

    bs: int
    n: int
    tile_scheduler_metadata: Tensor
    num_splits: Tensor
    num_parts: int
    num_real: Tensor | None = None
    layout: SchedLayout = SchedLayout.ARGUMENTS

"""Host-side pages of the sliding-window layers: a request holds only the pages its windows see.

A sliding-window layer's query at position ``p`` reads keys ``p - W + 1 .. p``. Once every
future query of a request sits at position ``>= f``, a page whose last position is ``< f - W + 1``
is never read again by those layers, and goes back to the free list while the request runs.
So a long generation holds ``O(W / P)`` window-layer pages per request instead of ``O(L / P)``:
the window layers' KV gets its own cache, with its own page ids in its own table (the pool's
``window_req_to_token`` / ``window_block_table``, vLLM's "KV cache group", SGLang's SWA pool).

The rules (the :mod:`.paging` rules, adapted to pages that come and go):

* **Page 0 is never handed out** (the pad page), and **a page has one owner** at a time.
* **Admission reserves a page count, not page ids**: the most pages the request can hold at
  once, ``max(pages of its prompt, the steady span)``, where the span
  ``ceil((W - 1 + Q) / P) + 1`` covers the oldest key its next step's queries can see up to the
  newest position that step writes (``Q`` positions ahead). Pages are then taken as the request's
  positions grow and freed as its window moves, never more at once than reserved, so taking one
  never fails and a running request never stalls. After the prefill :meth:`settle` cuts the
  reservation down to the span (the prompt's early pages are gone by then), which returns the
  difference to admission.
* **Freeing follows the earliest future query**: the caller passes ``first_query``, the lowest
  position any later forward will query for the request (with speculative decoding, the target's
  next verify; a draft never queries below it). Entries of the window table for freed pages keep
  their stale ids: nothing reads them (a window row starts at the page of its first visible key).

Pure Python, no tensors: this module imports nothing of the library but its errors, page
arithmetic and :mod:`.paging`'s argument check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import ceil_div, window_span_pages
from ...errors import CapacityError, InputError
from .paging import check_sizes


@dataclass(slots=True)
class WindowAllocation:
    """What one admitted request holds in the window cache (mutable: pages come and go).

    Attributes:
        row: its ``req_to_token`` row (the same row as its full-attention pages).
        reserved: the most pages it may hold at once.
        pages: page index -> page id for the pages it holds now (index ``j`` holds positions
            ``j*P .. j*P+P-1``).
        freed_below: every page index below this has been freed (or never taken).
        end: positions ``< end`` have pages (taken now, or taken and since freed).
    """

    row: int
    reserved: int
    pages: dict[int, int] = field(default_factory=dict)
    freed_below: int = 0
    end: int = 0

    @property
    def held(self) -> int:
        return len(self.pages)


class WindowPageAllocator:
    """Free pages of a sliding-window cache (page ``pad_page`` excluded) and their reservations.

    Args:
        num_pages: pages of the window cache, the pad page included (``>= 2``).
        page_size: tokens per page ``P``.
        window: ``W``, the layers' window in tokens (a query sees ``W`` keys, itself included).
        lookahead: ``Q``, most positions one step writes at or after the request's first query
            position (1 for decode; ``N + 2`` for a speculative round of ``N`` drafts, whose draft
            extend writes one past the verify).
        pad_page: the reserved page, never handed out (default 0).
    """

    def __init__(self, num_pages: int, page_size: int, window: int, lookahead: int = 1,
                 pad_page: int = 0) -> None:
        check_sizes("WindowPageAllocator", num_pages, pad_page, ("page_size", page_size, 1),
                    ("window", window, 1), ("lookahead", lookahead, 1))
        self.num_pages, self.page_size, self.window = num_pages, page_size, window
        self.lookahead, self.pad_page = lookahead, pad_page
        self._free = [p for p in reversed(range(num_pages)) if p != pad_page]
        self._unreserved = num_pages - 1

    @property
    def span(self) -> int:
        """Most pages a request holds between steps and during one: the oldest visible key
        (``W - 1`` before the first query) up to the newest written position (``Q - 1`` after)."""
        return window_span_pages(self.window, self.lookahead, self.page_size)

    @property
    def free_pages(self) -> int:
        """Pages on the free list (some may be promised to running requests' reservations)."""
        return len(self._free)

    @property
    def unreserved_pages(self) -> int:
        """Pages no running request may claim: what admission can still promise."""
        return self._unreserved

    def pages_for(self, tokens: int) -> int:
        return ceil_div(tokens, self.page_size)

    def reservation(self, prompt_len: int, tokens: int) -> int:
        """Pages reserved at admission for a request of ``prompt_len`` prompt tokens that can
        write ``tokens`` positions in all: its prefill holds the whole prompt at once."""
        return min(self.pages_for(tokens), max(self.pages_for(prompt_len), self.span))

    def check_fits(self, prompt_len: int, tokens: int) -> None:
        """:class:`CapacityError` if the request could never be admitted, even alone."""
        need = self.reservation(prompt_len, tokens)
        if need > self.num_pages - 1:
            raise CapacityError(
                f"a request of {prompt_len} prompt tokens needs {need} window pages of "
                f"{self.page_size} at once, more than the {self.num_pages - 1} usable pages of "
                f"the window KV cache (num_pages={self.num_pages})")

    def admit(self, row: int, prompt_len: int, tokens: int) -> WindowAllocation | None:
        """Reserve for a request (no page taken yet), or None (nothing reserved) if the free
        pages are promised elsewhere: it waits."""
        need = self.reservation(prompt_len, tokens)
        if need > self._unreserved:
            return None
        self._unreserved -= need
        return WindowAllocation(row, need)

    def advance(self, alloc: WindowAllocation, first_query: int, end: int
                ) -> list[tuple[int, int]]:
        """Free the pages no query at or after ``first_query`` can see, then take pages for every
        position ``< end``. Returns the new ``(page index, page id)`` pairs, for the caller to
        write into its window table (freed pages need no write)."""
        p = self.page_size
        keep_from = max(0, first_query - self.window + 1) // p  # page of the oldest visible key
        for j in range(alloc.freed_below, min(keep_from, ceil_div(alloc.end, p))):
            page = alloc.pages.pop(j, None)
            if page is not None:
                self._free.append(page)
        alloc.freed_below = max(alloc.freed_below, keep_from)
        new: list[tuple[int, int]] = []
        for j in range(max(ceil_div(alloc.end, p), alloc.freed_below), ceil_div(end, p)):
            if len(alloc.pages) >= alloc.reserved:
                raise CapacityError(
                    f"row {alloc.row}: positions < {end} with queries from {first_query} need "
                    f"more than the {alloc.reserved} window pages reserved (lookahead "
                    f"{self.lookahead} too small for this step?)")
            page = self._free.pop()
            alloc.pages[j] = page
            new.append((j, page))
        alloc.end = max(alloc.end, end)
        return new

    def settle(self, alloc: WindowAllocation, tokens: int) -> None:
        """After the prefill: keep only the steady reservation (``span``, at most what the
        request's ``tokens`` positions need, never below what it holds now)."""
        keep = max(alloc.held, min(self.span, self.pages_for(tokens)))
        if keep < alloc.reserved:
            self._unreserved += alloc.reserved - keep
            alloc.reserved = keep

    def release(self, alloc: WindowAllocation) -> None:
        """Return the request's pages and reservation (once)."""
        if alloc.reserved < 0:
            raise InputError(f"window allocation of row {alloc.row} was already released")
        self._free.extend(alloc.pages.values())
        self._unreserved += alloc.reserved
        alloc.pages.clear()
        alloc.reserved = -1

    def slot(self, alloc: WindowAllocation, pos: int) -> int:
        """Token slot of position ``pos`` in the window cache (``page * P + offset``)."""
        page = alloc.pages.get(pos // self.page_size)
        if page is None:
            raise CapacityError(f"row {alloc.row}: position {pos} has no window page (freed, or "
                                f"not taken yet: held {sorted(alloc.pages)})")
        return page * self.page_size + pos % self.page_size

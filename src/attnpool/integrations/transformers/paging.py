"""Host-side page allocator: which KV pages and ``req_to_token`` rows each live request owns.

An engine keeps this bookkeeping on the host; the pool only ever sees the result through
``req_to_token``. The rules that keep a paged cache sound:

* **Page 0 is never handed out.** It is the pad page (``pad_page = 0`` in
  :class:`attnpool.PoolConfig`, zeroed by :class:`attnpool.KVCachePool`): padded rows of every view
  read it, so no request may write there.
* **A page has one owner.** A page leaves the free list when a request is admitted and comes back
  only when that request is released, so one request's KV writes never land in another's pages.
* **Admission is all or nothing.** A request gets every page it can ever need (its prompt, its
  longest output and any speculative look-ahead) when admitted, or nothing: a request that does
  not fit waits (:meth:`PageAllocator.admit` returns None) instead of running out of pages halfway
  and overwriting someone else's. The cost is reserving for the worst case; the gain is that a
  running request never stalls or needs preemption.

Pure Python, no tensors: this module imports nothing of the library but its errors and page
arithmetic.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ...config import ceil_div
from ...errors import CapacityError, InputError


def check_sizes(owner: str, num_pages: int, pad_page: int,
                *sizes: tuple[str, object, int]) -> None:
    """An allocator's arguments: ``num_pages`` an int >= 2, each of ``sizes`` (``(name, value,
    lowest)``) an int >= its lowest, ``pad_page`` an int in ``[0, num_pages)``.

    Raises:
        InputError: the first argument that is not, named with ``owner``.
    """
    for name, v, lo in (("num_pages", num_pages, 2), *sizes, ("pad_page", pad_page, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise InputError(f"{owner}: {name} must be an int >= {lo}, got {v!r}")
    if pad_page >= num_pages:
        raise InputError(f"{owner}: pad_page must be < num_pages={num_pages}, got {pad_page}")


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one admitted request owns.

    Attributes:
        row: its row of ``req_to_token`` (a request slot), in ``[0, num_rows)``.
        pages: its page ids in order: positions ``p*P .. p*P+P-1`` live in ``pages[p]``.
    """

    row: int
    pages: tuple[int, ...]


class PageAllocator:
    """Free lists of KV pages (page ``pad_page`` excluded) and request rows.

    Args:
        num_pages: pages of the KV cache, the pad page included (``>= 2``).
        page_size: tokens per page.
        num_rows: request rows of ``req_to_token`` (at most this many requests live at once).
        pad_page: the reserved page, never handed out (default 0).
    """

    def __init__(self, num_pages: int, page_size: int, num_rows: int, pad_page: int = 0) -> None:
        check_sizes("PageAllocator", num_pages, pad_page, ("page_size", page_size, 1),
                    ("num_rows", num_rows, 1))
        self.num_pages, self.page_size, self.num_rows = num_pages, page_size, num_rows
        self.pad_page = pad_page
        # Min-heaps: the lowest free ids are handed out first, however pages came back, so the
        # pages of one request are one run of ids whenever the free ones are (every request of a
        # fresh cache, or of one whose requests all ended), and requests admitted together get
        # runs in admission order: what the SDPA adapter reads in place on a CPU, with no copy
        # (attnpool.adapters.sdpa.gather). A sorted list is already a heap.
        self._pages = [p for p in range(num_pages) if p != pad_page]
        self._rows = list(range(num_rows))
        self._live: dict[int, Allocation] = {}

    @property
    def usable_pages(self) -> int:
        """Pages a request may ever get: all but the pad page."""
        return self.num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._pages)

    @property
    def free_rows(self) -> int:
        return len(self._rows)

    def live(self) -> tuple[Allocation, ...]:
        """The allocations not yet released (for checks: their pages are pairwise disjoint)."""
        return tuple(self._live.values())

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` token positions."""
        return ceil_div(tokens, self.page_size)

    def check_fits(self, tokens: int) -> None:
        """Raise :class:`CapacityError` if ``tokens`` positions exceed the whole cache: such a
        request would wait forever."""
        need = self.pages_for(tokens)
        if need > self.usable_pages:
            raise CapacityError(
                f"a request of {tokens} tokens needs {need} pages of {self.page_size}, more than "
                f"the {self.usable_pages} usable pages of the KV cache (num_pages="
                f"{self.num_pages}, page {self.pad_page} is the pad page)")

    def admit(self, tokens: int) -> Allocation | None:
        """A row and every page for ``tokens`` positions, or None (nothing taken) if either is
        short: the request waits until others are released."""
        need = self.pages_for(tokens)
        if not self._rows or need > len(self._pages):
            return None
        row = heapq.heappop(self._rows)
        pages = tuple(heapq.heappop(self._pages) for _ in range(need))
        alloc = Allocation(row, pages)
        self._live[row] = alloc
        return alloc

    def release(self, alloc: Allocation) -> None:
        """Return ``alloc``'s row and pages to the free lists (once)."""
        if self._live.get(alloc.row) is not alloc:
            raise InputError(f"allocation of row {alloc.row} is not live (released twice?)")
        del self._live[alloc.row]
        for page in alloc.pages:
            heapq.heappush(self._pages, page)
        heapq.heappush(self._rows, alloc.row)

    def slot(self, alloc: Allocation, pos: int) -> int:
        """Token slot of position ``pos`` of ``alloc``'s request (``page * P + offset``)."""
        p = self.page_size
        if not 0 <= pos < len(alloc.pages) * p:
            raise CapacityError(f"position {pos} is outside the {len(alloc.pages)} pages of "
                                f"row {alloc.row} (capacity {len(alloc.pages) * p} tokens)")
        return alloc.pages[pos // p] * p + pos % p

"""Per-request state and per-run statistics of :class:`PagedGenerator` (plain host data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from torch import Tensor

from .paging import Allocation
from .window_paging import WindowAllocation


class Tables(TypedDict):
    """The engine tables every ``update_`` of the generator gets: the full layers' and the
    window layers' (None: the window parts read the full table)."""

    req_to_token: Tensor
    window_req_to_token: Tensor | None


@dataclass
class Request:
    """One prompt's progress.

    Invariants between steps (``L = len(tokens)``): the target's KV cache holds positions
    ``0 .. kv_len - 1`` with ``kv_len = L - 1`` (the newest token is the next step's input); with
    speculative decoding the draft's cache holds ``0 .. L - 1`` (``draft_len = L``, one ahead, since
    the draft already read the newest token to propose ``proposal``).
    """

    index: int
    tokens: list[int]
    prompt_len: int
    max_new: int
    eos: int | None
    alloc: Allocation | None = None
    window_allocation: WindowAllocation | None = None
    kv_len: int = 0
    draft_len: int = 0
    proposal: int = -1
    done: bool = False

    @property
    def out(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def extend(self, new: list[int]) -> list[int]:
        """Append generated tokens, stopping at ``max_new`` or the first ``eos`` (kept, as
        ``generate`` keeps it); return what was appended and set :attr:`done`."""
        room = self.max_new - (len(self.tokens) - self.prompt_len)
        take = new[:room]
        if self.eos is not None and self.eos in take:
            take = take[: take.index(self.eos) + 1]
            self.done = True
        self.tokens.extend(take)
        if len(self.tokens) - self.prompt_len >= self.max_new:
            self.done = True
        return take


@dataclass
class GenerationStats:
    """What the last :meth:`PagedGenerator.generate` call did and cost (host wall-clock).

    Attributes:
        requests: prompts served. new_tokens: tokens returned, all prompts together.
        prefill_forwards: target prefill (extend) forwards. decode_steps: target decode or verify
            forwards (one per generation step of the running batch). draft_forwards: draft model
            forwards (prefill, chain steps, draft extend).
        metadata_s: host time preparing attention metadata: page/slot bookkeeping, the step's
            input tensors, the pool's ``update_`` and the KV slot mapping (the forward excluded).
        metadata_calls: how many times that was done (one per forward).
        wall_s: the whole call.
        proposed, accepted: draft tokens proposed and accepted by the target (speculative only).
        full_pages_peak, window_pages_peak: most KV pages the running requests held at once,
            between steps, in the full-attention cache and in the sliding-window layers' cache
            (whose pages behind every future window are freed as generation goes on).
    """

    requests: int = 0
    new_tokens: int = 0
    prefill_forwards: int = 0
    decode_steps: int = 0
    draft_forwards: int = 0
    metadata_s: float = 0.0
    metadata_calls: int = 0
    wall_s: float = 0.0
    proposed: int = 0
    accepted: int = 0
    full_pages_peak: int = 0
    window_pages_peak: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 without speculative decoding)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def metadata_us_per_step(self) -> float:
        """Mean metadata-preparation host time per forward, in microseconds."""
        return 1e6 * self.metadata_s / self.metadata_calls if self.metadata_calls else 0.0

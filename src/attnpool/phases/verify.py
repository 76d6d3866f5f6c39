"""Target verify: N draft tokens per request, chain (topk 1) or tree (topk > 1).

docs/design.md, Verify.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..errors import InputError
from ..update.parts import TreeExpandPart
from ..views import PagedView, VerifyView
from ._views import part_view
from .base import Inputs, KeyedPhase, Replay, Shared, UpdatePath, new_record

if TYPE_CHECKING:
    from typing import Unpack


_BOOL = (torch.bool,)


class VerifyValues(NamedTuple):
    """One verify update's values, as its parts read them (by these names).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        tree_mask: ``[n, N, N]`` bool device mask (tree verify), else None.
        width: page columns the real rows need (host bound; the reference path's gather).
    """

    inputs: Inputs
    tree_mask: Tensor | None
    width: int


class VerifyPhase(KeyedPhase[VerifyView]):
    """``pool.verify``: chain verify is one causal pass over ``seq_lens + N``; tree verify is a
    non-causal prefix pass over ``seq_lens`` plus an expand pass over the allowed draft tokens,
    merged by log-sum-exp (see :class:`attnpool.VerifyView`).

    Expand rows are token-slot rows (``page_size = 1``) of width N: never a buffer of width C per
    draft token. Padded expand rows list ``min(pad_seq_len, N)`` copies of the pad page's first
    slot, so they stay inside the part's width.
    """

    phase = Phase.VERIFY

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        self.tree = self.cfg.topk > 1
        self._p = self._paged()
        self._e = self._paged("expand_") if self.tree else None
        self._cu_q = arena.buffer(None, "arange_n")

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        tree_mask: Tensor | None = None,
        **shared: Unpack[Shared],
    ) -> VerifyView:
        """Refill for ``n = len(seq_lens)`` requests, each verifying N draft tokens.

        Args:
            seq_lens: ``[n]`` committed lengths (drafts excluded), each in ``[1, C - N]``; the
                draft tokens' slots are ``req_to_token[r, seq_len .. seq_len + N - 1]``.
            tree_mask: ``[n, N, N]`` bool, required when ``topk > 1``: ``tree_mask[i, j, k]``
                says draft ``j`` of request ``i`` may attend draft ``k`` (its ancestors and
                itself; ``tree_mask[i, j, j]`` must be True).
            num_real: capturable mode, as in :meth:`DecodePhase.update_` (``tree_mask`` then has
                ``bs`` rows too).
            (other arguments as in :meth:`DecodePhase.update_`.)
        """
        cfg, nd = self.cfg, self.cfg.num_draft_tokens
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len - nd)
        mask: Tensor | None = None
        strides: tuple[int, ...] | None = None
        if self.tree:
            mask, strides = self.input_pass.shaped("tree_mask", tree_mask, (x.n, nd, nd),
                                                   _BOOL)
        elif tree_mask is not None:
            raise InputError(f"tree_mask is only for topk > 1, got one with topk={cfg.topk}")
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len - nd, tree_mask=mask)
        add = 0 if self.tree else nd
        host = x.seq_lens_host
        # --- writes start here (every part's inputs were checked above) ---
        self._run((bs, x.launch_key, strides), bs,
                  new_record(VerifyValues, (x, mask, self._width(host, add))))
        self._mark(bs)
        return self._view(bs, self._max_k(host, add, x.n, bs, cfg.max_context_len))

    def _parts(self, ops: UpdatePath, bs: int, values: VerifyValues) -> tuple[Replay, ...]:
        """The prefix part (chain: causal over ``seq_lens + N``), FlashMLA's schedule of its
        lengths when the pool keeps it, then the tree expand part."""
        x = values.inputs
        out = [self._paged_launch(ops, self._p, bs, x,
                                  extra=0 if self.tree else self.cfg.num_draft_tokens,
                                  width=values.width, **self._window(x)),
               *self._flashmla_launch(ops, self._p, bs, x)]
        if self._e is not None and values.tree_mask is not None:
            out.append(ops.tree_expand_launch(self._e, TreeExpandPart(
                **self._rows(bs, x), tree_mask=values.tree_mask, pad_len=self._expand_pad,
                pad_id=self.cfg.pad_page * self.cfg.page_size)))
        return tuple(out)

    def _capture_values(self) -> VerifyValues:
        nd = self.cfg.num_draft_tokens
        mask = torch.empty((0, nd, nd), dtype=torch.bool, device=self._dev) if self.tree else None
        return VerifyValues(inputs=self._capture_inputs(), tree_mask=mask, width=0)

    @property
    def _expand_pad(self) -> int:
        """Keys of a padded expand row: at most N, so it stays inside the part's width."""
        return min(self.cfg.pad_seq_len, self.cfg.num_draft_tokens)

    def _make_view(self, bs: int, max_k: int) -> VerifyView:
        cfg, nd = self.cfg, self.cfg.num_draft_tokens
        prefix: PagedView = part_view(self._p, bs, self._cu_q, max_q=nd, max_k=max_k,
                           page_size=cfg.page_size, causal=not self.tree, stamp=self._stamp,
                           flashmla=self._flashmla_view(bs, nd))
        expand: PagedView | None = None
        if self._e is not None:
            expand = part_view(self._e, bs * nd, self._arange, max_q=1, max_k=nd, page_size=1,
                               causal=False, stamp=self._stamp)
        return VerifyView(bs=bs, prefix=prefix, expand=expand, stamp=self._stamp,
                          window=self._window_view(bs, self._cu_q, nd, max_k))

"""Draft decode: steps d = 1..S of one speculative round, live together.

docs/design.md, Draft decode and Overlay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from ..arena import Arena
from ..config import Phase
from ..errors import InputError
from ..specs import draft_expand_width
from ..update.buffers import PagedBuffers
from ..update.parts import DraftExpandPart
from ..views import DraftStepView, DraftView, PagedView
from ._views import part_view
from .base import Inputs, PhaseBase, Replay, Shared, UpdatePath, new_record

if TYPE_CHECKING:
    from typing import Unpack


class DraftValues(NamedTuple):
    """One draft round's values, as its parts read them (by these names).

    Attributes:
        inputs: the checked shared inputs (:class:`attnpool.phases.inputs_pass.Inputs`).
        out_cache_loc: ``[n, S, K]`` int device token slots of the drafts (tree), else None.
        width: page columns the real rows need (host bound; the reference path's gather).
    """

    inputs: Inputs
    out_cache_loc: Tensor | None
    width: int


class DraftPhase(PhaseBase[DraftView]):
    """``pool.draft``: one update writes the metadata of every draft step of a round.

    Engines capture all S steps in one graph, so the steps coexist: they share one page table
    (chain: rows sized for ``seq_lens + S``, whose row prefixes serve every earlier step; tree:
    the prefix pass over full pages and one expand table whose row prefixes serve every step) and
    keep per step only lengths, cumsums and the small expand CSR. Never one full table per step.

    Layouts: chain steps keep the ``FLASH_ATTN`` page table only. FlashInfer's CSR cannot share one
    page list between rows of different lengths, so a chain draft view has no CSR fields (they are
    None); tree rounds keep CSR for the prefix pass and a small per-step CSR for expand rows.
    """

    phase = Phase.DRAFT

    def __init__(self, arena: Arena) -> None:
        super().__init__(arena)
        cfg = self.cfg
        self.tree = cfg.topk > 1
        a = arena
        if self.tree:
            self._prefix = self._paged("prefix_")
            self._cu_k_prefix_q = a.buffer(None, "arange_k")
            self._e_table = a.buffer(self.phase, "expand_page_table")
            self._e_steps = tuple(self._expand_step(d) for d in range(cfg.spec_steps))
            # all steps stacked ([S, ...] per-step buffers): what one fused launch writes
            csr = [a.maybe(self.phase, "expand_" + k)
                   for k in ("kv_indptr", "kv_indices", "kv_last_page_len")]
            self._expand_all = PagedBuffers(
                a.buffer(self.phase, "expand_cache_seqlens"),
                a.buffer(self.phase, "expand_cu_seqlens_k"), self._e_table, csr[0], csr[1],
                csr[2], self._arange)
        else:
            self._table = a.maybe(self.phase, "page_table")
            lens, cu = a.buffer(self.phase, "cache_seqlens"), a.buffer(self.phase, "cu_seqlens_k")
            self._chain = tuple(
                PagedBuffers(lens[d], cu[d], self._table, None, None, None, self._arange)
                for d in range(cfg.spec_steps)
            )
            # all steps stacked: what one fused launch writes (a single step is a plain part)
            self._chain_all = (PagedBuffers(lens, cu, self._table, None, None, None, self._arange)
                               if cfg.spec_steps > 1 else self._chain[0])
            #: with a window, the same per step over the window table (rows from step 1's
            #: window start); the launch writes the stacked buffers, or step 1's alone
            w = self._window_buffers
            self._window_steps = () if w is None else tuple(
                PagedBuffers(w.cache_seqlens[d], w.cu_seqlens_k[d], w.page_table, None, None,
                             None, self._arange) for d in range(cfg.spec_steps))
            if w is not None and cfg.spec_steps == 1:
                self._window_buffers = self._window_steps[0]

    def _expand_step(self, d: int) -> PagedBuffers:
        a, ph = self.arena, self.phase
        csr = [a.maybe(ph, "expand_" + k) for k in ("kv_indptr", "kv_indices", "kv_last_page_len")]
        return PagedBuffers(
            a.buffer(ph, "expand_cache_seqlens")[d], a.buffer(ph, "expand_cu_seqlens_k")[d],
            self._e_table, *(None if t is None else t[d] for t in csr),
        )

    def _capture_view(self, bs: int) -> DraftView:
        """All steps' views for ``bs`` requests, for capture (valid padded values)."""
        return self._view(bs, None, 0)

    def update_(
        self,
        bs: int,
        *,
        seq_lens: Tensor,
        out_cache_loc: Tensor | None = None,
        **shared: Unpack[Shared],
    ) -> DraftView:
        """Refill every step for ``n = len(seq_lens)`` requests.

        Fused path: a chain round is one launch (all steps' lengths, cumsums and the shared
        table); a tree round is two (the prefix pass, then every step's expand rows).

        Args:
            seq_lens: ``[n]`` committed lengths before the round, each in ``[1, C - S]``.
            out_cache_loc: ``[n, S, K]`` int token slots of the draft tokens (tree only): step
                ``s`` of branch ``k`` of request ``i``. In chain rounds the draft tokens' slots are
                read from the request table (``req_to_token[r, seq_len .. seq_len + S - 1]``).
            num_real: capturable mode, as in :meth:`DecodePhase.update_` (``out_cache_loc`` then
                has ``bs`` rows too).
            (other arguments as in :meth:`DecodePhase.update_`.)
        """
        cfg, steps = self.cfg, self.cfg.spec_steps
        x = self.input_pass.check(bs, seq_lens, shared, cfg.max_context_len - steps)
        loc: Tensor | None = None
        strides: tuple[int, ...] | None = None
        if not self.tree:
            if out_cache_loc is not None:
                raise InputError("out_cache_loc is only for topk > 1; chain drafts read "
                                 f"req_to_token, got one with topk={cfg.topk}")
        else:
            loc, strides = self.input_pass.shaped("out_cache_loc", out_cache_loc,
                                                  (x.n, steps, cfg.topk))
        if self.validate:  # (the value lists are built only then)
            self._check_values(x, cfg.max_context_len - steps)
        host = x.seq_lens_host
        # --- writes start here (every part's inputs were checked above) ---
        self._run((bs, x.launch_key, strides), bs,
                  new_record(DraftValues, (x, loc, self._width(host, 0 if self.tree else steps))))
        self._mark(bs)
        return self._view(bs, host, x.n)

    def _parts(self, ops: UpdatePath, bs: int, values: DraftValues) -> tuple[Replay, ...]:
        """Chain: every step in one paged part (``steps``: per-step lengths, one shared table).
        Tree: the prefix pass over whole pages, then every step's expand rows."""
        x, cfg = values.inputs, self.cfg
        if values.out_cache_loc is None:  # a chain round
            return (self._paged_launch(ops, self._chain_all, bs, x, extra=1,
                                       steps=cfg.spec_steps, width=values.width,
                                       **self._window(x)),)
        prefix = self._paged_launch(ops, self._prefix, bs, x, full_pages=True,
                                    width=values.width)
        expand = ops.draft_tree_expand_launch(self._expand_all, DraftExpandPart(
            **self._rows(bs, x), out_cache_loc=values.out_cache_loc, page_size=cfg.page_size,
            pad_len=self._expand_pad, pad_id=cfg.pad_page * cfg.page_size))
        return prefix, expand

    def _capture_values(self) -> DraftValues:
        cfg = self.cfg
        loc = self._arange[:0].view(0, cfg.spec_steps, cfg.topk) if self.tree else None
        return DraftValues(inputs=self._capture_inputs(), out_cache_loc=loc, width=0)

    @property
    def _expand_pad(self) -> int:
        """Keys of a padded expand row: within the expand table's width ``P-1+S``."""
        return min(self.cfg.pad_seq_len, draft_expand_width(self.cfg))

    def _view(self, bs: int, host: list[int] | None, n: int) -> DraftView:
        key = (bs, None) if host is None else (bs, tuple(host), n)
        return self._views.get(key) or self._memo(key, lambda: self._make_view(bs, host, n))

    def _make_view(self, bs: int, host: list[int] | None, n: int) -> DraftView:
        cfg, c = self.cfg, self.cfg.max_context_len
        out: list[DraftStepView] = []
        if self.tree:
            max_k = self._max_k(host, 0, n, bs, c)
            prefix: PagedView = part_view(self._prefix, bs, self._cu_k_prefix_q, max_q=cfg.topk,
                               max_k=max_k, page_size=cfg.page_size, causal=False, stamp=self._stamp)
            w = draft_expand_width(cfg)
            pad_len = min(cfg.pad_seq_len, w)
            for d, b in enumerate(self._e_steps):
                e: PagedView = part_view(b, bs * cfg.topk, self._arange, max_q=1,
                                         max_k=max(min(w, cfg.page_size + d), pad_len),
                                         page_size=1,
                                         causal=False, stamp=self._stamp)
                out.append(DraftStepView(d + 1, prefix, e, stamp=self._stamp))
        else:
            for d, b in enumerate(self._chain):
                max_k = self._max_k(host, d + 1, n, bs, c)
                v: PagedView = part_view(b, bs, self._arange, max_q=1, max_k=max_k,
                                         page_size=cfg.page_size, causal=True, stamp=self._stamp)
                win = self._window_view(bs, self._arange, 1, max_k, self._window_steps[d]
                                        ) if self._window_steps else None
                out.append(DraftStepView(d + 1, v, None, stamp=self._stamp, window=win))
        return DraftView(bs=bs, steps=tuple(out), stamp=self._stamp)


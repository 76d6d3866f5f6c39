"""SGLang's speculative decoding through attnpool's pool (importing this module imports SGLang).

Speculative decoding (NGRAM, EAGLE, EAGLE3, STANDALONE; :func:`spec_sizes`): the pool gets
SGLang's verify and draft sizes; a target verify batch goes through ``pool.verify`` (a chain
for topk 1; for topk > 1 and NGRAM the tree, its mask SGLang's ``spec_info.custom_mask``), the
draft model's extend after it through ``pool.draft_extend`` (both in
:class:`AttnpoolSpecBackend`, the base backend's subclass for speculative runners) and its
decode steps through ``pool.draft`` (:class:`AttnpoolDraftSteps`, which the plugin hands
SGLang's draft backend factory: :func:`attnpool.integrations.sglang.register`). On a CPU each
such batch's ``out_cache_loc`` is checked against the request table slots the views read.

Refused at engine start (:func:`spec_refusals`): other algorithms (DFLASH, multi-layer
EAGLE...), pages of more than one token (SGLang refuses topk > 1 with pages for this backend
itself, and its CPU engine's paged topk-1 path needs a Triton kernel: nothing to check attnpool
against), and any device but a CPU (SGLang's GPU verify mask, ``FULL_MASK``, spans the
committed tokens too and is not read; verify and draft CUDA graphs are not captured).

This module imports :mod:`.backend` (the base), never the reverse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ...adapters.binding import Run
from ...errors import LayoutError
from .backend import AttnpoolAttnBackend, Extra, Served, kept
from .step import NAME, RunnerSizes

__all__ = ["SPEC_SERVED", "AttnpoolDraftStep", "AttnpoolDraftSteps", "AttnpoolSpecBackend",
           "spec_algorithm", "spec_backend_for", "spec_refusals", "spec_sizes"]

#: the speculative algorithms the backend serves (SGLang's ``SpeculativeAlgorithm`` names)
SPEC_SERVED = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE")


def spec_algorithm(model_runner: Any) -> str | None:
    """The runner's speculative algorithm's name (``EAGLE``, ``NGRAM``...), None without."""
    algo = getattr(model_runner, "spec_algorithm", None)
    if algo is None or algo.is_none():
        return None
    return str(algo.name)


def spec_refusals(model_runner: Any, args: Any, windows: set[int]) -> list[str]:
    """What of speculative decoding the backend does not serve (see :func:`spec_sizes` for
    what it does)."""
    algo = spec_algorithm(model_runner)
    if algo is None:
        return []
    out: list[str] = []
    if algo not in SPEC_SERVED:
        out.append(f"speculative_algorithm={algo} (attnpool serves {', '.join(SPEC_SERVED)})")
    if getattr(args, "enable_multi_layer_eagle", False):
        out.append("multi-layer EAGLE (enable_multi_layer_eagle)")
    if int(model_runner.page_size) > 1:
        # SGLang itself refuses topk > 1 with pages for a backend like this one, and its CPU
        # engine's paged topk-1 path needs a Triton kernel: no reference to check pages against
        out.append(f"speculative decoding with page_size={model_runner.page_size} (attnpool's "
                   "speculative views are checked at page_size=1 only)")
    if torch.device(model_runner.device).type != "cpu":
        # SGLang's GPU verify mask (FULL_MASK: each draft's row spans the committed tokens
        # too) is not read, and only decode graphs are captured: checked on a CPU only
        out.append(f"speculative decoding on {model_runner.device} (attnpool serves it on a "
                   "CPU: SGLang's GPU tree-mask layout and verify/draft CUDA graphs are not "
                   "served)")
    k = int(getattr(args, "speculative_eagle_topk", None) or 1)
    if windows and (k > 1 or algo == "NGRAM"):
        out.append("a sliding window with a draft tree (topk > 1 or NGRAM: the drafts of one "
                   "row sit at different depths, so no one window start serves them)")
    return out


def spec_sizes(model_runner: Any) -> tuple[int, int, int]:
    """The pool's speculative sizes ``(num_draft_tokens, topk, spec_steps)`` from SGLang's
    server args, ``(0, 1, 0)`` without speculative decoding.

    - EAGLE, EAGLE3, STANDALONE: ``speculative_num_draft_tokens``, ``speculative_eagle_topk``
      and ``speculative_num_steps`` (a chain for topk 1, the tree and its mask for topk > 1).
    - NGRAM: no draft model (``spec_steps`` 0) and an irregular tree whatever its breadth
      (SGLang always passes its mask), so the pool is a tree: ``topk = max(2, breadth)``.

    The target's and the draft's runners get the same sizes (the target reads
    ``pool.verify``, the draft ``pool.draft`` and ``pool.draft_extend``).
    """
    algo = spec_algorithm(model_runner)
    if algo is None:
        return 0, 1, 0
    args = model_runner.server_args
    n = int(args.speculative_num_draft_tokens)
    k = int(getattr(args, "speculative_eagle_topk", None) or 1)
    if algo == "NGRAM":
        return n, max(2, k), 0
    return n, k, int(args.speculative_num_steps)


class AttnpoolSpecBackend(AttnpoolAttnBackend):
    """The ``attnpool`` backend of a speculative runner (the target's or the draft's): the
    base's decode and extend batches, plus a target verify through ``pool.verify`` and the
    draft model's extend after it through ``pool.draft_extend`` (the draft's decode steps go
    through :class:`AttnpoolDraftSteps`, on the same pool)."""

    SERVES = frozenset({Extra.SPEC})

    @classmethod
    def refusals(cls, model_runner: Any, layers: list[RadixAttention]) -> list[str]:
        windows = {layer.sliding_window_size for layer in layers
                   if layer.sliding_window_size > -1}
        return super().refusals(model_runner, layers) + spec_refusals(
            model_runner, getattr(model_runner, "server_args", None), windows)

    @classmethod
    def runner_sizes(cls, model_runner: Any, layers: list[RadixAttention]) -> RunnerSizes:
        nd, k, steps = spec_sizes(model_runner)
        return dataclasses.replace(super().runner_sizes(model_runner, layers),
                                   num_draft_tokens=nd, topk=k, spec_steps=steps)

    def refill(self, forward_batch: ForwardBatch) -> Run:
        """A target verify through ``pool.verify``, the draft's extend after it through
        ``pool.draft_extend``, the rest as the base."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            run = self._verify(forward_batch)
            self._count(Served.VERIFY)
            return run
        if mode.is_draft_extend_v2():
            run = self._draft_extend(forward_batch)
            self._count(Served.DRAFT_EXTEND)
            return run
        return super().refill(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Refused: only decode graphs are captured, not speculative decoding's verify and
        draft graphs."""
        raise LayoutError(f"attention_backend={NAME!r} captures decode graphs only, not "
                          "speculative decoding's verify and draft graphs: start SGLang "
                          "with disable_cuda_graph=True")

    def _check_slots(self, fb: ForwardBatch, start: torch.Tensor, per_request: int,
                     what: str) -> None:
        """On a CPU: the batch's ``out_cache_loc`` (where SGLang stores the new K/V) must be
        the request table's slots ``start[i] ..`` of each request, ``per_request`` of them,
        which is where the pool's views read them. A cheap host check (the tables are on the
        host), so that a layout this backend does not expect is refused, never served wrong."""
        if not self.filler.host or fb.out_cache_loc is None:
            return
        n = fb.req_pool_indices.shape[0]
        cols = start.to(torch.int64).view(n, 1) + torch.arange(per_request).view(1, -1)
        want = self.req_to_token[fb.req_pool_indices.to(torch.int64).view(n, 1), cols]
        got = fb.out_cache_loc[:n * per_request].to(want.dtype).view(n, per_request)
        if not torch.equal(want, got):
            raise LayoutError(f"attention_backend={NAME!r}: the {what} batch stores its K/V "
                              "at out_cache_loc slots that are not the request table's slots "
                              "after each request's committed tokens, where the pool reads "
                              "them")

    def _verify(self, fb: ForwardBatch) -> Run:
        """A target verify: ``N`` drafts per request over the committed ``seq_lens``; a tree
        pool takes SGLang's mask (``spec_info.custom_mask``, one ``N x N`` block per request,
        row ``j`` the drafts draft ``j`` sees)."""
        spec, cfg = fb.spec_info, self.filler.pool.cfg
        nd = cfg.num_draft_tokens
        if spec is None or int(spec.draft_token_num) != nd:
            raise LayoutError(f"attention_backend={NAME!r}: a verify batch of "
                              f"{getattr(spec, 'draft_token_num', None)} draft tokens, but the "
                              f"pool was built for num_draft_tokens={nd}")
        n = fb.batch_size
        mask = None
        if cfg.topk > 1:
            custom = getattr(spec, "custom_mask", None)
            if custom is None or custom.numel() != n * nd * nd:
                raise LayoutError(f"attention_backend={NAME!r}: a tree verify needs one "
                                  f"{nd} x {nd} mask block per request (spec_info.custom_mask"
                                  f"), got {None if custom is None else tuple(custom.shape)}")
            mask = custom.view(n, nd, nd)
            if mask.dtype != torch.bool:
                mask = mask.to(torch.bool)
        elif int(getattr(spec, "tree_topk", getattr(spec, "topk", 1))) != 1:
            raise LayoutError(f"attention_backend={NAME!r}: a tree verify with a chain pool "
                              "(topk=1)")
        self._check_slots(fb, fb.seq_lens, nd, "verify")
        return self.filler.verify(req_pool_indices=fb.req_pool_indices,
                                  req_to_token=self.req_to_token, seq_lens=fb.seq_lens,
                                  seq_lens_cpu=fb.seq_lens_cpu, tree_mask=mask)

    def _draft_extend(self, fb: ForwardBatch) -> Run:
        """The draft model's extend after a verify: ``extend_seq_lens`` queries per request,
        causal over ``seq_lens`` (which include them)."""
        lens = fb.extend_seq_lens_cpu
        if fb.extend_seq_lens is None:
            raise LayoutError(f"attention_backend={NAME!r}: a draft extend batch without "
                              "extend_seq_lens")
        tokens = sum(lens) if lens is not None else int(fb.extend_seq_lens.sum())
        if fb.extend_prefix_lens is not None:
            self._check_slots_ragged(fb, tokens)
        return self.filler.draft_extend(
            req_pool_indices=fb.req_pool_indices, req_to_token=self.req_to_token,
            seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu,
            extend_seq_lens=fb.extend_seq_lens, extend_seq_lens_cpu=lens, num_tokens=tokens)

    def _check_slots_ragged(self, fb: ForwardBatch, tokens: int) -> None:
        """:meth:`_check_slots` for requests of different query counts (a draft extend)."""
        if not self.filler.host or fb.out_cache_loc is None:
            return
        # (one gather for the batch: a slice per request made this check cost more than the
        # refill it guards at 8 requests)
        lens = fb.extend_seq_lens.to(torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        within = torch.arange(tokens) - starts.repeat_interleave(lens, output_size=tokens)
        rows = fb.req_pool_indices.to(torch.int64).repeat_interleave(lens, output_size=tokens)
        cols = (fb.extend_prefix_lens.to(torch.int64).repeat_interleave(lens, output_size=tokens)
                + within)
        want = self.req_to_token[rows, cols]
        if not torch.equal(want, fb.out_cache_loc[:tokens].to(want.dtype)):
            raise LayoutError(f"attention_backend={NAME!r}: the draft extend batch stores its "
                              "K/V at out_cache_loc slots that are not the request table's "
                              "slots after each request's prefix, where the pool reads them")


def spec_backend_for(model_runner: Any) -> AttnpoolSpecBackend:
    """The speculative runner's one backend (:func:`.backend.kept`): the one SGLang's
    registry call built (:func:`.factory.backend_for`), or built here when the draft backend
    factory asks first."""
    got = kept(model_runner, AttnpoolSpecBackend)
    if not isinstance(got, AttnpoolSpecBackend):
        raise LayoutError(f"attention_backend={NAME!r}: a draft backend on a runner whose "
                          f"backend is {type(got).__name__}, not the speculative one")
    return got


class AttnpoolDraftStep(AttentionBackend):  # type: ignore[misc]  # (SGLang: Any)
    """One draft decode step of :class:`AttnpoolDraftSteps`: SGLang sets it as the forward's
    attention backend for that step, and its layers attend through the step's view of
    ``pool.draft`` (bound by the round's :meth:`AttnpoolDraftSteps.init_forward_metadata`)."""

    def __init__(self, base: AttnpoolSpecBackend, step: int) -> None:
        super().__init__()
        self.base, self.step = base, step
        self.run: Run | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        raise LayoutError(f"attention_backend={NAME!r}: a draft step is refilled by its "
                          "round (AttnpoolDraftSteps.init_forward_metadata)")

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        if self.run is None:
            raise LayoutError("a draft step ran before its round refilled the pool")
        return self.base._attend(q, k, v, layer, forward_batch, save_kv_cache, run=self.run,
                                 **kwargs)

    def forward_extend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise LayoutError(f"attention_backend={NAME!r}: a draft step runs decode batches only")

    def support_triton(self) -> bool:
        return False


class AttnpoolDraftSteps:
    """The draft model's multi-step decode backend (what SGLang's ``DraftBackendFactory``
    returns for ``create_decode_backend``; registered by :func:`attnpool.integrations.sglang.
    register`): one ``pool.draft`` refill per speculative round, ``speculative_num_steps - 1``
    steps (:class:`AttnpoolDraftStep`, SGLang's ``attn_backends``), all on the draft runner's
    one pool (:func:`spec_backend_for`).

    SGLang calls :meth:`init_forward_metadata` once per round with the committed ``seq_lens``
    ``[bs]`` and the round's ``out_cache_loc`` ``[bs * topk * steps]`` (request, branch,
    step), then runs step ``i`` with ``bs * topk`` query rows through ``attn_backends[i]``.
    topk 1 is a chain (step ``i`` reads the committed tokens and the first ``i + 1`` drafts);
    topk > 1 the pool's tree layout: a prefix pass over the committed tokens shared by every
    branch, and an expand pass per branch over its own drafts, merged by log-sum-exp.
    """

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        self.base = spec_backend_for(model_runner)
        cfg = self.base.filler.pool.cfg
        if (topk, speculative_num_steps) != (cfg.topk, cfg.spec_steps):
            raise LayoutError(f"attention_backend={NAME!r}: a draft backend of topk={topk}, "
                              f"{speculative_num_steps} steps, but the pool was built for "
                              f"topk={cfg.topk}, spec_steps={cfg.spec_steps}")
        self.topk, self.speculative_num_steps = topk, speculative_num_steps
        self.attn_backends = [AttnpoolDraftStep(self.base, i)
                              for i in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb, base = forward_batch, self.base
        if self.topk == 1:  # the chain's drafts are read from the request table
            base._check_slots(fb, fb.seq_lens, self.speculative_num_steps, "draft decode")
        runs = base.filler.draft(req_pool_indices=fb.req_pool_indices,
                                 req_to_token=base.req_to_token, seq_lens=fb.seq_lens,
                                 seq_lens_cpu=fb.seq_lens_cpu,
                                 out_cache_loc=fb.out_cache_loc if self.topk > 1 else None)
        for step, run in zip(self.attn_backends, runs, strict=True):
            step.run = run
        base._count(Served.DRAFT)

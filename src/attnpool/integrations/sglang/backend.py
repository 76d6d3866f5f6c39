"""SGLang's attention backend ``attnpool`` (importing this module imports SGLang).

:class:`AttnpoolAttnBackend` owns the model runner's :class:`attnpool.BufferPool`
(:class:`.step.BatchFiller`), refills it from every ``ForwardBatch`` in
:meth:`~AttnpoolAttnBackend.init_forward_metadata` and attends each layer through attnpool's
adapters: K/V go into SGLang's own KV pool (``set_kv_buffer`` at ``out_cache_loc``), and the
adapter reads that pool's buffers in place as pages (:func:`.step.kv_pages`). On a CPU that is
PyTorch SDPA, one call per layer for the whole batch (SGLang's ``torch_native`` backend loops
over the requests in Python); on CUDA the fastest installed adapter that serves the model
(FlashInfer when every layer shares its scale and soft cap and none has sinks, planned once per
forward: :mod:`attnpool.adapters.flashinfer_step`; then flash-attn FA3, FA4, FA2, then SDPA:
:func:`attnpool.adapters.binding.choose`; the choice is logged, and ``ATTNPOOL_SGLANG_KERNEL``
forces one).

Speculative decoding (NGRAM, EAGLE, EAGLE3, STANDALONE; :func:`spec_sizes`): the pool gets
SGLang's verify and draft sizes; a target verify batch goes through ``pool.verify`` (a chain
for topk 1; for topk > 1 and NGRAM the tree, its mask SGLang's ``spec_info.custom_mask``), the
draft model's extend after it through ``pool.draft_extend`` and its decode steps through
``pool.draft`` (:class:`AttnpoolDraftSteps`, which the plugin hands SGLang's draft backend
factory: :func:`attnpool.integrations.sglang.register`). On a CPU each such batch's
``out_cache_loc`` is checked against the request table slots the views read.

What the backend does not serve is refused when SGLang builds it, at engine start, with the
reason and the setting to change (:func:`refusals`): cross attention (encoder-decoder
models), encoder-only and bidirectional layers, multi-head latent attention, KV caches of
another dtype than the model's (fp8), hybrid sliding-window KV pools, more than one sliding
window, query/value head sizes that differ, and of speculative decoding: other algorithms
(DFLASH, multi-layer EAGLE...), pages of more than one token (SGLang refuses topk > 1 with
pages for this backend itself, and its CPU engine's paged topk-1 path needs a Triton kernel:
nothing to check attnpool against), and any device but a CPU (SGLang's GPU verify mask,
``FULL_MASK``, spans the committed tokens too and is not read; verify and draft CUDA graphs
are not captured).

CUDA graphs (decode): :meth:`~AttnpoolAttnBackend.init_forward_metadata_out_graph` binds the
layers' call to ``pool.decode.view(bs)`` before a capture; the refill of that view (no host
read; padded rows carry the fill value
:meth:`~AttnpoolAttnBackend.get_cuda_graph_seq_len_fill_value` declares) is the in-graph part,
the capturable update recorded with the graph on the fused path, else an update before each
replay. Only with flash-attn or FlashInfer attending: SDPA plans each batch on the host, so
with SDPA ``init_cuda_graph_state`` refuses (a CPU engine captures none). FlashInfer plans the
captured size's graph wrapper after each refill, on the host: its refill runs before each
replay, never recorded in the graph.
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from ...adapters.backends import Backend, Need
from ...adapters.binding import Run, choose
from ...adapters.flashinfer_step import LayerFacts
from ...errors import CapacityError, LayoutError
from ..engine import layer_facts
from .step import KERNEL, NAME, BatchFiller, RunnerSizes, kv_pages

logger = logging.getLogger(__name__)
#: set to a path: each engine process writes its refill counts to ``<path>.<pid>`` (see
#: :class:`Served`); off by default (nothing is counted)
REPORT = "ATTNPOOL_SGLANG_REPORT"


class Served:
    """What one engine process's pools served, kept in a file for another process to read:
    SGLang runs its scheduler (and so this backend) in a spawned process, where the caller
    that started the engine cannot look. Six int64: decode refills, extend refills, the pools'
    bytes, then speculative decoding's verify refills, draft rounds (one ``pool.draft`` refill
    each) and draft extend refills, in a file memory-mapped once, so a refill costs one store
    (only when :data:`REPORT` is set; ``examples/sglang_smollm2.py`` prints them as its proof
    that the pool served the run). The backends of one process (a target's and its draft's)
    share the file (:meth:`of`)."""

    #: the counters' indices
    DECODE, EXTEND, BYTES, VERIFY, DRAFT, DRAFT_EXTEND = range(6)
    _open: ClassVar[dict[str, Served]] = {}

    def __init__(self, path: str, nbytes: int) -> None:
        import numpy as np

        self.counts = np.memmap(f"{path}.{os.getpid()}", dtype=np.int64, mode="w+", shape=(6,))
        self.counts[:] = 0
        self.counts[self.BYTES] = nbytes
        self.counts.flush()

    @classmethod
    def of(cls, path: str, nbytes: int) -> Served:
        """This process's counter file at ``path``, its pools' bytes grown by ``nbytes``."""
        got = cls._open.get(path)
        if got is None:
            got = cls._open[path] = cls(path, nbytes)
        else:
            got.counts[cls.BYTES] += nbytes
        return got

    def count(self, kind: int) -> None:
        self.counts[kind] += 1

    @staticmethod
    def read(path: str) -> tuple[int, int, int]:
        """The counts of every process that wrote ``<path>.<pid>`` files, summed: (decode
        refills, extend refills, the pools' bytes)."""
        got = Served.read_all(path)
        return got[0], got[1], got[2]

    @staticmethod
    def read_all(path: str) -> tuple[int, ...]:
        """All six counts (the class doc's order), summed over the processes."""
        import glob

        import numpy as np

        total = [0] * 6
        for name in glob.glob(f"{glob.escape(path)}.*"):
            got = np.fromfile(name, dtype=np.int64, count=6)
            for i in range(min(6, got.shape[0])):
                total[i] += int(got[i])
        return tuple(total)


def _layers(model_runner: Any) -> list[RadixAttention]:
    return [m for m in model_runner.model.modules() if isinstance(m, RadixAttention)]


def _has_sinks(model_runner: Any) -> bool:
    """Whether the model's attention passes sink logits (``sinks=`` to its layers, as gpt-oss
    does): a module holding a ``sinks`` tensor."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor)
               for m in model_runner.model.modules())


def _need(model_runner: Any, layers: list[RadixAttention]) -> Need:
    """What the runner's layers ask of the adapter (SGLang's KV buffers read as NHD pages)."""
    first = layers[0]
    return Need(device=torch.device(model_runner.device).type, dtype=model_runner.dtype,
                head_size=first.qk_head_dim, head_size_v=first.v_head_dim,
                page_size=int(model_runner.page_size), varying_queries=True,
                window=any(layer.sliding_window_size > -1 for layer in layers),
                softcap=any(layer.logit_cap for layer in layers),
                sinks=_has_sinks(model_runner))


def pick(model_runner: Any, layers: list[RadixAttention]) -> Backend:
    """The adapter that attends (see the module doc).

    Raises:
        LayoutError: :data:`.step.KERNEL` names no adapter that runs here, or none can.
    """
    need = _need(model_runner, layers)
    # FlashInfer's per-step plans cover decode and extend views only: not offered with
    # speculative decoding (verify and draft views are tree or multi-step views)
    return choose(need, os.environ.get(KERNEL, "").strip().lower(),
                  f"attention_backend={NAME!r}", KERNEL,
                  planned=not need.sinks and _facts(model_runner, layers) is not None
                  and spec_algorithm(model_runner) is None)


def _facts(model_runner: Any, layers: list[RadixAttention]) -> LayerFacts | None:
    """What FlashInfer's one plan per forward fixes for every layer, as the layers have it;
    None when they differ (FlashInfer is then not offered)."""
    return layer_facts(((layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim,
                         layer.scaling, layer.logit_cap or 0.0) for layer in layers),
                       model_runner.dtype)


def refusals(model_runner: Any, layers: list[RadixAttention]) -> list[str]:
    """What in this runner the backend cannot serve, each with the setting to change (empty:
    everything is served)."""
    out: list[str] = []
    if not layers:
        out.append("the model has no RadixAttention layer")
    if getattr(model_runner, "use_mla_backend", False):
        out.append("multi-head latent attention (MLA) models")
    if any(layer.is_cross_attention for layer in layers):
        out.append("cross attention (encoder-decoder models)")
    kinds = {layer.attn_type for layer in layers} - {AttentionType.DECODER}
    if kinds:
        out.append(f"attention types other than causal decoder attention "
                   f"({', '.join(sorted(k.value for k in kinds))}: encoder-only and "
                   "bidirectional models)")
    if any(layer.qk_head_dim != layer.v_head_dim for layer in layers):
        out.append("layers whose value head size differs from the query's")
    if getattr(model_runner, "attention_chunk_size", None) and any(
            getattr(layer, "use_irope", False) for layer in layers):
        out.append("chunked local attention (attention_chunk_size: Llama 4's local layers)")
    if any(layer.logit_cap and getattr(layer, "logit_capping_method", "tanh") != "tanh"
           for layer in layers):
        out.append("logit capping other than tanh")
    if any(getattr(layer, "xai_temperature_len", -1) > 0 for layer in layers):
        out.append("attention temperature scaling (xai_temperature_len)")
    args = getattr(model_runner, "server_args", None)
    if getattr(args, "dllm_config", None) or getattr(args, "enable_pdmux", False):
        out.append("diffusion-LLM or PD-multiplexing batches (dllm_config, enable_pdmux)")
    windows = {layer.sliding_window_size for layer in layers if layer.sliding_window_size > -1}
    if len(windows) > 1:
        out.append(f"more than one sliding window ({sorted(windows)})")
    kv = model_runner.token_to_kv_pool
    if type(kv) is not MHATokenToKVPool:
        out.append(f"the KV pool {type(kv).__name__} (attnpool reads MHATokenToKVPool's "
                   "buffers: a hybrid sliding-window or quantized pool is not served)")
    elif layers and kv.get_key_buffer(layers[0].layer_id).dtype != model_runner.dtype:
        out.append(f"a KV cache of {kv.get_key_buffer(layers[0].layer_id).dtype} with a "
                   f"{model_runner.dtype} model (kv_cache_dtype)")
    out += _spec_refusals(model_runner, args, windows)
    if layers and not out:
        try:
            pick(model_runner, layers)
        except LayoutError as e:
            out.append(f"these layers with the adapters installed ({e})")
    return out


#: the speculative algorithms the backend serves (SGLang's ``SpeculativeAlgorithm`` names)
SPEC_SERVED = ("NGRAM", "EAGLE", "EAGLE3", "STANDALONE")


def spec_algorithm(model_runner: Any) -> str | None:
    """The runner's speculative algorithm's name (``EAGLE``, ``NGRAM``...), None without."""
    algo = getattr(model_runner, "spec_algorithm", None)
    if algo is None or algo.is_none():
        return None
    return str(algo.name)


def _spec_refusals(model_runner: Any, args: Any, windows: set[int]) -> list[str]:
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


def _sizes(model_runner: Any, layers: list[RadixAttention]) -> RunnerSizes:
    table = model_runner.req_to_token_pool.req_to_token
    kv = model_runner.token_to_kv_pool
    page, args = int(model_runner.page_size), model_runner.server_args
    slots = int(kv.get_key_buffer(layers[0].layer_id).shape[0])
    requests, width = int(table.shape[0]), int(table.shape[1])
    # One extend batch: the prefill budget or one whole prompt, plus a mixed chunk's decode
    # rows; never more new tokens than the KV pool has slots.
    budget = max(int(getattr(args, "chunked_prefill_size", None) or 0),
                 int(getattr(args, "max_prefill_tokens", None) or 0), width)
    windows = {layer.sliding_window_size for layer in layers if layer.sliding_window_size > -1}
    nd, k, steps = spec_sizes(model_runner)
    return RunnerSizes(max_requests=requests, max_context_len=width,
                       max_extend_tokens=min(budget + requests, slots),
                       page_size=page,
                       sliding_window=next(iter(windows)) + 1 if windows else None,
                       num_pages=slots // page, device=torch.device(model_runner.device),
                       num_draft_tokens=nd, topk=k, spec_steps=steps)


class AttnpoolAttnBackend(AttentionBackend):
    """SGLang's ``attnpool`` attention backend (see the module doc)."""

    def __init__(self, model_runner: Any) -> None:
        super().__init__()
        layers = _layers(model_runner)
        reasons = refusals(model_runner, layers)
        if reasons:
            msg = (f"attention_backend={NAME!r} does not serve: " + "; ".join(reasons)
                   + ". Start SGLang with another attention_backend (torch_native on a CPU).")
            logger.error(msg)
            raise LayoutError(msg)
        first = layers[0]
        self.device = model_runner.device
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        masked = any(layer.logit_cap for layer in layers) or _has_sinks(model_runner)
        backend = pick(model_runner, layers)
        facts = _facts(model_runner, layers) if backend is Backend.FLASHINFER else None
        self.filler = BatchFiller(_sizes(model_runner, layers), backend,
                                  first.tp_q_head_num, first.tp_k_head_num, model_runner.dtype,
                                  masked=masked, facts=facts)
        logger.info("attnpool serves attention of %d layers with %s: one pool of %d bytes",
                    len(layers), backend.name, self.filler.pool.nbytes)
        self.page_size = self.filler.sizes.page_size
        self.run: Run | None = None
        report = os.environ.get(REPORT)
        self.served = None if not report else Served.of(report, self.filler.pool.nbytes)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Refill the pool from ``forward_batch`` (SGLang calls this before every forward) and
        bind the adapter call its layers make: decode through ``pool.decode``, extend (prefill,
        mixed) through ``pool.extend``, a target verify through ``pool.verify`` and the draft
        model's extend after it through ``pool.draft_extend`` (the draft's decode steps go
        through :class:`AttnpoolDraftSteps`)."""
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.run = None
            return
        if mode.is_target_verify():
            self.run = self._verify(forward_batch)
            self._count(Served.VERIFY)
            return
        if mode.is_draft_extend_v2():
            self.run = self._draft_extend(forward_batch)
            self._count(Served.DRAFT_EXTEND)
            return
        if not (mode.is_decode() or mode.is_extend_or_draft_extend_or_mixed()) \
                or mode.is_split_prefill():
            raise LayoutError(f"attention_backend={NAME!r} serves decode and extend batches, "
                              f"got {mode.name}")
        fb = forward_batch
        decode = mode.is_decode()
        lens = None if decode else fb.extend_seq_lens_cpu
        # the real new tokens (a batch SGLang pads for data or attention parallelism counts
        # its padding in extend_num_tokens, and narrows its layers' inputs to the real ones)
        tokens = fb.batch_size if decode else (
            sum(lens) if lens is not None else int(fb.extend_num_tokens))
        self.run = self.filler.fill(
            decode=decode, req_pool_indices=fb.req_pool_indices, req_to_token=self.req_to_token,
            seq_lens=fb.seq_lens, seq_lens_cpu=fb.seq_lens_cpu, num_tokens=tokens,
            extend_seq_lens=None if decode else fb.extend_seq_lens, extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=None if decode else fb.extend_prefix_lens_cpu)
        self._count(Served.DECODE if decode else Served.EXTEND)

    def _count(self, kind: int) -> None:
        if self.served is not None:
            self.served.count(kind)

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
        want = torch.cat([self.req_to_token[r, p:p + q] for r, p, q in zip(
            fb.req_pool_indices.tolist(), fb.extend_prefix_lens.tolist(),
            fb.extend_seq_lens.tolist(), strict=True)])
        if not torch.equal(want, fb.out_cache_loc[:tokens].to(want.dtype)):
            raise LayoutError(f"attention_backend={NAME!r}: the draft extend batch stores its "
                              "K/V at out_cache_loc slots that are not the request table's "
                              "slots after each request's prefix, where the pool reads them")

    def _attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool,
                run: Run | None = None, **kwargs: Any) -> torch.Tensor:
        run = self.run if run is None else run
        if run is None:
            raise LayoutError("attention ran before init_forward_metadata refilled the pool")
        kv = self.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            # the layer call's own out_cache_loc: SGLang narrows it per call for padded batches
            kv.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        h, d = layer.tp_q_head_num, layer.qk_head_dim
        out = run(q.reshape(-1, h, d),
                       kv_pages(kv.get_key_buffer(layer.layer_id), self.page_size),
                       kv_pages(kv.get_value_buffer(layer.layer_id), self.page_size),
                       layer.scaling, window=layer.sliding_window_size > -1,
                       softcap=float(layer.logit_cap or 0.0), sinks=kwargs.get("sinks"))
        return out.reshape(-1, h * layer.v_head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache: bool = True, **kwargs: Any) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """SGLang's CPU graphs (``enable_torch_compile``) are refused: SDPA plans each batch on
        the host."""
        raise LayoutError(f"attention_backend={NAME!r} does not run in SGLang's CPU graphs: "
                          "start SGLang without enable_torch_compile")

    def get_cpu_graph_seq_len_fill_value(self) -> int:
        return self.filler.pool.cfg.pad_seq_len

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing to allocate (the pool holds every buffer); refused where a captured decode
        graph could not replay correctly: SDPA attending (its gather plan is made on the host
        from the batch's lengths) or more rows than the pool has."""
        if self.filler.pool.cfg.num_draft_tokens:
            raise LayoutError(f"attention_backend={NAME!r} captures decode graphs only, not "
                              "speculative decoding's verify and draft graphs: start SGLang "
                              "with disable_cuda_graph=True")
        if self.filler.backend is Backend.SDPA:
            raise LayoutError(f"attention_backend={NAME!r} captures CUDA graphs only with "
                              "flash-attn or FlashInfer attending (SDPA plans each batch on "
                              "the host): install one of them, or start SGLang with "
                              "disable_cuda_graph=True")
        if max_bs > self.filler.sizes.max_requests:
            raise CapacityError(f"CUDA graphs of {max_bs} rows, but the pool has "
                                f"max_requests={self.filler.sizes.max_requests}")

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch,
                                        in_capture: bool = False) -> None:
        """Before a decode graph's capture (``in_capture``): bind the layers' call to the
        captured view. Before a replay: nothing when the graph refills the view itself
        (:meth:`init_forward_metadata_in_graph`, the fused path), else the refill, in place.
        Eager batches go through :meth:`init_forward_metadata` instead."""
        fb = forward_batch
        if not fb.forward_mode.is_decode():
            raise LayoutError(f"attention_backend={NAME!r} captures decode graphs only, got "
                              f"{fb.forward_mode.name}")
        if in_capture:
            self.run = self.filler.capture(fb.batch_size)
        elif not self.filler.recordable:
            self.filler.replay(fb.batch_size, req_pool_indices=fb.req_pool_indices,
                               req_to_token=self.req_to_token, seq_lens=fb.seq_lens)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """Inside the capture: the capturable refill (the fused path), recorded with the graph,
        so that each replay refills the captured view from the graph's input buffers
        (``seq_lens``, ``req_pool_indices``) before its kernels read it; without the fused
        path nothing (the refill runs before each replay)."""
        fb = forward_batch
        if self.filler.recordable:
            self.filler.replay(fb.batch_size, req_pool_indices=fb.req_pool_indices,
                               req_to_token=self.req_to_token, seq_lens=fb.seq_lens,
                               recorded=True)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.filler.pool.cfg.pad_seq_len

    def support_triton(self) -> bool:
        return False


def backend_for(model_runner: Any) -> AttnpoolAttnBackend:
    """The runner's one :class:`AttnpoolAttnBackend` (built on first use, then kept on the
    runner): SGLang builds a draft runner's backends in several places (its own registry call,
    then the draft backend factory's extend and decode backends), and they all share the one
    pool (its draft, draft extend and extend phases never run in the same forward)."""
    got = getattr(model_runner, "_attnpool_backend", None)
    if got is None:
        got = AttnpoolAttnBackend(model_runner)
        model_runner._attnpool_backend = got
    return got


class AttnpoolDraftStep(AttentionBackend):
    """One draft decode step of :class:`AttnpoolDraftSteps`: SGLang sets it as the forward's
    attention backend for that step, and its layers attend through the step's view of
    ``pool.draft`` (bound by the round's :meth:`AttnpoolDraftSteps.init_forward_metadata`)."""

    def __init__(self, base: AttnpoolAttnBackend, step: int) -> None:
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
    one pool (:func:`backend_for`).

    SGLang calls :meth:`init_forward_metadata` once per round with the committed ``seq_lens``
    ``[bs]`` and the round's ``out_cache_loc`` ``[bs * topk * steps]`` (request, branch,
    step), then runs step ``i`` with ``bs * topk`` query rows through ``attn_backends[i]``.
    topk 1 is a chain (step ``i`` reads the committed tokens and the first ``i + 1`` drafts);
    topk > 1 the pool's tree layout: a prefix pass over the committed tokens shared by every
    branch, and an expand pass per branch over its own drafts, merged by log-sum-exp.
    """

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int) -> None:
        self.base = backend_for(model_runner)
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

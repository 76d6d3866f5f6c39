"""vLLM's LoRA metadata (the punica wrapper's index tensors) served from one attnpool arena.

**Seam.** vLLM builds one punica wrapper per LoRA model manager through
``vllm.lora.punica_wrapper.get_punica_wrapper``, which instantiates the class path
``current_platform.get_punica_wrapper()`` returns (CPU: ``...punica_cpu.PunicaWrapperCPU``;
CUDA and ROCm: ``...punica_gpu.PunicaWrapperGPU``). attnpool's plugin
(:func:`attnpool.integrations.vllm.register`, a ``vllm.general_plugins`` entry point that vLLM
loads in its front-end, engine-core and worker processes) replaces that method *on the platform
instance* by one that maps the platform's class path to the subclass here
(:data:`attnpool.integrations.vllm.PUNICA_WRAPPERS`) while ``ATTNPOOL_VLLM=1``; vLLM's files are
not touched and any other class path is returned unchanged.

**Arena.** :class:`PunicaArena` owns one :class:`attnpool.lora.LoRABatchPool` whose
``extra_buffers`` have vLLM's layout: the int64 ``_token_lora_indices``, ``_sampler_indices``,
``_sampler_indices_padded``, ``_embeddings_indices`` ``[max_num_batched_tokens]`` and
``_seq_start_locs``, ``_seq_lengths``, ``_lora_indices_per_batch`` ``[max_batches]`` of
``PunicaWrapperBase``, plus two bool masks (``token_no_lora``, ``sampler_no_lora``) marking the
rows of requests without an adapter. The wrapper's attributes are rebound to these views once,
when it is built (vLLM's own first allocations are dropped then); nothing is allocated after.

**Refill.** :meth:`PunicaArena.refill` is what ``_update_base_metadata`` does here: it reads the
``LoRAMapping`` (host tuples) with numpy, checks every value (:class:`attnpool.PoolError` before
any byte of the arena changes: a mapping longer than ``max_num_batched_tokens``, more runs of one
adapter than ``max_batches``, a slot table larger than the pool's slots, a LoRA id no slot
holds), writes a host image of all the buffers (neutral tails: ``-1`` indices, masks set) and
sends it with one copy: a ``memcpy`` into the arena on the CPU, one non-blocking host-to-device
copy from pinned, double-buffered memory on CUDA. The prefill (sgmv) metadata of vLLM's
``_update_prefill_metadata`` (runs of equal adapters, their starts and lengths, the batch's
``max_length``) is computed in the same pass on the host, so neither ``unique_consecutive`` nor
a host read (``item``) runs on the device tensors.

**Rows without an adapter.** vLLM's torch LoRA ops (the CPU wrapper's) gather
``weights[lora_indices]``, so an index of ``-1`` reads the *last* slot: with every slot holding an
adapter, base rows get that adapter's delta. :class:`AttnpoolPunicaWrapperCPU` zeroes the
shrink output of those rows (``masked_fill_`` with the arena's mask, in place), so the expand adds
nothing to them; the logits and embedding paths are masked the same way. The GPU wrapper's Triton
kernels skip ``-1`` themselves; its subclass (``AttnpoolPunicaWrapperGPU``, built on first use so a
CPU build never imports the Triton ops) only takes the arena and the host refill, and keeps its
``LoRAKernelMeta`` buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from vllm.lora.ops.torch_ops import bgmv_expand, bgmv_shrink
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from ...errors import CapacityError, InputError, PoolError
from ...lora import LoRABatchPool, LoRAConfig

#: vLLM's per-token and per-batch buffers (attribute ``_<name>`` of the wrapper), then the masks.
TOKEN_BUFFERS = ("token_lora_indices", "sampler_indices", "sampler_indices_padded",
                 "embeddings_indices")
BATCH_BUFFERS = ("seq_start_locs", "seq_lengths", "lora_indices_per_batch")
MASKS = ("token_no_lora", "sampler_no_lora")


def _ids(name: str, values: Sequence[int], out: np.ndarray) -> np.ndarray:
    """``values`` (host ints) written into the scratch ``out``; the filled prefix."""
    n = len(values)
    a = out[:n]
    try:
        a[:] = values
    except (TypeError, ValueError, OverflowError) as e:
        raise InputError(f"{name} must hold ints, got {type(values).__name__}") from e
    return a


class PunicaArena:
    """vLLM's punica metadata as views of one :class:`~attnpool.lora.LoRABatchPool` arena.

    Args:
        max_tokens: ``max_num_batched_tokens`` (rows of the per-token buffers).
        max_batches: ``max_num_seqs`` (rows of the per-run buffers).
        max_loras: adapter slots (``lora_config.max_loras``).
        max_lora_rank: ``lora_config.max_lora_rank``.
        device: where the wrapper's tensors live.
    """

    def __init__(self, max_tokens: int, max_batches: int, max_loras: int, max_lora_rank: int,
                 device: torch.device | str) -> None:
        extras = tuple((k, torch.int64, max_tokens) for k in TOKEN_BUFFERS) \
            + tuple((k, torch.int64, max_batches) for k in BATCH_BUFFERS) \
            + tuple((k, torch.bool, max_tokens) for k in MASKS)
        self.cfg = LoRAConfig(max_bs=max_batches, max_loras_per_batch=max_loras,
                              max_lora_rank=max_lora_rank, device=torch.device(device),
                              extra_buffers=extras)
        #: The one allocation (``pool.storage``, a ``torch.empty``); the tensors are its views.
        self.pool = LoRABatchPool(self.cfg)
        self.tensors: dict[str, Tensor] = self.pool.extras
        self.max_tokens, self.max_batches, self.max_loras = max_tokens, max_batches, max_loras
        cuda = self.pool.storage.device.type == "cuda"
        self._images = [torch.empty(self.pool.extras_nbytes, dtype=torch.uint8, pin_memory=cuda)
                        for _ in range(2 if cuda else 1)]
        self._np = [{k: t.numpy() for k, t in self.pool.typed_extras(img).items()}
                    for img in self._images]
        self._bytes = [img.numpy() for img in self._images]
        self._arena_bytes = None if cuda else self.pool.extras_region.numpy()
        self._events: list[torch.cuda.Event | None] = [None] * len(self._images)
        self._turn = 0
        self._tok_ids = np.empty(max_tokens, dtype=np.int64)
        self._req_ids = np.empty(max_tokens, dtype=np.int64)
        self._iota = np.arange(max_tokens, dtype=np.int64)
        #: What the last refill found (vLLM keeps these as Python attributes of the wrapper).
        self.indices_len: list[int] = [0, 0, 0, 0]
        self.batch_size = 0
        self.max_length = 0
        self.token_nums = 0
        self.no_lora = True
        for img in self._np:
            self._neutral(img, 0, 0, 0)
        self._send(0)

    @staticmethod
    def _neutral(img: dict[str, np.ndarray], n: int, m: int, runs: int) -> None:
        """Tails past ``n`` tokens, ``m`` sampled rows and ``runs`` runs: no adapter."""
        img["token_lora_indices"][n:] = -1
        img["embeddings_indices"][n:] = 0
        img["token_no_lora"][n:] = True
        img["sampler_indices"][m:] = -1
        img["sampler_indices_padded"][m:] = 0
        img["sampler_no_lora"][m:] = True
        img["seq_start_locs"][runs:] = n
        img["seq_lengths"][runs:] = 0
        img["lora_indices_per_batch"][runs:] = -1

    def _slots(self, ids: np.ndarray, table: dict[int, int], out: np.ndarray, name: str) -> None:
        """``out[i]``: the slot holding LoRA id ``ids[i]``, ``-1`` for ids <= 0 (no adapter)."""
        out[:] = -1
        for lid, slot in table.items():
            out[ids == lid] = slot
        bad = (ids > 0) & (out < 0)
        if bad.any():
            i = int(np.argmax(bad))
            raise InputError(f"{name}[{i}] is LoRA id {int(ids[i])}, which no slot holds "
                             f"(slots: {sorted(table)})")

    def refill(self, index_mapping: Sequence[int], prompt_mapping: Sequence[int],
               lora_index_to_id: Sequence[int | None], max_loras: int, vocab_size: int) -> None:
        """Rewrite every buffer for one ``LoRAMapping`` (host values), checked before any write
        to the arena, sent with one copy. ``max_loras`` is vLLM's ``lora_slots + 1`` (the
        padded sampler index of rows without an adapter is ``max_loras - 1``)."""
        n, m = len(index_mapping), len(prompt_mapping)
        if n > self.max_tokens:
            raise CapacityError(f"index_mapping has {n} tokens, more than the pool's "
                                f"max_num_batched_tokens={self.max_tokens}")
        if m > self.max_tokens:
            raise CapacityError(f"prompt_mapping has {m} rows, more than the pool's "
                                f"max_num_batched_tokens={self.max_tokens}")
        if len(lora_index_to_id) > self.max_loras:
            raise CapacityError(f"lora_index_to_id has {len(lora_index_to_id)} slots, more than "
                                f"the pool's max_loras={self.max_loras}")
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) \
                or not 1 <= max_loras <= self.max_loras + 1:
            raise CapacityError(f"max_loras must be an int in [1, {self.max_loras + 1}] "
                                f"(slots + 1), got {max_loras!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 0:
            raise InputError(f"vocab_size must be an int >= 0, got {vocab_size!r}")
        table: dict[int, int] = {}
        for slot, lid in enumerate(lora_index_to_id):
            if lid is None:
                continue
            if isinstance(lid, bool) or not isinstance(lid, int) or lid <= 0 or lid in table:
                raise InputError(f"lora_index_to_id[{slot}] must be a distinct LoRA id >= 1 or "
                                 f"None, got {lid!r}")
            table[lid] = slot
        k = self._turn
        ev = self._events[k]
        if ev is not None:
            ev.synchronize()  # the copy that read this image two refills ago is done
        img = self._np[k]
        # The image is private host memory: it is written while checking; the arena only after.
        tok = img["token_lora_indices"][:n]
        self._slots(_ids("index_mapping", index_mapping, self._tok_ids), table, tok,
                     "index_mapping")
        smp = img["sampler_indices"][:m]
        self._slots(_ids("prompt_mapping", prompt_mapping, self._req_ids), table, smp,
                    "prompt_mapping")
        runs, max_length = 0, 0
        if n:
            cuts = np.flatnonzero(tok[1:] != tok[:-1])
            runs = cuts.shape[0] + 1
            if runs > self.max_batches:
                raise CapacityError(f"the mapping has {runs} runs of one adapter, more than the "
                                    f"pool's max_batches={self.max_batches}")
            loc = img["seq_start_locs"]
            loc[0] = 0
            loc[1:runs] = cuts + 1
            lens = img["seq_lengths"]
            lens[: runs - 1] = loc[1:runs] - loc[: runs - 1]
            lens[runs - 1] = n - loc[runs - 1]
            img["lora_indices_per_batch"][:runs] = tok[loc[:runs]]
            max_length = int(lens[:runs].max())
        # Checked: the rest cannot fail.
        np.maximum(tok, 0, out=img["embeddings_indices"][:n])
        img["embeddings_indices"][:n] *= vocab_size
        np.less(tok, 0, out=img["token_no_lora"][:n])
        np.less(smp, 0, out=img["sampler_no_lora"][:m])
        pad = img["sampler_indices_padded"][:m]
        np.copyto(pad, smp)
        pad[img["sampler_no_lora"][:m]] = max_loras - 1
        pad *= m
        pad += self._iota[:m]
        self._neutral(img, n, m, runs)
        self._send(k)
        self.indices_len[:] = [n, m, m, n]
        self.batch_size, self.max_length, self.token_nums = runs, max_length, n
        self.no_lora = runs == 0 or (runs == 1 and bool(tok[0] < 0))

    def _send(self, k: int) -> None:
        """Image ``k`` into the arena: one ``memcpy`` (CPU) or one non-blocking copy (CUDA)."""
        if self._arena_bytes is not None:
            np.copyto(self._arena_bytes, self._bytes[k])
            return
        self.pool.extras_region.copy_(self._images[k], non_blocking=True)
        ev = self._events[k] or torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record()
        self._events[k] = ev
        self._turn = (k + 1) % len(self._images)


class PoolPunicaMixin:
    """The arena and host refill for any ``PunicaWrapperBase`` subclass (first in the MRO)."""

    arena: PunicaArena

    def __init__(self, max_num_batched_tokens: int, max_batches: int,
                 device: torch.device | str, **kwargs: Any) -> None:
        super().__init__(max_num_batched_tokens, max_batches, device,  # type: ignore[call-arg]
                         **kwargs)
        cfg = kwargs.get("lora_config")
        if cfg is None:
            raise PoolError("attnpool's punica wrapper needs vLLM's lora_config (max_loras, "
                            "max_lora_rank)")
        self.arena = PunicaArena(max_num_batched_tokens, max_batches, int(cfg.max_loras),
                                 int(cfg.max_lora_rank), device)
        # vLLM's own first buffers are dropped here: from now on the attributes are views.
        for name, t in self.arena.tensors.items():
            setattr(self, "_" + name, t)
        self._sync_scalars()

    def _sync_scalars(self) -> None:
        a = self.arena
        self.indices_len[:] = a.indices_len  # type: ignore[attr-defined]
        self.batch_size, self.max_length, self.token_nums = a.batch_size, a.max_length, \
            a.token_nums
        self.no_lora = a.no_lora

    def _update_base_metadata(self, mapping: Any, lora_index_to_id: list[int | None],
                              max_loras: int, vocab_size: int) -> None:
        """vLLM's hook for the index tensors: here every buffer, prefill runs included."""
        self.arena.refill(mapping.index_mapping, mapping.prompt_mapping, lora_index_to_id,
                          max_loras, vocab_size)
        self._sync_scalars()

    def _update_prefill_metadata(self, token_lora_tensor: Tensor) -> None:
        """Already written by :meth:`_update_base_metadata` from the host mapping."""


def _drop_rows(y: Tensor, no_lora: Tensor) -> None:
    """Zero the rows of ``y`` (``[rows, ...]``) whose request has no adapter, in place."""
    mask = no_lora[: y.shape[0]]
    y.masked_fill_(mask.view(-1, *([1] * (y.dim() - 1))), 0)


class AttnpoolPunicaWrapperCPU(PoolPunicaMixin, PunicaWrapperCPU):  # type: ignore[misc]
    """vLLM's CPU wrapper over attnpool's arena; rows without an adapter get no LoRA delta."""

    _token_no_lora: Tensor
    _sampler_no_lora: Tensor

    def _shrink_prefill(self, y: Tensor, x: Tensor, w_t_all: Tensor, scale: float) -> None:
        super()._shrink_prefill(y, x, w_t_all, scale)
        if not self.no_lora:
            _drop_rows(y, self._token_no_lora)

    def _shrink_decode(self, y: Tensor, x: Tensor, w_t_all: Tensor, scale: float) -> None:
        super()._shrink_decode(y, x, w_t_all, scale)
        _drop_rows(y, self._token_no_lora)

    def add_lora_embedding(self, y: Tensor, x: Tensor, lora_b_stacked: Tensor,
                           add_inputs: bool = True, **kwargs: Any) -> None:
        if not (self.is_prefill and self.no_lora):
            n = x.shape[0]
            x = x.masked_fill(self._token_no_lora[:n].view(-1, *([1] * (x.dim() - 1))), 0)
        super().add_lora_embedding(y, x, lora_b_stacked, add_inputs, **kwargs)

    def add_lora_logits(self, y: Tensor, x: Tensor, lora_a_stacked: Tensor,
                        lora_b_stacked: Tensor, scale: float, *, buffer: Tensor | None = None,
                        **kwargs: Any) -> None:
        rows = self.sampler_indices
        out = y.view(-1, y.shape[-1])
        inp = x.view(-1, x.shape[-1])
        # vLLM's own per-call scratch when it passes none (its shrink writes only its first
        # rank columns; the expand reads them all), not metadata of the pool
        h = buffer if buffer is not None else torch.zeros(  # ok: vLLM's scratch, as its own
            (inp.shape[0], lora_b_stacked.shape[-1]), dtype=torch.float32, device=inp.device)
        bgmv_shrink(inp, lora_a_stacked, h, rows, scale)
        _drop_rows(h, self._sampler_no_lora)
        bgmv_expand(h, lora_b_stacked, out, rows, add_inputs=True)


def _gpu_wrapper() -> type:
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    class AttnpoolPunicaWrapperGPU(PoolPunicaMixin, PunicaWrapperGPU):  # type: ignore[misc]
        """vLLM's GPU wrapper with its base index tensors in attnpool's arena (the Triton kernels
        skip ``-1`` rows themselves)."""

    AttnpoolPunicaWrapperGPU.__module__ = __name__
    AttnpoolPunicaWrapperGPU.__qualname__ = "AttnpoolPunicaWrapperGPU"
    return AttnpoolPunicaWrapperGPU


_LAZY: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``AttnpoolPunicaWrapperGPU``, built (importing vLLM's GPU wrapper) on first access."""
    if name == "AttnpoolPunicaWrapperGPU":
        if name not in _LAZY:
            _LAZY[name] = _gpu_wrapper()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

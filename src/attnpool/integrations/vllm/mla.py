"""The vLLM backend for multi-head latent attention (DeepSeek V2/V3): importing this imports vLLM.

- :class:`AttnpoolCPUMLABackend` replaces vLLM's ``CPU_MLA`` (what the CPU platform returns for
  MLA models on CPUs without AMX): vLLM's facts for it (dtypes, the 576-wide latent row, block
  size 16, which the CPU platform forces for MLA models) are inherited.
- :class:`AttnpoolMLAMetadataBuilder`: one per KV-cache group, owning the group's pool
  (:class:`.mla_step.LatentFiller`, one SDPA plan per step). Prefill rows
  (:class:`.mla_step.MLAPrefill`, environment variable ``ATTNPOOL_VLLM_MLA_PREFILL``): with
  ``vllm`` (the default) vLLM's MLA builder splits the step into decode rows (first) and
  prefill rows and builds the prefill part, and the pool is refilled from the decode rows; with
  ``attnpool`` the step's metadata says every row is a decode row, so vLLM's layer absorbs every
  query and the pool holds one extend update of all rows (prefill chunks over cached prefixes
  included).
- :class:`AttnpoolMLAImpl`: one per layer. vLLM's MLA layer does the absorption (its ``W_UK``
  and ``W_UV`` from ``kv_b_proj``, made in ``process_weights_after_loading``) around
  :meth:`~AttnpoolMLAImpl.forward_mqa`, which attends with attnpool's absorbed-MLA adapter over
  vLLM's latent cache; the store (:meth:`~AttnpoolMLAImpl.do_kv_cache_update`) is attnpool's
  (:func:`.mla_step.store_latent_`). Under ``VLLM`` prefill rows run vLLM's own path
  (``forward_mha``: the new latents expanded by ``kv_b_proj``, vLLM's CPU SDPA prefill).

Refused when the layer is built (at engine start): an fp8 latent cache, decode context
parallelism, sliding windows, anything but decoder self-attention.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLAAttention,
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from ...errors import LayoutError
from ...kv.mla_shape import MLAShape
from . import MLA_PREFILL
from .mla_step import (
    LatentFiller,
    LatentStep,
    MLAPrefill,
    SlotStaging,
    latent_cache,
    prefill_mode,
    store_latent_,
)
from .runtime import BackendClasses, group_impls
from .step import EngineSizes

logger = init_logger("vllm.plugins.attnpool")


@dataclass
class AttnpoolMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus attnpool's refilled decode view and plan (``latent``)."""

    latent: LatentStep | None = None


class AttnpoolMLAImpl(CPUMLAImpl):
    """One MLA layer: attnpool's latent store and absorbed attention (see the module
    docstring)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args: Any) -> None:
        if kv_cache_dtype != "auto":
            raise LayoutError(f"attnpool's vLLM MLA backend does not serve an fp8 latent cache "
                              f"(kv_cache_dtype={kv_cache_dtype!r})")
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        cfg = get_current_vllm_config()
        if cfg.parallel_config.decode_context_parallel_size > 1:
            raise LayoutError("attnpool's vLLM MLA backend does not serve decode context "
                              "parallelism")
        #: the layer's head sizes, as attnpool's MLA adapter reads them
        self.shape = MLAShape(num_heads=num_heads, qk_nope_head_dim=self.qk_nope_head_dim,
                              qk_rope_head_dim=self.qk_rope_head_dim,
                              v_head_dim=self.v_head_dim, kv_lora_rank=self.kv_lora_rank)
        self._slots = SlotStaging(cfg.scheduler_config.max_num_batched_tokens,
                                  cfg.cache_config.block_size,
                                  torch.device(cfg.device_config.device))

    def forward_mqa(self, q: Tensor | tuple[Tensor, Tensor], kv_c_and_k_pe_cache: Tensor,
                    attn_metadata: MLACommonMetadata, layer: Any) -> tuple[Tensor, None]:
        """The latent output ``[T, H, L]`` (vLLM applies ``W_UV``) of the rows attnpool attends
        (the decode rows, or every row: :class:`.mla_step.MLAPrefill`) from their absorbed
        query: ``(q_nope · W_UK [T, H, L], q_pe [T, H, R])`` or packed."""
        decode = attn_metadata.decode
        if not isinstance(decode, AttnpoolMLADecodeMetadata) or decode.latent is None:
            raise LayoutError(f"attnpool's MLA layer reads attnpool's decode metadata, got "
                              f"{type(decode).__name__}")
        q_lat, q_pe = q if isinstance(q, tuple) else (q, None)
        return decode.latent.run(q_lat, kv_c_and_k_pe_cache, self.scale, q_pe=q_pe), None

    def do_kv_cache_update(self, kv_c_normed: Tensor, k_pe: Tensor, kv_cache: Tensor,
                           slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor) -> None:
        """Store the step's latent rows at ``slot_mapping`` (-1: padding, sent to the null
        block) without reading the slots on the host."""
        if kv_cache.numel() == 0:  # vLLM's warm-up, before the caches exist
            return
        blocks, offsets = self._slots.index(slot_mapping.flatten())
        store_latent_(latent_cache(kv_cache, self.shape), kv_c_normed, k_pe, blocks, offsets)


class AttnpoolMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """One MLA KV-cache group: its pool, refilled by every :meth:`build` from the decode rows
    (vLLM's split and prefill metadata kept) or from every row (see the module docstring)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        impls = group_impls(vllm_config, MLAAttention, AttnpoolMLAImpl, layer_names)
        shapes = {i.shape for i in impls}
        if len(shapes) != 1:
            raise LayoutError(f"one MLA shape per KV-cache group, got {sorted(map(str, shapes))}")
        sched, model = vllm_config.scheduler_config, vllm_config.model_config
        sizes = EngineSizes(
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_model_len=model.max_model_len, block_size=kv_cache_spec.block_size,
            sliding_window=None, num_blocks=vllm_config.cache_config.num_gpu_blocks,
            device=torch.device(device))
        self.filler = LatentFiller(sizes, shapes.pop(), model.dtype)
        self.prefill = prefill_mode(os.environ.get(MLA_PREFILL, MLAPrefill.VLLM.value))
        logger.info("attnpool serves MLA attention of %d layers (prefill rows: %s): one pool "
                    "of %d bytes, max_bs %d, %d tokens, block size %d", len(impls),
                    self.prefill.value, self.filler.pool.nbytes, sizes.max_num_seqs,
                    sizes.max_num_batched_tokens, sizes.block_size)

    def build(self, common_prefix_len: int, common_attn_metadata: Any,
              fast_build: bool = False) -> MLACommonMetadata:
        """The step's metadata: vLLM's split with attnpool's decode part (``VLLM``), or every
        row attnpool's (``ATTNPOOL``: reported to vLLM's layer as decode rows, so it absorbs
        every query and calls :meth:`AttnpoolMLAImpl.forward_mqa` once for all of them)."""
        if self.prefill is MLAPrefill.VLLM:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        n, t = cm.num_reqs, cm.num_actual_tokens
        seq_lens, table = cm.seq_lens[:n], cm.block_table_tensor[:n]
        step = self.filler.fill(seq_lens=seq_lens, block_table=table, num_tokens=t,
                                query_start_loc=None if cm.max_query_len == 1
                                else cm.query_start_loc)
        decode = AttnpoolMLADecodeMetadata(block_table=table, seq_lens=seq_lens,
                                           dcp_tot_seq_lens=None, latent=step)
        return self.metadata_cls(num_reqs=n, max_query_len=cm.max_query_len,
                                 max_seq_len=cm.max_seq_len, num_actual_tokens=t,
                                 query_start_loc=cm.query_start_loc,
                                 slot_mapping=cm.slot_mapping,
                                 head_dim=self.model_config.get_head_size(), num_decodes=n,
                                 num_decode_tokens=t, num_prefills=0, prefill=None,
                                 decode=decode)

    def _build_decode(self, block_table_tensor: Tensor, seq_lens_device: Tensor,
                      max_seq_len: int, query_start_loc_cpu: Tensor,
                      query_start_loc_device: Tensor, num_decode_tokens: int,
                      max_query_len: int, dcp_tot_seq_lens_device: Tensor | None
                      ) -> AttnpoolMLADecodeMetadata:
        """The decode rows' part of the step (vLLM passes the first ``num_decodes`` rows'
        block table and lengths): attnpool's pool refilled from them."""
        latent = self.filler.fill(seq_lens=seq_lens_device, block_table=block_table_tensor,
                                  num_tokens=seq_lens_device.shape[0])
        return AttnpoolMLADecodeMetadata(block_table=block_table_tensor,
                                         seq_lens=seq_lens_device,
                                         dcp_tot_seq_lens=dcp_tot_seq_lens_device,
                                         latent=latent)


class AttnpoolCPUMLABackend(BackendClasses, CPUMLABackend):
    """vLLM's ``CPU_MLA`` slot, served by attnpool (same name: vLLM looks it up by it)."""

    impl, builder = AttnpoolMLAImpl, AttnpoolMLAMetadataBuilder

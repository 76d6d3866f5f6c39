"""The dimensions of a multi-head latent attention (MLA) layer, and what its two cache forms cost.

DeepSeek V2/V3 attention projects each token's KV to a small latent ``c_kv`` (``kv_lora_rank``
wide) plus a shared rope key ``k_pe`` (``rope_dim`` wide), and expands the latent per head
(``kv_b_proj``) into keys of ``qk_nope_head_dim`` and values of ``v_head_dim``. A cache can hold
either form:

* **latent**: one row ``[c_kv | k_pe]`` per token and layer, one head
  (``KVCachePool(KVCacheConfig(kind=KVKind.MLA, kv_lora_rank=L, rope_dim=R))``); attention then
  runs absorbed (:mod:`attnpool.adapters.mla`);
* **expanded**: per head a key ``[k_nope | k_pe]`` (``nope + rope``) and a value (``v``), what
  transformers hands an attention function (``KVCacheConfig(head_dim=nope + rope,
  head_dim_v=v, num_kv_heads=H)``).

:class:`MLAShape` names the five numbers once, so the absorption helpers, the adapters and the
byte accounting below read the same ones. The byte counts are the cache configs' own
(:attr:`attnpool.KVCacheConfig.bytes_per_token`), never a second formula.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import is_int
from ..errors import InputError
from .config import KVCacheConfig, KVKind


@dataclass(frozen=True, slots=True)
class MLAShape:
    """The head sizes of one MLA layer (DeepSeek's config names).

    Attributes:
        num_heads: query heads ``H`` of the layer (per tensor-parallel rank, if sharded).
        qk_nope_head_dim: per-head key/query part without rope (128 in V2/V3).
        qk_rope_head_dim: the rope part, shared by all heads in the cache (64).
        v_head_dim: per-head value size (128).
        kv_lora_rank: the latent width ``L`` (512).
    """

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise InputError(f"MLAShape: {name} must be an int >= 1, got {v!r}")
        if not is_int(self.qk_rope_head_dim) or self.qk_rope_head_dim < 0:
            raise InputError(f"MLAShape: qk_rope_head_dim must be an int >= 0, got "
                             f"{self.qk_rope_head_dim!r}")

    @property
    def latent_row(self) -> int:
        """Columns of one cached latent row and of an absorbed query: ``L + R``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """The unabsorbed query/key head size, ``nope + rope`` (192 in V2/V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``(nope + rope) ** -0.5``: absorption changes the dot product's width, not its value,
        so the scale stays the unabsorbed head's (FlashInfer's MLA docs: "use head dimension
        before matrix absorption"). A model with a scaling of its own (YaRN's ``mscale``) passes
        its scale explicitly."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    def latent_config(self, num_pages: int, page_size: int, *, dtype: torch.dtype,
                      num_layers: int = 1, max_tokens: int = 1,
                      device: str | torch.device = "cpu") -> KVCacheConfig:
        """The :class:`KVCacheConfig` of a latent cache of this shape."""
        return KVCacheConfig(num_pages, page_size, max_tokens, num_layers, kind=KVKind.MLA,
                             kv_lora_rank=self.kv_lora_rank, rope_dim=self.qk_rope_head_dim,
                             dtype=dtype, device=device)

    def expanded_config(self, num_pages: int, page_size: int, *, dtype: torch.dtype,
                        num_layers: int = 1, max_tokens: int = 1,
                        device: str | torch.device = "cpu") -> KVCacheConfig:
        """The :class:`KVCacheConfig` of the expanded per-head cache of this shape: a key of
        ``nope + rope`` and a value of ``v`` per head (the same argument order as
        :meth:`latent_config`)."""
        return KVCacheConfig(num_pages, page_size, max_tokens, num_layers, kind=KVKind.MHA,
                             num_kv_heads=self.num_heads, head_dim=self.qk_head_dim,
                             head_dim_v=self.v_head_dim, dtype=dtype, device=device)


@dataclass(frozen=True, slots=True)
class MLACacheBytes:
    """Bytes of the two cache forms of one :class:`MLAShape`, per token and layer.

    Attributes:
        latent: one ``[c_kv | k_pe]`` row (``(L + R) * itemsize``).
        expanded: per head a key (``nope + rope``) and a value (``v``).
        ratio: ``expanded / latent``.
    """

    latent: int
    expanded: int
    ratio: float


def cache_bytes_per_token(shape: MLAShape, dtype: torch.dtype) -> MLACacheBytes:
    """KV bytes per token and layer of the latent vs the expanded cache, in ``dtype``, from the
    cache configs' byte accounting (one layer, so ``bytes_per_token`` is per layer)."""
    lat = shape.latent_config(2, 1, dtype=dtype).bytes_per_token
    exp = shape.expanded_config(2, 1, dtype=dtype).bytes_per_token
    return MLACacheBytes(lat, exp, exp / lat)


def tokens_in_budget(shape: MLAShape, dtype: torch.dtype, *, budget_bytes: int,
                     num_layers: int) -> tuple[int, int]:
    """``(latent, expanded)``: tokens whose KV of ``num_layers`` layers fits ``budget_bytes``
    in each form (whole tokens, pages and the pad page not counted)."""
    if not is_int(budget_bytes) or budget_bytes < 0 or not is_int(num_layers) or num_layers < 1:
        raise InputError(f"budget_bytes must be an int >= 0 and num_layers an int >= 1, got "
                         f"{budget_bytes!r}, {num_layers!r}")
    b = cache_bytes_per_token(shape, dtype)
    return budget_bytes // (b.latent * num_layers), budget_bytes // (b.expanded * num_layers)

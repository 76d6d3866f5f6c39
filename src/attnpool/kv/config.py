"""Configuration of a paged KV cache: sizes, kind (MHA / MLA), page layout and element type."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..config import align, is_int, resolve_device
from ..errors import PoolError


class KVLayout(enum.Enum):
    """Order of one page: ``NHD`` = ``[page_size, heads, dim]`` (flash-attn's), ``HND`` =
    ``[heads, page_size, dim]`` (a FlashInfer option)."""

    NHD = "nhd"
    HND = "hnd"


class KVKind(enum.Enum):
    """``MHA`` (and GQA/MQA): separate K and V caches. ``MLA``: one latent+rope cache, one head."""

    MHA = "mha"
    MLA = "mla"


#: page 0 of every layer part: padded rows read it, so it is zeroed once and never handed out
PAD_PAGE = 0


def fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >> shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def _int(name: str, v: object, lo: int) -> None:
    if not is_int(v) or v < lo:
        raise PoolError(f"KVCacheConfig: {name} must be an int >= {lo}, got {v!r}")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Sizes of a paged KV cache. Frozen: the cache never changes shape.

    Args:
        num_pages: pages per layer part, the pad page 0 included (so ``>= 2``).
        page_size: tokens per page.
        max_tokens: capacity of ``slot_mapping``: tokens of the largest captured forward.
        num_layers: attention layers sharing the allocation.
        kind: :class:`KVKind` (MHA needs ``num_kv_heads`` and ``head_dim``; MLA needs
            ``kv_lora_rank`` and may have ``rope_dim``, with one head and ``head_dim = 0``).
        dtype: element type, a floating type. ``float8_e4m3fn`` / ``float8_e5m2`` make a quantized
            cache: stores take model-dtype K/V plus scales and quantize (:mod:`attnpool.kv.quant`).
        layout: page order (:class:`KVLayout`); irrelevant for MLA's single head.
        device: ``"cpu"``, ``"cuda"``, a ``torch.device``, or ``"auto"``.
        head_dim_v: MHA only, keyword-only: V's head size when it differs from K's (DeepSeek-style
            192 / 128 heads, where the query/key head is ``nope + rope`` wide and the value head
            is not). ``None`` means ``head_dim`` and is resolved to it at construction, so
            ``cfg.head_dim_v`` is always V's size for MHA; an MLA cache refuses it (its single
            row is ``kv_lora_rank + rope_dim``). K and V then keep rows of their own sizes in
            the same allocation (:class:`attnpool.KVCachePool`).
    """

    num_pages: int
    page_size: int
    max_tokens: int
    num_layers: int = 1
    kind: KVKind = KVKind.MHA
    num_kv_heads: int = 1
    head_dim: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    dtype: torch.dtype = torch.float16
    layout: KVLayout = KVLayout.NHD
    device: str | torch.device = "auto"
    head_dim_v: int | None = field(default=None, kw_only=True)
    _device: torch.device = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _int("num_pages", self.num_pages, 2)
        for name in ("page_size", "max_tokens", "num_layers", "num_kv_heads"):
            _int(name, getattr(self, name), 1)
        for name in ("head_dim", "kv_lora_rank", "rope_dim"):
            _int(name, getattr(self, name), 0)
        if not isinstance(self.kind, KVKind) or not isinstance(self.layout, KVLayout):
            raise PoolError(f"KVCacheConfig: kind must be a KVKind and layout a KVLayout, got "
                            f"{self.kind!r}, {self.layout!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise PoolError(f"KVCacheConfig: dtype must be a floating torch.dtype, got {self.dtype!r}")
        mha = self.head_dim >= 1 and not (self.kv_lora_rank or self.rope_dim)
        mla = self.kv_lora_rank >= 1 and not self.head_dim and self.num_kv_heads == 1
        if not (mha if self.kind is KVKind.MHA else mla):
            need = ("head_dim >= 1, kv_lora_rank = rope_dim = 0" if self.kind is KVKind.MHA else
                    "kv_lora_rank >= 1, head_dim = 0, num_kv_heads = 1")
            raise PoolError(f"KVCacheConfig: {self.kind.name} needs {need}; got head_dim="
                            f"{self.head_dim}, kv_lora_rank={self.kv_lora_rank}, rope_dim="
                            f"{self.rope_dim}, num_kv_heads={self.num_kv_heads}")
        if self.head_dim_v is None:
            if self.kind is KVKind.MHA:
                object.__setattr__(self, "head_dim_v", self.head_dim)
        elif self.kind is not KVKind.MHA:
            raise PoolError(f"KVCacheConfig: head_dim_v is for MHA caches (separate K and V "
                            f"rows); an MLA cache has one latent + rope row (kv_lora_rank, "
                            f"rope_dim), got head_dim_v={self.head_dim_v!r}")
        else:
            _int("head_dim_v", self.head_dim_v, 1)
        object.__setattr__(self, "_device", resolve_device(self.device))

    @property
    def torch_device(self) -> torch.device:
        """Where the cache's pages live (``"auto"`` resolved once, at construction: a pool never
        moves)."""
        return self._device

    @property
    def parts(self) -> int:
        """Caches per layer: 2 (K, V) for MHA, 1 for MLA."""
        return 2 if self.kind is KVKind.MHA else 1

    @property
    def row_dim(self) -> int:
        """Elements per token and head of the first part: ``head_dim`` (K's row), or latent +
        rope for MLA. V's row is :attr:`head_dim_v` (see :attr:`part_dims`)."""
        return self.head_dim if self.kind is KVKind.MHA else self.kv_lora_rank + self.rope_dim

    @property
    def part_dims(self) -> tuple[int, ...]:
        """Elements per token and head of each part: ``(head_dim, head_dim_v)`` for MHA,
        ``(kv_lora_rank + rope_dim,)`` for MLA. Every size and byte count sums these, so a cache
        whose V rows are narrower than its K rows costs exactly K rows plus V rows."""
        if self.kind is KVKind.MHA:
            return (self.head_dim, self.head_dim if self.head_dim_v is None else self.head_dim_v)
        return (self.row_dim,)

    @property
    def equal_parts(self) -> bool:
        """Whether every part has the same row size (always for MLA; for MHA, ``head_dim_v ==
        head_dim``): only then is the cache one ``[layers, parts, pages + 1, ...]`` tensor."""
        return len(set(self.part_dims)) == 1

    @property
    def num_slots(self) -> int:
        """Token slots per layer part, the pad page's included."""
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token takes across all layers and parts."""
        per = self.num_kv_heads * sum(self.part_dims) * self.dtype.itemsize
        return self.num_layers * per

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    @property
    def cache_nbytes(self) -> int:
        """Bytes of every layer part's pages, one hidden scratch page each included."""
        return (self.num_layers * (self.num_pages + 1) * self.page_size
                * self.num_kv_heads * sum(self.part_dims) * self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes of the :class:`attnpool.KVCachePool` this config allocates (one allocation:
        the pages, aligned, then the ``[max_tokens]`` int64 slot mapping). Arithmetic only."""
        return align(self.cache_nbytes) + self.max_tokens * 8

    def report(self) -> str:
        """The cache's plan (shape, bytes per token and page, total), computed without allocating:
        an fp8 cache shows half the bytes of a float16 one."""
        h, (d, *dv) = self.num_kv_heads, self.part_dims
        what = (f"latent {self.kv_lora_rank} + rope {self.rope_dim}" if self.kind is KVKind.MLA
                else f"K, V x {h} heads x {d}" if self.equal_parts
                else f"K x {h} heads x {d}, V x {h} heads x {dv[0]}")
        return "\n".join([
            f"kv cache: {self.kind.name} {self.layout.name} "
            f"{str(self.dtype).removeprefix('torch.')}, {self.num_layers} layers x "
            f"{self.num_pages} pages x {self.page_size} tokens ({what})",
            f"bytes per token: {self.bytes_per_token} ({fmt_bytes(self.bytes_per_token)})",
            f"bytes per page:  {self.bytes_per_page} ({fmt_bytes(self.bytes_per_page)})",
            f"usable pages:    {self.num_pages - 1} (page {PAD_PAGE} is the pad page; plus one "
            "hidden scratch page per layer part)",
            f"slot_mapping:    [{self.max_tokens}] int64",
            f"total:           {fmt_bytes(self.nbytes)} (one allocation)",
        ])

    def page_shape(self, part: int = 0) -> tuple[int, int, int]:
        """One page of part ``part`` (0: K or the MLA row, 1: V) in the cache's layout."""
        h, p, d = self.num_kv_heads, self.page_size, self.part_dims[part]
        return (p, h, d) if self.layout is KVLayout.NHD else (h, p, d)

"""Paged KV-cache pool: every layer's pages and the slot mapping in one ``torch.empty``.

Layout. One uint8 allocation holds the cache ``[num_layers, parts, num_pages + 1, ...page]`` and,
on the next 256-byte boundary, ``slot_mapping [max_tokens] int64``. MHA has two parts (K and V),
each page ``[page_size, num_kv_heads, head_dim]`` (``KVLayout.NHD``, flash-attn's order) or
``[num_kv_heads, page_size, head_dim]`` (``KVLayout.HND``, a FlashInfer option). MLA has one part
whose row is the latent (``kv_lora_rank``) followed by the rope part (``rope_dim``), one head.

K and V of different head sizes (``KVCacheConfig(head_dim_v=)``): the same bytes in the same
order, layer by layer, K's ``num_pages + 1`` pages of ``head_dim`` rows followed by V's of
``head_dim_v`` rows, so no byte is spent on padding and the equal-size cache is the special case.
Each part is then its own strided view ``[num_layers, num_pages + 1, ...page]`` of the one
allocation (a layer's pages stay contiguous); there is no stacked ``[.., parts, ..]`` tensor.

Pages. Page 0 is the **pad page**: attention metadata of padded rows points there (``pad_page = 0``
in :class:`attnpool.PoolConfig`), so the engine's allocator must never hand it out. It is zeroed at
construction (the constructor's only write): padded rows then compute finite, discarded values.
Each layer part also has one hidden **scratch page** after the last user page: the reference store
sends skipped tokens there instead of branching, which keeps it free of host syncs. Users see
``[num_pages, ...]`` views; the scratch page's bytes are meaningless.

Why ``torch.empty`` is safe: attention reads only the tokens ``< cache_seqlens`` of a row, and every
such token was written by a store first; the pad page is written at construction. No memset of the
cache ever happens (a multi-GiB memset is what a zero-filled cache costs engines at start-up).

Slots. Token slot ``s`` is offset ``s % page_size`` of page ``s // page_size``. ``slot_mapping``
holds, per token of a forward, where its new K/V go; padded tokens have ``-1`` and stores skip
them. ``update_slots_`` writes the real slots and ``-1`` for the rest of the captured size from a
device tensor, with no host sync, so a CUDA graph captured on ``slot_view(bs)`` stays valid.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..arena import sentinel
from ..check import ReadRegionError
from ..config import Impl, align, is_int, resolve_impl
from ..errors import CapacityError, InputError, LayoutError, PoolError
from ..inputs import check_count, check_tensor
from .config import PAD_PAGE, KVCacheConfig, KVKind, KVLayout
from .quant import MODEL_DTYPES, check_scales, dequantize, is_fp8, store_reference_
from .step import Parts, StepStore

__all__ = ["KVCacheConfig", "KVCachePool", "KVKind", "KVLayout", "StepStore", "store_reference_"]


class KVCachePool:
    """A paged KV cache and its ``slot_mapping``, allocated with one ``torch.empty``.

    Args:
        cfg: :class:`KVCacheConfig`.
        poison: fill the cache with NaN and ``slot_mapping`` with int64 max (the pad page is still
            zeroed), so :meth:`check_written` and :meth:`check_slots` find anything read unwritten.
    """

    def __init__(self, cfg: KVCacheConfig, poison: bool = False) -> None:
        if not isinstance(cfg, KVCacheConfig):
            raise PoolError(f"KVCachePool expects a KVCacheConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.poisoned = poison
        cache_nbytes = cfg.cache_nbytes
        off = align(cache_nbytes)
        self.nbytes = cfg.nbytes
        # The one allocation. torch.empty: no memset (see the module docstring).
        self.storage = torch.empty(self.nbytes, dtype=torch.uint8, device=cfg.torch_device)
        self._flat = self.storage[:cache_nbytes].view(cfg.dtype)
        #: every layer part stacked ``[num_layers, parts, num_pages + 1, ...page]`` when the parts'
        #: rows have one size (always but for K != V head sizes); None otherwise
        self._cache: Tensor | None = None
        if cfg.equal_parts:
            self._cache = self._flat.view(cfg.num_layers, cfg.parts, cfg.num_pages + 1,
                                          *cfg.page_shape())
            self._regions = tuple(self._cache[:, i] for i in range(cfg.parts))
        else:
            self._regions = _carve(self._flat, cfg)
        #: ``[max_tokens] int64``: where each token of a forward stores its K/V (-1: skip).
        self.slot_mapping = self.storage[off:].view(torch.int64)
        self._valid_tokens = 0
        if poison:
            self.poison_()
        else:
            self._zero_pad_pages()

    def _zero_pad_pages(self) -> None:
        """Zero page 0 of every layer part: one op on the stacked cache, one per part otherwise."""
        if self._cache is not None:
            self._cache[:, :, PAD_PAGE].zero_()
        else:
            for r in self._regions:
                r[:, PAD_PAGE].zero_()

    # ---- views ---------------------------------------------------------------------------------
    def _part(self, layer: int, part: int) -> Tensor:
        """Layer part with the scratch page, in NHD order ``[num_pages + 1, P, H, row_dim]``."""
        if not is_int(layer) or not 0 <= layer < self.cfg.num_layers:
            raise InputError(f"layer must be an int in [0, {self.cfg.num_layers}), got {layer!r}")
        t = self._regions[part][layer]
        return t if self.cfg.layout is KVLayout.NHD else t.transpose(1, 2)

    def _pages(self, kind: KVKind, layer: int, part: int) -> Tensor:
        if self.cfg.kind is not kind:
            raise LayoutError(f"this cache is {self.cfg.kind.name}, the call needs {kind.name}")
        self._part(layer, part)  # validates layer
        return self._regions[part][layer, : self.cfg.num_pages]

    def k_cache(self, layer: int) -> Tensor:
        """MHA K pages of ``layer``: ``[num_pages, P, H, D]`` (NHD) or ``[num_pages, H, P, D]``
        (contiguous)."""
        return self._pages(KVKind.MHA, layer, 0)

    def v_cache(self, layer: int) -> Tensor:
        """MHA V pages of ``layer``: :meth:`k_cache`'s shape with ``head_dim_v`` last
        (contiguous)."""
        return self._pages(KVKind.MHA, layer, 1)

    def kv_cache(self, layer: int) -> Tensor:
        """MLA pages of ``layer``: ``[num_pages, P, 1, kv_lora_rank + rope_dim]``. An MHA cache
        has no such single tensor (its K and V are separate parts, of different row sizes when
        ``head_dim_v != head_dim``): :meth:`k_cache` and :meth:`v_cache` give them."""
        return self._pages(KVKind.MLA, layer, 0)

    def latent_cache(self, layer: int) -> Tensor:
        """The latent columns of :meth:`kv_cache` (a strided view)."""
        return self.kv_cache(layer)[..., : self.cfg.kv_lora_rank]

    def rope_cache(self, layer: int) -> Tensor:
        """The rope columns of :meth:`kv_cache` (a strided view)."""
        return self.kv_cache(layer)[..., self.cfg.kv_lora_rank :]

    # ---- slot mapping --------------------------------------------------------------------------
    def _check_bs(self, bs: object) -> int:
        return check_count(bs, self.cfg.max_tokens, "max_tokens")

    def slot_view(self, bs: int) -> Tensor:
        """``slot_mapping[:bs]`` for capture: elements never written yet are set to ``-1`` first,
        so a captured store skips every token until an update writes real slots."""
        self._check_bs(bs)
        if self._valid_tokens < bs:
            self.slot_mapping[self._valid_tokens : bs].fill_(-1)
            self._valid_tokens = bs
        return self.slot_mapping[:bs]

    def update_slots_(self, slots: Tensor, bs: int | None = None) -> Tensor:
        """Copy ``slots [n]`` (int32/int64, on the cache's device) into ``slot_mapping[:n]`` and
        write ``-1`` to ``[n, bs)``; return ``slot_mapping[:bs]``. Two in-place ops, no host
        sync. Replay the graph captured for the same ``bs``: elements past ``bs`` are not
        rewritten and may hold older slots."""
        self._check_tensor("slots", slots, 1, (torch.int32, torch.int64))
        n = slots.shape[0]
        bs = n if bs is None else bs
        self._check_bs(bs)
        if n > bs:
            raise CapacityError(f"slots has {n} tokens, more than bs={bs}")
        self.slot_mapping[:n].copy_(slots)
        self.slot_mapping[n:bs].fill_(-1)
        self._valid_tokens = max(self._valid_tokens, bs)
        return self.slot_mapping[:bs]

    # ---- stores --------------------------------------------------------------------------------
    def _check_tensor(self, name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...]
                      ) -> Tensor:
        """The shared tensor check against the storage's device (``"cpu:0"`` and ``"cuda"``
        resolve to what tensors report); strided 1-D inputs are fine here (the stores read
        them through their stride)."""
        return check_tensor(name, t, None, ndim, dtypes, device=self.storage.device,
                            contiguous=False)

    def _src(self, name: str, t: object, n: int | None, dim: int) -> Tensor:
        """A source ``[n, H, dim]`` with unit last stride (2-D for one head): of the cache dtype, or
        of a model dtype for an fp8 cache (which quantizes)."""
        heads = self.cfg.num_kv_heads
        if isinstance(t, Tensor) and t.dim() == 2 and heads == 1:
            t = t.unsqueeze(1)  # a view
        dtypes = MODEL_DTYPES if is_fp8(self.cfg.dtype) else (self.cfg.dtype,)
        src = self._check_tensor(name, t, 3, dtypes)
        if tuple(src.shape[1:]) != (heads, dim) or (n is not None and src.shape[0] != n):
            want = ", ".join(map(str, ("n" if n is None else n, heads, dim)))
            raise InputError(f"{name} must have shape ({want}), got {tuple(src.shape)}")
        if src.shape[0] and dim and src.stride(2) != 1:
            raise InputError(f"{name} must have stride 1 in its last dim, got {src.stride()}")
        lo = self.storage.data_ptr()
        if src.numel() and lo <= src.data_ptr() < lo + self.cfg.cache_nbytes:
            # a source read from the cache while the store writes the cache: refused
            raise InputError(f"{name} must not alias the cache's own pages (copy it first), "
                             f"got a tensor at cache offset {src.data_ptr() - lo}")
        return src

    def _slots(self, slot_mapping: Tensor | None, n: int) -> Tensor:
        if slot_mapping is None:
            if n > self.cfg.max_tokens:
                raise CapacityError(f"{n} tokens > max_tokens={self.cfg.max_tokens}")
            return self.slot_mapping[:n]
        s = self._check_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
        if s.shape[0] != n:
            raise InputError(f"slot_mapping must have {n} elements (one per token), got {s.shape[0]}")
        return s

    def _check_range(self, slots: Tensor, err: type[PoolError] = CapacityError) -> None:
        """Debug check (syncs): every slot is -1 or a distinct slot past the pad page."""
        vals: list[int] = slots.detach().cpu().tolist()
        lo, hi = self.cfg.page_size, self.cfg.num_slots
        for i, s in enumerate(vals):
            if s != -1 and not lo <= s < hi:
                raise err(f"slot_mapping[{i}] is {s}, expected -1 or in [{lo}, {hi})")
        real = [s for s in vals if s != -1]
        if len(set(real)) != len(real):
            raise err("slot_mapping has repeated slots; each token needs its own slot")

    def _scales(self, named: tuple[tuple[str, object], ...], check: bool) -> tuple[Tensor, ...] | None:
        return check_scales(self.cfg.dtype, self.cfg.num_kv_heads, self.storage.device, named, check)

    def _store(self, pairs: tuple[tuple[Tensor, Tensor], ...], slots: Tensor, impl: Impl,
               check_range: bool, scales: tuple[Tensor, ...] | None) -> None:
        if not isinstance(impl, Impl):
            raise InputError(f"impl must be an attnpool.Impl, got {impl!r}")
        fused = resolve_impl(impl, self.cfg.torch_device) is Impl.TRITON
        if check_range:
            self._check_range(slots)
        p, ns = self.cfg.page_size, self.cfg.num_slots
        if fused:
            from . import store_kernels

            a, b = pairs if len(pairs) == 2 else (pairs[0], (pairs[0][0][:, :, :0], pairs[0][1]))
            sc = None if scales is None else (scales[0], scales[-1])
            store_kernels.store_((a, b), slots, p, ns, sc)
        else:
            store_reference_(pairs, slots, p, ns, scales)

    def store_kv_(self, layer: int, k: Tensor, v: Tensor, slot_mapping: Tensor | None = None, *,
                  k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                  impl: Impl = Impl.AUTO, check_range: bool = False, check_scales: bool = True
                  ) -> None:
        """MHA: write ``k``, ``v`` ``[n, H, D]`` at ``slot_mapping [n]`` (default: the pool's
        ``slot_mapping[:n]``); tokens whose slot is negative are skipped.

        fp8 cache: ``k``, ``v`` are float16/bfloat16/float32 and ``k_scale``, ``v_scale`` (float32,
        1 or ``H`` elements, on the cache's device) are required; the store writes
        ``clamp(x / scale, +-fp8 max)`` rounded to nearest even (:mod:`attnpool.kv.quant`). Other
        caches refuse scales. ``check_scales`` reads the scales to the host once per call (one
        small sync) to refuse ``<= 0``, NaN and inf before anything is written; it is skipped while
        a CUDA graph is being captured. Pass ``False`` on a hot path once the scales are known good.

        ``impl``: ``AUTO`` uses the fused Triton store on CUDA when triton imports, else the torch
        reference; ``TRITON`` forces the fused store (on CPU only under ``TRITON_INTERPRET=1``).
        Shapes, dtypes and devices are checked before any write; slot values are not (that needs a
        sync) unless ``check_range=True``, a debugging aid. Slots past the cache are skipped.
        """
        self._pages(KVKind.MHA, layer, 0)
        kp, vp = self._part(layer, 0), self._part(layer, 1)
        dk, dv = self.cfg.part_dims
        k_ = self._src("k", k, None, dk)
        v_ = self._src("v", v, k_.shape[0], dv)
        slots = self._slots(slot_mapping, k_.shape[0])
        sc = self._scales((("k_scale", k_scale), ("v_scale", v_scale)), check_scales)
        self._store(((k_, kp), (v_, vp)), slots, impl, check_range, sc)

    @functools.cached_property
    def _layer_parts(self) -> tuple[Parts, Parts]:
        """Every MHA layer's ``(K, V)`` parts in NHD order (scratch page included), and the same
        flattened to token rows (NHD caches): looked up once, the cache never moves."""
        parts = tuple((self._part(i, 0), self._part(i, 1)) for i in range(self.cfg.num_layers))
        if self.cfg.layout is not KVLayout.NHD:
            return parts, parts
        h, (dk, dv) = self.cfg.num_kv_heads, self.cfg.part_dims
        return parts, tuple((a.view(-1, h, dk), b.view(-1, h, dv)) for a, b in parts)

    def step_store(self, n: int, *, impl: Impl = Impl.AUTO) -> StepStore:
        """The store of one forward of ``n`` tokens at ``slot_mapping[:n]``, for every layer
        (:class:`StepStore`): call it after :meth:`update_slots_`, once per step, and
        ``store(layer, k, v)`` in each layer. Same bytes as :meth:`store_kv_` per layer, without
        recomputing each slot's page and offset and re-checking the cache on every call."""
        if self.cfg.kind is not KVKind.MHA:
            raise LayoutError(f"a step store writes K and V (an MHA cache), this cache is "
                              f"{self.cfg.kind.name}: use store_mla_")
        return StepStore(self.cfg, self.slot_mapping[: self._check_bs(n)], self._layer_parts,
                         impl)

    def store_mla_(self, layer: int, latent: Tensor, rope: Tensor | None = None,
                   slot_mapping: Tensor | None = None, *, scale: Tensor | None = None,
                   impl: Impl = Impl.AUTO, check_range: bool = False, check_scales: bool = True
                   ) -> None:
        """MLA: write ``latent [n, kv_lora_rank]`` and ``rope [n, rope_dim]`` (or ``[n, 1, .]``)
        into one row per token; see :meth:`store_kv_` for slots, ``impl``, checks and fp8 (one
        ``scale`` for the whole row)."""
        self._pages(KVKind.MLA, layer, 0)
        part = self._part(layer, 0)
        r = self.cfg.kv_lora_rank
        lat = self._src("latent", latent, None, r)
        pairs: tuple[tuple[Tensor, Tensor], ...] = ((lat, part[..., :r]),)
        if self.cfg.rope_dim:
            if rope is None:
                raise InputError(f"rope must be given: rope_dim={self.cfg.rope_dim}")
            pairs += ((self._src("rope", rope, lat.shape[0], self.cfg.rope_dim), part[..., r:]),)
        elif rope is not None:
            raise InputError("rope must be None: this cache has rope_dim=0")
        slots = self._slots(slot_mapping, lat.shape[0])
        sc = self._scales((("scale", scale),), check_scales)
        self._store(pairs, slots, impl, check_range, None if sc is None else sc * len(pairs))

    # ---- reads, poison, checks, report ---------------------------------------------------------
    def gather(self, layer: int, slots: Tensor, k_scale: Tensor | None = None,
               v_scale: Tensor | None = None, *, dtype: torch.dtype = torch.float32
               ) -> tuple[Tensor, ...]:
        """Rows ``[n, H, row_dim]`` of valid ``slots`` per part (K, V; or the MLA row): a copy.

        On an fp8 cache, passing the scales (``k_scale`` and ``v_scale``; for MLA ``k_scale`` alone)
        returns ``stored * scale`` in ``dtype``; without them the raw fp8 rows come back."""
        s = self._check_tensor("slots", slots, 1, (torch.int32, torch.int64)).to(torch.int64)
        page = torch.div(s, self.cfg.page_size, rounding_mode="floor")
        off = torch.remainder(s, self.cfg.page_size)
        rows = tuple(self._part(layer, i)[page, off] for i in range(self.cfg.parts))
        named = (("k_scale", k_scale), ("v_scale", v_scale))[: self.cfg.parts]
        if all(sc is None for _, sc in named):
            return rows
        if self.cfg.parts == 1 and v_scale is not None:
            raise InputError("v_scale must be None for an MLA cache: pass its scale as k_scale")
        sc = self._scales(named, False)
        if sc is None:
            return rows
        return tuple(dequantize(r, x, dtype) for r, x in zip(rows, sc, strict=True))

    def poison_(self) -> None:
        """Fill cache and slot mapping with sentinels (NaN, int64 max); re-zero the pad page."""
        self._flat.fill_(sentinel(self.cfg.dtype))
        self._zero_pad_pages()
        self.slot_mapping.fill_(sentinel(torch.int64))
        self._valid_tokens = 0

    def check_slots(self, bs: int) -> None:
        """Raise :class:`ReadRegionError` unless ``slot_mapping[:bs]`` holds only ``-1`` and
        distinct in-range slots (no poison, nothing in the pad page)."""
        self._check_range(self.slot_mapping[: self._check_bs(bs)], ReadRegionError)

    def check_written(self, layer: int, slots: Tensor) -> None:
        """Raise :class:`ReadRegionError` if a row at ``slots`` still holds poison (NaN)."""
        for i, rows in enumerate(self.gather(layer, slots)):
            bad = torch.isnan(rows.float()).flatten(1).any(1).nonzero().flatten().tolist()
            if bad:
                raise ReadRegionError(f"layer {layer} part {i}: slot {int(slots[bad[0]])} was "
                                      "never written (poison)")

    def report(self) -> str:
        """Shape, bytes per token and per page, and the single allocation's size (the config's
        plan, :meth:`KVCacheConfig.report`)."""
        return self.cfg.report()

    def check_pool_config(self, pool_cfg: object) -> None:
        """Cross-check a :class:`attnpool.PoolConfig` whose metadata addresses this cache, once at
        setup, so one update can write both (``pool.extend.update_(..., out_slots=
        kv.slot_view(T))``): same device and page size (page ids and token slots mean the same),
        the pool pads with this cache's pad page 0, its ``num_pages`` (when set) is this cache's,
        and ``slot_mapping`` holds the tokens of the pool's largest forward (``max_bs`` times
        the most query rows per request, or ``max_extend_tokens``). Raises :class:`LayoutError`
        or :class:`CapacityError` naming both values."""
        from ..config import PoolConfig  # local: this hunk stays self-contained

        if not isinstance(pool_cfg, PoolConfig):
            raise InputError(f"expected a PoolConfig, got {type(pool_cfg).__name__}")
        c, p = self.cfg, pool_cfg
        if p.torch_device.type != c.torch_device.type:
            raise LayoutError(f"pool device {p.torch_device} != KV cache device {c.torch_device}")
        for what, got, want in (("page_size", p.page_size, c.page_size),
                                ("pad_page", p.pad_page, PAD_PAGE),
                                ("num_pages", p.num_pages, c.num_pages)):
            if got is not None and got != want:
                raise LayoutError(f"PoolConfig.{what} must be the KV cache's {want}, got {got}")
        tokens = max(p.max_bs * max(1, p.num_draft_tokens, p.topk), p.max_extend_tokens)
        if tokens > c.max_tokens:
            raise CapacityError(f"KVCacheConfig.max_tokens must be >= {tokens} (the pool's largest "
                                f"forward), got {c.max_tokens}")


def _carve(flat: Tensor, cfg: KVCacheConfig) -> tuple[Tensor, ...]:
    """Each part's ``[num_layers, num_pages + 1, ...page]`` view of the cache's elements ``flat``
    when the parts' rows differ in size: per layer, part 0's pages then part 1's, back to back
    (no padding; a layer's part is contiguous). Views only: the one allocation is the storage."""
    pages = cfg.num_pages + 1
    sizes = [pages * cfg.page_size * cfg.num_kv_heads * d for d in cfg.part_dims]
    per_layer = flat.view(cfg.num_layers, sum(sizes))
    out, start = [], 0
    for i, n in enumerate(sizes):
        out.append(per_layer[:, start : start + n].view(cfg.num_layers, pages, *cfg.page_shape(i)))
        start += n
    return tuple(out)

"""The per-step MHA store: :class:`StepStore`, what :meth:`attnpool.KVCachePool.step_store` returns.

Split from :mod:`attnpool.kv.cache` (which re-exports it): it is built from the pool's pieces
(config, slot mapping, layer parts), not the pool itself, so the two modules never import each
other.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import Impl, resolve_impl
from ..errors import InputError, LayoutError
from .config import KVCacheConfig, KVKind, KVLayout
from .quant import is_fp8

#: every layer's ``(K, V)`` parts
Parts = tuple[tuple[Tensor, Tensor], ...]


class StepStore:
    """The MHA store of one forward, for every layer: what :meth:`KVCachePool.store_kv_` does,
    with the per-step work done once (:meth:`KVCachePool.step_store`).

    Every layer stores the same tokens, so where each goes (page and offset, or the scratch page
    when skipped) and all about the cache (kind, dtype, parts, which store runs) is fixed here,
    once; ``store_kv_`` redoes it per call. A layer's call checks only its ``k`` and ``v`` (shape,
    dtype, unit last stride: attribute reads) and issues one copy per part: ``index_copy_`` of
    token rows (reference path, ``NHD``: each part seen as ``[(num_pages + 1) * P, H, D]``, V's
    rows ``head_dim_v`` wide) or one fused launch. Built during a CUDA graph capture, the index
    ops are recorded with the forward and read ``slot_mapping`` at each replay.

    Args:
        cfg: the cache's config.
        slots: the pool's ``slot_mapping[:n]``.
        parts: every layer's ``(K, V)`` parts in NHD order, scratch page included, and the same
            flattened to token rows (NHD caches), as the pool keeps them.
        impl: which store runs.
    """

    __slots__ = ("_fused", "_index", "_layers", "_n", "_parts", "_shapes", "_slots", "cfg")

    def __init__(self, cfg: KVCacheConfig, slots: Tensor, parts: tuple[Parts, Parts],
                 impl: Impl) -> None:
        self.cfg = cfg
        if cfg.kind is not KVKind.MHA:
            raise LayoutError(f"a step store writes K and V (an MHA cache), this cache is "
                              f"{cfg.kind.name}: use store_mla_")
        if is_fp8(cfg.dtype):
            raise LayoutError(f"a step store copies model-dtype rows; this cache is {cfg.dtype} "
                              "(fp8): use store_kv_ with k_scale / v_scale")
        if not isinstance(impl, Impl):
            raise InputError(f"impl must be an attnpool.Impl, got {impl!r}")
        n = self._n = slots.shape[0]
        self._shapes = tuple((n, cfg.num_kv_heads, d) for d in cfg.part_dims)
        self._layers = cfg.num_layers
        self._fused = resolve_impl(impl, cfg.torch_device) is Impl.TRITON
        self._slots = s = slots
        p, ns = cfg.page_size, cfg.num_slots
        skip = (s < 0) | (s >= ns)
        if self._fused or cfg.layout is not KVLayout.NHD:
            # fused: the kernel reads the slots itself; HND: (page, offset) index pairs
            self._parts = parts[0]
            page = torch.where(skip, ns // p, torch.div(s, p, rounding_mode="floor"))
            self._index: tuple[Tensor, ...] = (page, torch.where(skip, 0, torch.remainder(s, p)))
        else:  # NHD: a token slot is a row of the part flattened to [(num_pages + 1) * P, H, D]
            self._parts = parts[1]
            self._index = (torch.where(skip, ns, s),)  # skipped tokens: the scratch page's row 0

    def __call__(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Write layer ``layer``'s ``k [n, H, head_dim]``, ``v [n, H, head_dim_v]`` (the cache's
        dtype and device, unit last stride); tokens whose slot is negative or past the cache are
        skipped. Both are checked before anything is written."""
        if not 0 <= layer < self._layers:
            raise InputError(f"layer must be an int in [0, {self._layers}), got {layer!r}")
        for name, t, want in (("k", k, self._shapes[0]), ("v", v, self._shapes[1])):
            if t.shape != want or t.dtype != self.cfg.dtype or (self._n and t.stride(2) != 1):
                raise InputError(f"{name} must be {self.cfg.dtype} {want} with stride 1 in its "
                                 f"last dim, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
        kp, vp = self._parts[layer]
        if self._fused:
            from . import store_kernels

            store_kernels.store_(((k, kp), (v, vp)), self._slots, self.cfg.page_size,
                                 self.cfg.num_slots)
        elif len(self._index) == 1:
            kp.index_copy_(0, self._index[0], k)
            vp.index_copy_(0, self._index[0], v)
        else:
            kp.index_put_(self._index, k)
            vp.index_put_(self._index, v)

"""vLLM's paged KV cache seen by attnpool: views of one layer's tensor and the K/V store.

vLLM allocates every layer's cache itself and hands the attention backend one tensor per layer.
On CPU its logical shape is ``[num_blocks, H_kv, block_size, 2 * D]`` (layout ``LBHNC``), and
the bytes of one block and head are the CPU attention kernel's: the ``block_size * D`` keys
first, stored transposed (``[D, block_size]``: the kernel's ``vec`` ISA), then the
``block_size * D`` values (``[block_size, D]``). attnpool writes exactly those bytes
(:func:`store_`) and reads them back through strided NHD-shaped views (:func:`cpu_views`), so a
cache attnpool filled is one vLLM's own kernel can read and the other way round; the tests
compare the bytes with ``ops.cpu_attn_reshape_and_cache``. (vLLM's other CPU ISAs, ``amx`` for
bfloat16 on AMX machines and ``vec16`` for head sizes that are not multiples of 32, pack keys
otherwise; attnpool reads only what it wrote, so its layout is the ``vec`` one for every dtype.)

On CUDA the cache is ``[2, num_blocks, block_size, H_kv, D]`` (K and V, NHD pages): the layout
flash-attn and attnpool's adapters read directly (:func:`cuda_views`).

Block 0 is vLLM's null block: no request owns it, vLLM allocates every cache zeroed, and the
store sends padded tokens there (finite K/V). Lanes of a row past its length read it (the pad
page of attnpool's metadata), masked out by attention, which needs them finite, as they are.

Nothing here imports vLLM: the views and the store are plain torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InputError


def cpu_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """``(k_cache, v_cache)``, each ``[num_blocks, block_size, H_kv, D]`` (NHD-shaped strided
    views, no copy) of one layer's CPU cache ``[num_blocks, H_kv, block_size, 2 * D]``."""
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or not kv_cache.is_contiguous():
        raise InputError(f"vLLM's CPU KV cache must be a contiguous [num_blocks, H_kv, "
                         f"block_size, 2 * head_size] tensor, got shape {tuple(kv_cache.shape)}")
    blocks, heads, page, two_d = kv_cache.shape
    d = two_d // 2
    halves = kv_cache.view(blocks, heads, 2, page * d)
    k = halves[:, :, 0].view(blocks, heads, d, page).permute(0, 3, 1, 2)
    v = halves[:, :, 1].view(blocks, heads, page, d).permute(0, 2, 1, 3)
    return k, v


def cuda_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """``(k_cache, v_cache)`` of one layer's ``[2, num_blocks, block_size, H_kv, D]`` cache."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise InputError(f"the KV cache must be [2, num_blocks, block_size, H_kv, head_size], "
                         f"got shape {tuple(kv_cache.shape)}")
    return kv_cache[0], kv_cache[1]


def slot_index_(slots: Tensor, page_size: int, blocks: Tensor, offsets: Tensor) -> None:
    """Each token's block and offset, ``blocks[:T]`` / ``offsets[:T]`` (int64, written in place:
    no tensor allocated) from ``slots [T]``, computed once per step for every layer's store.

    A slot of -1 (vLLM's padding) goes to block 0, offset 0: block 0 is vLLM's null block, which
    no request owns and attention never reads (the pad page of attnpool's metadata), so the
    store needs no mask and no host read."""
    t = slots.shape[0]
    b, o = blocks[:t], offsets[:t]
    o.copy_(slots).clamp_(min=0)  # (copy_ converts vLLM's int32/int64 slots in place)
    torch.div(o, page_size, rounding_mode="floor", out=b)
    o.remainder_(page_size)


def store_(k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, blocks: Tensor,
           offsets: Tensor) -> None:
    """Write ``key`` / ``value`` ``[T, H_kv, D]`` at ``(blocks[:T], offsets[:T])``
    (:func:`slot_index_`) of NHD-shaped caches of any strides (:func:`cpu_views`,
    :func:`cuda_views`)."""
    t = key.shape[0]
    at = (blocks[:t], offsets[:t])
    k_cache.index_put_(at, key if key.dtype == k_cache.dtype else key.to(k_cache.dtype))
    v_cache.index_put_(at, value if value.dtype == v_cache.dtype else value.to(v_cache.dtype))

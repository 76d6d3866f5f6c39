"""A tiny language model for the examples: one attention layer over a paged KV cache.

``ToyLM.forward(view, tokens, layer)`` is what an engine's model does in one forward: embed the
input tokens, store their K/V at the slots the engine chose (``KVCachePool.slot_mapping``), run
attention through attnpool's SDPA adapter over the pool's view, and return next-token logits. Two
models (a target and a draft) keep their K/V in two layers of one :class:`attnpool.KVCachePool`,
so they share token slots and pages, as EAGLE-style engines share their request table.

``greedy_reference`` decodes the same model without any cache, pool or paging (dense attention
over the whole sequence, recomputed every token): the examples check their output against it.
"""

from __future__ import annotations

import torch
from torch import Tensor

import attnpool
from attnpool.adapters.sdpa import attention

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 4, 2, 8
DTYPE = torch.float64  # exact enough that greedy choices never hinge on rounding


class ToyLM:
    """Embedding, one grouped-query attention layer with a residual, tied output head."""

    def __init__(self, seed: int, device: torch.device, like: ToyLM | None = None,
                 noise: float = 0.0) -> None:
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=DTYPE)

        if like is None:
            self.embed, self.wq = w(VOCAB, HIDDEN), w(HIDDEN, HEADS * HEAD_DIM)
            self.wk, self.wv = w(HIDDEN, KV_HEADS * HEAD_DIM), w(HIDDEN, KV_HEADS * HEAD_DIM)
            self.wo = w(HEADS * HEAD_DIM, HIDDEN) * 0.5
        else:  # a draft: the target's weights, perturbed (it then agrees with it most of the time)
            self.embed, self.wq, self.wk, self.wv, self.wo = (
                t.cpu() + noise * w(*t.shape) for t in (like.embed, like.wq, like.wk, like.wv, like.wo))
        for name in ("embed", "wq", "wk", "wv", "wo"):
            setattr(self, name, getattr(self, name).to(device))

    def qkv(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        h = self.embed[tokens]
        return (h, (h @ self.wq).view(-1, HEADS, HEAD_DIM), (h @ self.wk).view(-1, KV_HEADS, HEAD_DIM),
                (h @ self.wv).view(-1, KV_HEADS, HEAD_DIM))

    def forward(self, view: object, tokens: Tensor, kv: attnpool.KVCachePool, layer: int,
                slots: Tensor | None = None) -> Tensor:
        """Logits ``[len(tokens), VOCAB]`` of one forward over ``view`` (any attnpool view the SDPA
        adapter reads). The new tokens' K/V go to ``slots`` (default: the cache pool's own
        ``slot_mapping[:len(tokens)]``, the static buffer a captured graph reads); -1 skips one."""
        h, q, k, v = self.qkv(tokens)
        kv.store_kv_(layer, k, v, slots)
        out = attention(view, q, kv.k_cache(layer), kv.v_cache(layer)).out
        return (h + out.reshape(h.shape[0], -1) @ self.wo) @ self.embed.T


def greedy_reference(model: ToyLM, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation computed without a cache: dense attention of the last token over the
    whole sequence, every step."""
    seq = list(prompt)
    dev = model.embed.device
    for _ in range(new_tokens):
        h, q, k, v = model.qkv(torch.tensor(seq, device=dev))
        group = HEADS // KV_HEADS
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", q[-1], k) / HEAD_DIM**0.5
        out = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v).reshape(-1)
        seq.append(int(((h[-1] + out @ model.wo) @ model.embed.T).argmax()))
    return seq[len(prompt):]

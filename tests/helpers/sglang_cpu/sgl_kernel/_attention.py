"""``torch.ops.sgl_kernel.extend_attention_cpu`` / ``decode_attention_cpu``: the attention of
SGLang's ``intel_amx`` backend (``srt/layers/attention/intel_amx_backend.py``), registered as
torch ops because the backend reaches them through ``torch.ops.sgl_kernel``. Plain softmax
attention over the K/V rows that ``req_to_token`` names, in float32: extend one request at a
time, decode all rows at once (padded to the longest).

What the tests' models do not use (sliding windows, attention sinks, cross attention, scaled
fp8 caches, layers that share another layer's K/V) raises instead of being approximated.
"""

from __future__ import annotations

import torch

_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")

_LIB.define(
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, "
    "Tensor(a!) o_extend, Tensor(b!) k_buffer, Tensor(c!) v_buffer, float key_scale, "
    "float value_scale, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
    "Tensor extend_seq_lens, Tensor extend_start_loc, int? max_len_extend, float sm_scale, "
    "float logit_cap, bool is_cross_attention, int sliding_window_size, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()")
_LIB.define(
    "decode_attention_cpu(Tensor q, Tensor(a!) k_buffer, Tensor(b!) v_buffer, "
    "float key_scale, float value_scale, Tensor(c!) output, Tensor? k, Tensor? v, "
    "Tensor loc, Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, "
    "Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attention, "
    "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()")


def _unsupported(is_cross: bool, window: int, sinks: torch.Tensor | None,
                 encoder_lens: torch.Tensor | None, key_scale: float, value_scale: float
                 ) -> None:
    what = [name for name, on in (("cross attention", is_cross or encoder_lens is not None),
                                  ("a sliding window", window > 0),
                                  ("attention sinks", sinks is not None),
                                  ("scaled K/V", key_scale != 1.0 or value_scale != 1.0))
            if on]
    if what:
        raise NotImplementedError("the sgl_kernel stand-in's attention has no "
                                  + ", ".join(what))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
            sm_scale: float, logit_cap: float) -> torch.Tensor:
    """``q`` (L, Hq, D) over ``k`` / ``v`` (S, Hkv, D) with ``visible`` (L, S) or all."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("lhd,shd->hls", q.float(), k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hls,shd->lhd", torch.softmax(s, dim=-1), v)


def _extend(q_extend: torch.Tensor, k_extend: torch.Tensor | None,
            v_extend: torch.Tensor | None, o_extend: torch.Tensor, k_buffer: torch.Tensor,
            v_buffer: torch.Tensor, key_scale: float, value_scale: float,
            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
            extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor,
            max_len_extend: int | None, sm_scale: float, logit_cap: float,
            is_cross_attention: bool, sliding_window_size: int,
            encoder_lens: torch.Tensor | None, sinks: torch.Tensor | None,
            tree_mask: torch.Tensor | None, is_causal: bool) -> None:
    """Request ``b``'s ``extend_seq_lens[b]`` queries (from ``extend_start_loc[b]``) see its
    ``seq_lens[b] - extend_seq_lens[b]`` cached prefix tokens, then the new ones causally,
    or as ``tree_mask`` says (per request an ``L x L`` block, packed), or all of them."""
    del max_len_extend
    _unsupported(is_cross_attention, sliding_window_size, sinks, encoder_lens, key_scale,
                 value_scale)
    if k_extend is None or v_extend is None:
        raise NotImplementedError("the sgl_kernel stand-in's attention has no K/V sharing")
    mask_at = 0
    for r, s, n, at in zip(req_pool_indices.tolist(), seq_lens.tolist(),
                           extend_seq_lens.tolist(), extend_start_loc.tolist(), strict=True):
        prefix = s - n
        rows = req_to_token[r, :prefix].long()
        new_k, new_v = k_extend[at:at + n], v_extend[at:at + n]
        k = torch.cat([k_buffer[rows].to(new_k.dtype), new_k])
        v = torch.cat([v_buffer[rows].to(new_v.dtype), new_v])
        visible = torch.ones(n, s, dtype=torch.bool, device=q_extend.device)
        if tree_mask is not None:
            visible[:, prefix:] = tree_mask[mask_at:mask_at + n * n].reshape(n, n).bool()
            mask_at += n * n
        elif is_causal:
            visible[:, prefix:] = torch.ones(n, n, dtype=torch.bool,
                                             device=q_extend.device).tril()
        out = _attend(q_extend[at:at + n], k, v, visible, sm_scale, logit_cap)
        o_extend[at:at + n] = out.to(o_extend.dtype)


def _decode(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, key_scale: float,
            value_scale: float, output: torch.Tensor, k: torch.Tensor | None,
            v: torch.Tensor | None, loc: torch.Tensor, attn_logits: torch.Tensor,
            req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
            sm_scale: float, logit_cap: float, is_cross_attention: bool,
            sliding_window_size: int, encoder_lens: torch.Tensor | None,
            sinks: torch.Tensor | None) -> None:
    """Writes ``k`` / ``v`` (when given) at ``loc``, then row ``i``'s query sees the
    ``seq_lens[i]`` slots of row ``req_pool_indices[i]`` of ``req_to_token``."""
    del attn_logits
    _unsupported(is_cross_attention, sliding_window_size, sinks, encoder_lens, key_scale,
                 value_scale)
    if k is not None and v is not None:
        k_buffer[loc.long()] = k.reshape(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[loc.long()] = v.reshape(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    rows = seq_lens.shape[0]
    if rows == 0:
        return
    # all rows at once: each row's slots padded to the longest, the padding masked
    width = int(seq_lens.max())
    cols = torch.arange(width, device=q.device)
    slots = req_to_token[req_pool_indices.long(), :width].long()
    valid = cols[None, :] < seq_lens[:, None]
    slots = torch.where(valid, slots, 0)
    group = q.shape[1] // k_buffer.shape[1]
    keys = k_buffer[slots].float().repeat_interleave(group, dim=2)  # (rows, width, Hq, D)
    values = v_buffer[slots].float().repeat_interleave(group, dim=2)
    s = torch.einsum("rhd,rshd->rhs", q[:rows].float(), keys) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("rhs,rshd->rhd", torch.softmax(s, dim=-1), values)
    output[:rows] = out.to(output.dtype)


_LIB.impl("extend_attention_cpu", _extend, "CompositeExplicitAutograd")
_LIB.impl("decode_attention_cpu", _decode, "CompositeExplicitAutograd")

"""Weight absorption for MLA: the three products an engine needs around the latent attention.

The absorption itself belongs to the engine (it owns the weights, their dtype and where each
product runs); these helpers only say once how DeepSeek's ``kv_b_proj`` is laid out and which
contraction each step is, so that an engine and the tests read it the same way:

* ``kv_b_proj.weight [H * (nope + v), L]`` maps a latent ``c_kv [L]`` to every head's
  ``[k_nope (nope) | v (v)]``; per head ``h`` its rows split into ``W_UK[h] [nope, L]`` and
  ``W_UV[h]^T [v, L]`` (:func:`split_kv_b_proj`);
* the key of head ``h`` is ``[W_UK[h] c_kv | k_pe]``, so ``q_nope_h · (W_UK[h] c_kv) =
  (q_nope_h W_UK[h]) · c_kv``: the query is absorbed once per token (:func:`absorb_q`,
  ``[T, H, nope] -> [T, H, L]``) and attention reads ``c_kv`` directly;
* the value of head ``h`` is ``c_kv W_UV[h]``, and attention is linear in its values, so the
  output is ``o_lat_h W_UV[h]`` (:func:`unabsorb_out`, ``[T, H, L] -> [T, H, v]``).

:func:`expand_kv` computes the expanded per-head keys and values from the latents, what an
engine's prefill path (or a reference) uses instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...errors import InputError
from ...kv.mla_shape import MLAShape


def _tensor(name: str, t: object, shape: tuple[int, ...]) -> Tensor:
    if not isinstance(t, Tensor) or not t.dtype.is_floating_point or tuple(t.shape) != shape:
        got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
        raise InputError(f"{name} must be a floating tensor of shape {shape}, got {got}")
    return t


def split_kv_b_proj(weight: Tensor, shape: MLAShape) -> tuple[Tensor, Tensor]:
    """``(W_UK [H, nope, L], W_UV [H, L, v])`` from ``kv_b_proj.weight [H * (nope + v), L]``
    (a ``torch.nn.Linear(L, H * (nope + v))``'s weight, rows per head ``[k_nope | v]``). Both
    are views of ``weight``; call ``.contiguous()`` for a kernel that wants dense operands."""
    h, n, v, lat = (shape.num_heads, shape.qk_nope_head_dim, shape.v_head_dim,
                    shape.kv_lora_rank)
    w = _tensor("kv_b_proj weight", weight, (h * (n + v), lat)).view(h, n + v, lat)
    return w[:, :n, :], w[:, n:, :].transpose(1, 2)


def _per_head(x: Tensor, x_name: str, w: Tensor, w_name: str, spec: str) -> Tensor:
    """``einsum(spec, x [T, H, k], w [H, k, m])``: ``x`` checked against ``w``'s heads and
    width; ``w_name`` is the refusal of a ``w`` that is not 3-D."""
    h, k, _ = w.shape if isinstance(w, Tensor) and w.dim() == 3 else (0, 0, 0)
    if not h:
        raise InputError(w_name)
    t = _tensor(x_name, x, (x.shape[0] if isinstance(x, Tensor) else -1, h, k))
    return torch.einsum(spec, t, w)


def absorb_q(q_nope: Tensor, w_uk: Tensor) -> Tensor:
    """``q_lat [T, H, L] = q_nope [T, H, nope] · W_UK [H, nope, L]`` per head."""
    return _per_head(q_nope, "q_nope", w_uk,
                     "w_uk must be [H, nope, L] (split_kv_b_proj's first result)", "thn,hnl->thl")


def unabsorb_out(o_lat: Tensor, w_uv: Tensor) -> Tensor:
    """``o [T, H, v] = o_lat [T, H, L] · W_UV [H, L, v]`` per head."""
    return _per_head(o_lat, "o_lat", w_uv,
                     "w_uv must be [H, L, v] (split_kv_b_proj's second result)", "thl,hlv->thv")


def expand_kv(c_kv: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor) -> tuple[Tensor, Tensor]:
    """The expanded per-head cache rows of ``N`` latents: ``(k [N, H, nope + rope], v [N, H,
    v])`` with ``k = [c_kv W_UK[h]^T | k_pe]`` (the rope key shared by every head) and ``v =
    c_kv W_UV[h]``."""
    if not (isinstance(w_uk, Tensor) and w_uk.dim() == 3 and isinstance(w_uv, Tensor)
            and w_uv.dim() == 3):
        raise InputError("w_uk / w_uv must be split_kv_b_proj's [H, nope, L] / [H, L, v]")
    h, lat = w_uk.shape[0], w_uk.shape[2]
    n = c_kv.shape[0] if isinstance(c_kv, Tensor) else -1
    c = _tensor("c_kv", c_kv, (n, lat))
    pe = _tensor("k_pe", k_pe, (n, k_pe.shape[-1] if isinstance(k_pe, Tensor) else -1))
    k_nope = torch.einsum("nl,hdl->nhd", c, w_uk)
    k = torch.cat((k_nope, pe[:, None, :].expand(n, h, pe.shape[1])), dim=-1)
    return k, torch.einsum("nl,hlv->nhv", c, w_uv)

"""The LoRA pool's configuration and its per-size view (the pool itself: :mod:`.pool`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..config import is_int, resolve_device
from ..errors import PoolError

#: (name, dtype, length as a function of (max_bs, max_loras, max_tokens)), in layout order.
_FIELDS: tuple[tuple[str, torch.dtype, int], ...] = (
    ("seg_lens", torch.int32, 0), ("seg_indptr", torch.int32, 1), ("weight_indices", torch.int32, 0),
    ("lora_ranks", torch.int32, 2), ("scalings", torch.float32, 2), ("permutation", torch.int64, 3),
)


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Sizes of the LoRA batch buffers.

    Args:
        max_bs: largest captured batch (requests).
        max_loras_per_batch: adapter slots resident at once (weight index range).
        max_lora_rank: largest rank of any adapter (the static bound kernels are captured with).
        max_tokens_per_req: tokens of one request in a captured forward (1 for decode, N for
            verify); ``max_tokens = max_bs * max_tokens_per_req``.
        output_dims: optional reusable LoRA output buffers ``[max_tokens, d]``, one per ``d``.
        output_dtype: dtype of the output buffers.
        device: ``"cpu"``, ``"cuda"``, a ``torch.device`` or ``"auto"``.
        extra_buffers: optional ``(name, dtype, length)`` buffers of an engine's own layout, in
            the same allocation after the outputs (``LoRABatchPool.extras[name]``); the pool
            never writes them except :meth:`LoRABatchPool.poison_`.
        token_budget: optional cap on the tokens of one update in all (rows of ``permutation``
            and of the outputs): an engine whose eager segments are whole prompts sets
            ``max_tokens_per_req`` to its prefill budget and this to the same budget, instead
            of paying ``max_bs`` times it. Default: ``max_bs * max_tokens_per_req``.
    """

    max_bs: int
    max_loras_per_batch: int
    max_lora_rank: int
    max_tokens_per_req: int = 1
    output_dims: tuple[int, ...] = ()
    output_dtype: torch.dtype = torch.float16
    device: str | torch.device = "auto"
    extra_buffers: tuple[tuple[str, torch.dtype, int], ...] = ()
    token_budget: int | None = None
    _device: torch.device = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("max_bs", "max_loras_per_batch", "max_lora_rank", "max_tokens_per_req"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise PoolError(f"LoRAConfig: {name} must be an int >= 1, got {v!r}")
        tb = self.token_budget
        if tb is not None and (not is_int(tb) or tb < 1):
            raise PoolError(f"LoRAConfig: token_budget must be an int >= 1 or None, got {tb!r}")
        dims = self.output_dims
        if not isinstance(dims, tuple) or any(not is_int(d) or d < 1 for d in dims) \
                or len(set(dims)) != len(dims):
            raise PoolError(f"LoRAConfig: output_dims must be a tuple of distinct ints >= 1, got "
                            f"{dims!r}")
        if not isinstance(self.output_dtype, torch.dtype):
            raise PoolError(f"LoRAConfig: output_dtype must be a torch.dtype, got {self.output_dtype!r}")
        ex = self.extra_buffers
        if not isinstance(ex, tuple) or any(
                not isinstance(e, tuple) or len(e) != 3 or not isinstance(e[0], str)
                or not isinstance(e[1], torch.dtype) or not is_int(e[2]) or e[2] < 1 for e in ex):
            raise PoolError(f"LoRAConfig: extra_buffers must be a tuple of (name, torch.dtype, "
                            f"length >= 1) tuples, got {ex!r}")
        names = [e[0] for e in ex]
        if len(set(names)) != len(names) or set(names) & {f[0] for f in _FIELDS}:
            raise PoolError(f"LoRAConfig: extra_buffers names must be distinct and not a "
                            f"metadata field's, got {names}")
        object.__setattr__(self, "_device", resolve_device(self.device))

    @property
    def torch_device(self) -> torch.device:
        return self._device

    @property
    def max_tokens(self) -> int:
        full = self.max_bs * self.max_tokens_per_req
        return full if self.token_budget is None else min(full, self.token_budget)

    def tokens(self, bs: int) -> int:
        """Rows of a view of ``bs`` requests: ``bs * max_tokens_per_req``, within the budget."""
        return min(bs * self.max_tokens_per_req, self.max_tokens)

    def lengths(self) -> tuple[int, int, int, int]:
        """Element counts indexed by ``_FIELDS``' third column."""
        return (self.max_bs, self.max_bs + 1, self.max_loras_per_batch, self.max_tokens)


@dataclass(frozen=True, slots=True)
class LoRABatchView:
    """One captured batch size's LoRA metadata: slices of the pool, stable ``data_ptr()``s.

    Attributes:
        bs: captured requests. ``seg_lens``, ``weight_indices``: ``[bs] int32``; ``seg_indptr``:
            ``[bs + 1] int32``; ``lora_ranks`` ``[max_loras] int32`` and ``scalings``
            ``[max_loras] float32`` (whole, indexed by slot); ``permutation``: ``[num_tokens]
            int64``, a permutation of ``0..num_tokens-1``.
        num_tokens: ``bs * max_tokens_per_req`` (at most ``token_budget``), rows of the
            activations the view covers.
        max_len: static bound of any ``seg_lens`` (``max_tokens_per_req``).
        max_rank: static bound of any ``lora_ranks`` (``max_lora_rank``).
    """

    bs: int
    seg_lens: Tensor
    seg_indptr: Tensor
    weight_indices: Tensor
    lora_ranks: Tensor
    scalings: Tensor
    permutation: Tensor
    num_tokens: int
    max_len: int
    max_rank: int

"""Per-batch LoRA metadata in one ``torch.empty``, refilled in place with one copy per step
(:class:`LoRABatchPool`; its layout and why: :mod:`.pool`)."""

from .config import LoRABatchView, LoRAConfig
from .pool import LoRABatchPool, lora_reference

__all__ = ["LoRABatchPool", "LoRABatchView", "LoRAConfig", "lora_reference"]

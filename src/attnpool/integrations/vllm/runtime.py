"""What attnpool's vLLM backend reads from vLLM's runtime, and how it refuses: its logger, the
refusal every unserved setting goes through, a group's layers, a layer's fp8 scales and the
current step's metadata from vLLM's forward context (importing this module imports vLLM)."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger

from ...errors import LayoutError
from . import CPU_KERNEL, SWITCH
from .step import StepMetadata

#: under vLLM's logger hierarchy, so that vLLM's own log handler prints it
logger = init_logger("vllm.plugins.attnpool")

T = TypeVar("T")


def refuse(reasons: list[str], kernel_fixes: bool = False) -> None:
    """Refuse what attnpool does not serve (nothing when ``reasons`` is empty): logged at ERROR
    under vLLM's logger, so the reason shows in the engine's own output beside vLLM's final
    error (an engine core process's exception reaches the caller only as "Engine core
    initialization failed"), then raised as a :class:`attnpool.LayoutError`. The message says
    which setting to change: ``ATTNPOOL_VLLM`` unset makes vLLM's own backend serve the
    engine; ``kernel_fixes``: unsetting ``ATTNPOOL_VLLM_CPU_KERNEL`` (vLLM's kernel attending
    over the pool's buffers) serves it too."""
    if not reasons:
        return
    fix = (f"unset {CPU_KERNEL} (vLLM's CPU kernel then attends over attnpool's buffers) or "
           if kernel_fixes else "")
    msg = (f"attnpool's vLLM backend does not serve {', '.join(reasons)}. To run this engine, "
           f"{fix}unset {SWITCH} (or set it to 0): vLLM's own attention backend then serves "
           f"it, where it serves the setting.")
    logger.error(msg)
    raise LayoutError(msg)


class BackendClasses:
    """The impl and builder classes an attnpool backend class hands vLLM
    (``get_impl_cls``, ``get_builder_cls``), named once per backend as its :attr:`impl` and
    :attr:`builder`. Listed first among the backend's bases, so that these win over the vLLM
    base class's (the backends subclass vLLM's own CPU backends for their facts: dtypes, block
    and head sizes, the cache layout)."""

    impl: ClassVar[type[Any]]
    builder: ClassVar[type[Any]]

    @classmethod
    def get_impl_cls(cls) -> type[Any]:
        return cls.impl

    @classmethod
    def get_builder_cls(cls) -> type[Any]:
        return cls.builder


def layer_scales(layer: Any) -> tuple[float, float]:
    """A layer's K and V scales of an fp8 cache (vLLM keeps them on the layer; 1.0 else)."""
    return (float(getattr(layer, "_k_scale_float", 1.0)),
            float(getattr(layer, "_v_scale_float", 1.0)))


def group_impls(vllm_config: VllmConfig, layer_cls: type[Any], impl_cls: type[T],
                layer_names: list[str]) -> list[T]:
    """The impls of a KV-cache group's layers, every one attnpool's ``impl_cls`` (a builder
    serves only its own layers: another backend's in the group is refused at engine start)."""
    layers = get_layers_from_vllm_config(vllm_config, layer_cls, layer_names)
    impls = [layer.impl for layer in layers.values()]
    if not impls or not all(isinstance(i, impl_cls) for i in impls):
        raise LayoutError(f"attnpool's builder serves attnpool's {impl_cls.__name__} layers; "
                          f"group {layer_names} has {sorted({type(i).__name__ for i in impls})}")
    return impls


def step_metadata(layer_name: str | None) -> StepMetadata | None:
    """This layer's metadata of the current step, from vLLM's forward context."""
    if layer_name is None or not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    found = md.get(layer_name) if isinstance(md, dict) else None
    return found if isinstance(found, StepMetadata) else None

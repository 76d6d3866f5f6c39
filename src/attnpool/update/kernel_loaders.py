"""The jit kernels of the fused path, imported on first use: importing attnpool (or the update
wrappers) never imports triton; the first fused launch does.
"""

from __future__ import annotations

from types import ModuleType


def kernels() -> ModuleType:
    """The jit kernels; imported on first use so importing attnpool never imports triton."""
    from . import triton_kernels

    return triton_kernels


def paged_kernels() -> ModuleType:
    """The paged-part kernel's module (imported on first use, like :func:`kernels`)."""
    from . import triton_paged_kernels

    return triton_paged_kernels


def draft_kernels() -> ModuleType:
    """The draft tree expand kernel's module (imported on first use, like :func:`kernels`)."""
    from . import triton_draft_kernels

    return triton_draft_kernels


def flashmla_kernels() -> ModuleType:
    """The FlashMLA scheduler kernel's module (imported on first use, like :func:`kernels`)."""
    from . import triton_flashmla_kernels

    return triton_flashmla_kernels

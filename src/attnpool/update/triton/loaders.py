"""The jit kernels of the fused path, imported on first use: importing attnpool (or the update
wrappers) never imports triton; the first fused launch does.
"""

from __future__ import annotations

from types import ModuleType


def kernels() -> ModuleType:
    """The jit kernels; imported on first use so importing attnpool never imports triton."""
    from . import kernels

    return kernels


def paged_kernels() -> ModuleType:
    """The paged-part kernel's module (imported on first use, like :func:`kernels`)."""
    from . import paged_kernels

    return paged_kernels


def draft_kernels() -> ModuleType:
    """The draft tree expand kernel's module (imported on first use, like :func:`kernels`)."""
    from . import draft_kernels

    return draft_kernels


def flashmla_kernels() -> ModuleType:
    """The FlashMLA scheduler kernel's module (imported on first use, like :func:`kernels`)."""
    from . import flashmla_kernels

    return flashmla_kernels

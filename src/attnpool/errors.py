"""Errors raised by attnpool.

Every error about user input is a :class:`PoolError`, a ``ValueError``, raised *before* any byte of
the pool is written, so a rejected call leaves the pool exactly as it was. Messages name the
expected and the actual value.
"""

from __future__ import annotations


class PoolError(ValueError):
    """Base class of every attnpool error about configuration or input."""


class CapacityError(PoolError):
    """A request exceeds what the pool was sized for (batch size, context length, rows)."""


class LayoutError(PoolError):
    """The pool was not built with the layout (or phase part) the caller asked for."""


class InputError(PoolError):
    """An input tensor has the wrong dtype, device, shape, contiguity or value."""


class MissingPhaseError(PoolError, AttributeError):
    """The config does not enable the phase that was asked for.

    It is also an ``AttributeError`` so that ``hasattr(pool, "verify")`` answers ``False`` for a
    pool built without speculative decoding.
    """


class StaleViewError(PoolError):
    """A view whose bytes another phase (or poison) has written since the write that produced it:
    its metadata now describes another batch. Overlaid phases share arena bytes, so hold a view
    only until another phase's ``view`` / ``update_`` runs (see :attr:`attnpool.PagedView.is_current`).
    """

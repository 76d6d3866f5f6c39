"""Counts in the tools' output: ``1 prompt`` / ``8 prompts``, ``36 tokens`` / ``35-45 tokens``.

Every message that puts a number before a noun goes through these two functions, so a run with
one prompt, one batch or prompts of one length reads as English (``1 chat prompt of 36 tokens``,
never ``1 chat prompts of 36-36 tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable


def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 prompt"``, ``"0 prompts"``, ``"8 prompts"``: ``n`` and ``word``, or ``many`` (default
    ``word + "s"``) unless ``n == 1``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def numbers(values: Iterable[int]) -> str:
    """``"36"`` when every value is 36, else ``"lo-hi"`` (``"35-45"``). Raises ``ValueError``
    for no values."""
    vals = list(values)
    if not vals:
        raise ValueError("numbers() of no values")
    lo, hi = min(vals), max(vals)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def span(values: Iterable[int], word: str, many: str | None = None) -> str:
    """The range of ``values`` with its noun: ``"36 tokens"``, ``"1 token"``, ``"35-45
    tokens"`` (see :func:`numbers` and :func:`plural`)."""
    vals = list(values)
    text = numbers(vals)
    one = text == "1"
    return f"{text} {word if one else (many or word + 's')}"

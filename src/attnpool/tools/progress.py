"""Progress of long tool runs on stderr: the benchmark's case bar and the demo's token counter.

Both write to stderr, never stdout: stdout holds the results (tables, answers, speeds), so
``attnpool demo > answers.txt`` keeps a clean file while the terminal still shows the run is
alive. Neither needs a dependency (no tqdm).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from .words import plural


class Bar:
    """A plain-text bar of ``total`` steps: redrawn in place on a terminal, a line per quarter
    otherwise (a log file gets four lines, not one per case)."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.done, self.enabled = max(1, total), 0, enabled
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        fill = 30 * self.done // self.total
        line = f"[{'#' * fill}{'.' * (30 - fill)}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write(f"\r{line[:100]:<100}" + ("\n" if self.done == self.total else ""))
        elif self.done == self.total or (4 * self.done // self.total
                                         != 4 * (self.done - 1) // self.total):
            self.stream.write(line + "\n")
        self.stream.flush()


#: Seconds between two progress lines on a terminal (one line redrawn in place) ...
TTY_INTERVAL_S = 2.0
#: ... and in a log (stderr not a terminal): every line stays, so they come rarely.
LOG_INTERVAL_S = 30.0


class TokenProgress:
    """Tokens generated so far, of at most ``total``, with the rate, while a generation runs.

    Why: the trained-model demo generates for minutes on a small or busy CPU (each half: up to
    8 x 128 tokens through a 30-layer model), and a command that prints nothing for minutes
    looks hung. Why this shape: one compact line, ``label: 312 of at most 1024 tokens, 14.2
    tokens/s, 22 s``, written at most every :data:`TTY_INTERVAL_S` on a terminal (redrawn in
    place, so the screen keeps one line) and every :data:`LOG_INTERVAL_S` otherwise (each line
    stays in a log: a handful per minute shows the run is alive without burying the output).
    :meth:`close` always writes the last line (tokens, seconds, rate). "At most": answers may
    end early at their end-of-turn token, so ``total`` is a bound, not a promise.

    ``clock`` and ``stream`` are injectable so tests can drive the throttle without waiting.
    """

    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.interval = TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S
        self.clock = clock
        self.start = clock()
        self._last = self.start
        self._open = False  # a terminal line is drawn and not ended yet

    def _line(self, now: float) -> str:
        dt = now - self.start
        rate = f"{self.done / dt:.1f} tokens/s" if dt > 0 else "- tokens/s"
        return (f"{self.label}: {self.done} of at most {plural(self.total, 'token')}, {rate}, "
                f"{dt:.0f} s")

    def _write(self, line: str, end: bool) -> None:
        if self.tty:
            self.stream.write(f"\r{line:<79}" + ("\n" if end else ""))
            self._open = not end
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def add(self, tokens: int) -> None:
        """``tokens`` more were generated; write a line when the interval has passed."""
        self.done += tokens
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self._write(self._line(now), end=False)

    def close(self) -> None:
        """The final line: tokens generated, seconds, rate."""
        now = self.clock()
        dt = now - self.start
        rate = f", {self.done / dt:.1f} tokens/s" if dt > 0 else ""
        self._write(f"{self.label}: {plural(self.done, 'token')} in {dt:.1f} s{rate}", end=True)


class GenerateCounter:
    """A ``model.generate`` streamer that feeds :class:`TokenProgress` the real tokens of each
    step: a row stops counting after its ``eos`` (``generate`` keeps stepping finished rows
    until the whole batch is done, padding them). transformers calls ``put`` with the prompt
    ids ``[B, L]`` first, then each step's ``[B]`` new tokens, and ``end`` after the batch."""

    def __init__(self, progress: TokenProgress, eos: int | None) -> None:
        self.progress, self.eos = progress, eos
        self._alive: list[bool] = []

    def put(self, value: Any) -> None:
        if value.dim() == 2:  # a new batch's prompt ids
            self._alive = [True] * int(value.shape[0])
            return
        tokens = value.reshape(-1).tolist()
        self.progress.add(sum(self._alive))
        if self.eos is not None:
            self._alive = [a and t != self.eos for a, t in zip(self._alive, tokens, strict=True)]

    def end(self) -> None:
        self._alive = []

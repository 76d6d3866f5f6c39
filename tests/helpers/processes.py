"""Engine runs in fresh processes, a few at a time.

The engine tests compare runs that must not share a process (an engine's global state, its
plugins, its platform override), and one engine start costs tens of seconds on a small machine:
:func:`run_all` keeps ``parallel`` of them going, each with its output in ``<key>.log``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

#: seconds one run may take before it is killed (its log then says how far it got)
TIMEOUT = 900.0


def run_all(jobs: Mapping[str, tuple[list[str], dict[str, str]]], logs: Path, *, parallel: int,
            cwd: Path, timeout: float = TIMEOUT) -> dict[str, int]:
    """Run every ``key -> (command, environment)`` of ``jobs`` in its own process, at most
    ``parallel`` at once, in ``jobs``' order; return key -> exit status (negative where it was
    killed past ``timeout``). Each run's output goes to ``logs / f"{key}.log"``: read it with
    :func:`log_tail` where a run failed."""
    pending = list(jobs)
    running: list[tuple[str, subprocess.Popen[bytes], float]] = []
    status: dict[str, int] = {}
    while pending or running:
        while pending and len(running) < max(1, parallel):
            key = pending.pop(0)
            cmd, env = jobs[key]
            with open(logs / f"{key}.log", "w") as log:
                proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log,
                                        stderr=subprocess.STDOUT)
            running.append((key, proc, time.perf_counter()))
        time.sleep(0.5)
        for item in list(running):
            key, proc, started = item
            if proc.poll() is None and time.perf_counter() - started < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
            status[key] = proc.wait()
            running.remove(item)
    return status


def log_tail(logs: Path, key: str, chars: int = 4000) -> str:
    """The end of run ``key``'s output: what a failed run's assertion shows."""
    return (logs / f"{key}.log").read_text()[-chars:]

"""LoRA through SGLang's CPU engine: rows of (prompt, adapter or base) in one ``generate``, one
engine per setting, every engine of one backend in one fresh process.

Run as a script in the SGLang environment (``.venv-sglang``)::

    python -m tests.helpers.sglang_lora SPEC.json OUT.json

``SPEC``: ``{"model", "adapters": {name: path}, "rows": [[prompt ids, name or null]], "new",
"lora_backend", "settings": [{"max_loras_per_batch", "radix"}]}``. Each setting starts
``sglang.Engine`` (``device="cpu"``, float32, ``attention_backend="torch_native"``, no CUDA
graphs, ``max_lora_rank=8``) with the adapters loaded, generates the rows greedily and writes
the tokens and, for ``lora_backend="attnpool"``, what the arena served
(:class:`attnpool.integrations.sglang.lora.LoRAServed`: eager refills, graph refills, bytes).
The process needs ``SGLANG_USE_CPU_ENGINE=1``, ``tests/helpers/sglang_cpu`` first on
``PYTHONPATH`` and ``ATTNPOOL_SGLANG_NO_PIN=1`` (SGLang's LoRA code pins host memory, which a
machine without CUDA refuses): :func:`env`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers import sglang_engine as se

#: engine arguments of every setting (on top of ``sglang_engine.BASE``)
LORA_BASE: dict[str, Any] = {"attention_backend": "torch_native", "max_lora_rank": 8,
                             "max_running_requests": 16}


def env(report: str | None = None) -> dict[str, str]:
    """The engine process's environment (module doc); ``report``: the arena's counter path."""
    extra = {"ATTNPOOL_SGLANG_NO_PIN": "1"}
    if report:
        extra["ATTNPOOL_SGLANG_LORA_REPORT"] = report
    return se.env(**extra)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """In the engine process: each setting's tokens and counts (module doc)."""
    import glob

    import sglang

    from attnpool.integrations.sglang.lora import REPORT, LoRAServed

    report = os.environ.get(REPORT)
    names = sorted(spec["adapters"])
    lora_paths = [{"lora_name": n, "lora_path": spec["adapters"][n]} for n in names]
    prompts = [p for p, _ in spec["rows"]]
    adapters = [a for _, a in spec["rows"]]
    params = {"temperature": 0.0, "max_new_tokens": spec["new"], "ignore_eos": True}
    out: dict[str, Any] = {}
    for s in spec["settings"]:
        key = f"{s['max_loras_per_batch']}/{'radix' if s['radix'] else 'noradix'}"
        if report:
            for name in glob.glob(f"{glob.escape(report)}.*"):
                os.remove(name)
        engine = sglang.Engine(model_path=spec["model"], lora_backend=spec["lora_backend"],
                               lora_paths=lora_paths,
                               max_loras_per_batch=s["max_loras_per_batch"],
                               disable_radix_cache=not s["radix"],
                               **(se.BASE | LORA_BASE))
        try:
            got = engine.generate(input_ids=prompts, sampling_params=params, lora_path=adapters)
            row: dict[str, Any] = {"tokens": [g["output_ids"] for g in got]}
            if report:
                row["served"] = list(LoRAServed.read(report))
            out[key] = row
        finally:
            engine.shutdown()
    return out


def generate_apart(model: Path, adapters: dict[str, Path],
                   rows: list[tuple[list[int], str | None]], new: int, lora_backend: str,
                   settings: list[dict[str, Any]]) -> subprocess.Popen[str]:
    """Start :func:`run` in a fresh process (``.venv-sglang``'s Python: the current one); read
    its result with :func:`result`."""
    tmp = Path(tempfile.mkdtemp(prefix="sglang_lora_"))
    spec = {"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()},
            "rows": rows, "new": new, "lora_backend": lora_backend, "settings": settings}
    (tmp / "spec.json").write_text(json.dumps(spec))
    report = str(tmp / "served") if lora_backend == se.NAME else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.sglang_lora", str(tmp / "spec.json"),
         str(tmp / "out.json")], cwd=se.ROOT, env=env(report), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    proc.out_path = tmp / "out.json"  # type: ignore[attr-defined]
    return proc


def result(proc: subprocess.Popen[str], timeout: float = 900) -> dict[str, Any]:
    """The started process's result, or its error."""
    _, err = proc.communicate(timeout=timeout)
    path: Path = proc.out_path  # type: ignore[attr-defined]
    if proc.returncode or not path.exists():
        raise RuntimeError(f"SGLang LoRA run failed ({proc.returncode}):\n{err[-4000:]}")
    got: dict[str, Any] = json.loads(path.read_text())
    return got


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))

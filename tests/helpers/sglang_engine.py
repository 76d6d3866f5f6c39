"""Greedy tokens from SGLang's CPU engine, with one attention backend, under named settings.

Run as a script in the SGLang environment (``.venv-sglang``), one process per backend, so that
native and attnpool runs never share a process::

    python -m tests.helpers.sglang_engine --model DIR --backend attnpool \\
        --settings defaults,chunked --out tokens.json

Each setting starts its own ``sglang.Engine`` (``device="cpu"``, float32, token ids in and out,
no CUDA graphs) with the engine arguments of :data:`SETTINGS`, generates the batch of
:func:`tests.helpers.tiny_models.prompts` (several lengths, three sharing a long prefix) and
then one request alone, and writes ``{setting: {"batch": [...], "one": [...]}}``. SGLang's
CPU engine needs ``SGLANG_USE_CPU_ENGINE=1`` and, on a machine without SGLang's CPU kernels,
``tests/helpers/sglang_cpu`` first on ``PYTHONPATH`` (:mod:`sgl_kernel`'s one op a
decoder-only model calls, in torch); :func:`env` gives both. The scheduler runs in a spawned
process: its log (``log_level="warning"``) goes to this process's stderr, where a retraction
shows as ``Retract requests``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: the folder whose ``sgl_kernel`` stands in for SGLang's CPU kernels
SHIM = ROOT / "tests" / "helpers" / "sglang_cpu"

#: Engine arguments per setting, on top of :data:`BASE`.
SETTINGS: dict[str, dict[str, Any]] = {
    # radix cache on (SGLang's default), page size 1
    "defaults": {},
    # small prefill chunks with decode rows mixed into them, pages of 16 tokens
    "chunked": {"chunked_prefill_size": 32, "enable_mixed_chunk": True, "page_size": 16},
    # a KV pool too small for the batch's decode (and more new tokens per request): the
    # scheduler admits requests on an estimate of their growth, then retracts some
    "pressure": {"max_total_tokens": 400, "max_running_requests": 8},
    # the defaults, with the negative control on (attnpool's pool corrupted after each decode
    # refill: tests/helpers/sglang_cpu/sitecustomize.py; nothing changes for other backends)
    "corrupt": {},
}
#: New tokens per request where a setting needs more than ``--max-new``.
MAX_NEW: dict[str, int] = {"pressure": 96}
#: Settings whose requests may stop at EOS: SGLang reserves a request's whole ``max_new_tokens``
#: when it ignores EOS, so only these can be admitted beyond the pool and retracted.
STOP_AT_EOS = {"pressure"}
#: Environment of a setting's engine: under "pressure" the scheduler's first estimate of each
#: request's growth is 5% of its new tokens (SGLang's default, 70%, admits so few requests
#: that a pool this small never runs out during decode).
SETTING_ENV: dict[str, dict[str, str]] = {"pressure": {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.05"},
                                          "corrupt": {"ATTNPOOL_SGLANG_CORRUPT": "1"}}
BASE: dict[str, Any] = {"device": "cpu", "skip_tokenizer_init": True, "disable_cuda_graph": True,
                        "dtype": "float32", "max_total_tokens": 2048, "random_seed": 0,
                        "log_level": "warning", "mem_fraction_static": 0.5}
RETRACTED = "Retract requests"
#: attnpool's backend name in SGLang (:data:`attnpool.integrations.sglang.NAME`)
NAME = "attnpool"


def env(**extra: str) -> dict[str, str]:
    """This process's environment for an SGLang CPU run: the CPU engine switch and the
    kernel stand-in (and the repository, for ``tests.helpers``) first on ``PYTHONPATH``."""
    path = os.pathsep.join(p for p in (str(SHIM), str(ROOT), os.environ.get("PYTHONPATH"))
                           if p)
    return {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path, **extra}


def run(model: Path, backend: str, settings: list[str], max_new: int,
        batch: list[list[int]] | None = None) -> dict[str, Any]:
    """Each setting's tokens (see the module doc); ``batch``: other prompts' token ids."""
    import sglang

    from tests.helpers.tiny_models import prompts

    if batch is None:
        batch = [p["prompt_token_ids"] for p in prompts()]
    out: dict[str, Any] = {}
    for name in settings:
        params = {"temperature": 0.0, "max_new_tokens": MAX_NEW.get(name, max_new),
                  "ignore_eos": name not in STOP_AT_EOS}
        os.environ.update(SETTING_ENV.get(name, {}))  # (read by the scheduler it spawns)
        engine = sglang.Engine(model_path=str(model), attention_backend=backend,
                               **(BASE | SETTINGS[name]))
        for key in SETTING_ENV.get(name, {}):
            os.environ.pop(key)
        try:
            got = engine.generate(input_ids=batch, sampling_params=params)
            one = engine.generate(input_ids=[[*batch[-1][:-3], 7, 8]], sampling_params=params)
            out[name] = {"batch": [g["output_ids"] for g in got], "one": one[0]["output_ids"]}
        finally:
            engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--settings", default="defaults")
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, help="a JSON list of token-id lists")
    a = ap.parse_args()
    batch = json.loads(a.prompts.read_text()) if a.prompts else None
    tokens = run(a.model, a.backend, a.settings.split(","), a.max_new, batch)
    a.out.write_text(json.dumps(tokens))


if __name__ == "__main__":
    main()

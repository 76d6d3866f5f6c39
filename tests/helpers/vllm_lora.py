"""LoRA through vLLM over a tiny random Llama: PEFT adapter folders written by hand, the merged
transformers reference, and one engine run per fresh process.

- :func:`save_adapters`: adapters on ``q_proj`` / ``v_proj`` as PEFT folders
  (``adapter_config.json``, ``adapter_model.safetensors`` with
  ``base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight``, A ``[r, in]``,
  B ``[out, r]``), random with a fixed seed, large enough to change greedy tokens.
- :func:`reference`: greedy tokens from transformers with each adapter merged into the weights
  (``W += alpha / r * B @ A``), or none.
- :func:`generate_apart`: ``LLM.generate`` of the rows (each with its adapter or none) in a new
  Python process, ``ATTNPOOL_VLLM`` set for that process only; it reports, besides the tokens,
  the class of each punica wrapper vLLM built and, for attnpool's, whether every metadata tensor
  is a view of the arena, the arena's ``data_ptr`` before and after, and how many refills ran,
  and the scheduler's preemptions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: name -> (rank, alpha, seed)
ADAPTERS: dict[str, tuple[int, int, int]] = {"a": (8, 16, 11), "b": (4, 8, 12)}
TARGETS = ("q_proj", "v_proj")


#: a batch's adapters, in row order: base (None), then each adapter of :data:`ADAPTERS`
ROW_ADAPTERS: tuple[str | None, ...] = (None, "a", "b")


def rows(lengths: tuple[int, ...], seed: int) -> list[tuple[list[int], str | None]]:
    """The tests' batch: one random prompt per length, each served once per entry of
    :data:`ROW_ADAPTERS` (adapter-major: rows ``i * len(lengths) + j``)."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]
    return [(p, a) for a in ROW_ADAPTERS for p in prompts]


def save_adapters(model: Path, root: Path) -> dict[str, Path]:
    """The adapters of :data:`ADAPTERS` for ``model``, saved under ``root`` (once)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head,
            "v_proj": cfg["num_key_value_heads"] * head}
    paths = {}
    for name, (r, alpha, seed) in ADAPTERS.items():
        path = root / f"adapter_{name}"
        paths[name] = path
        if (path / "adapter_model.safetensors").exists():
            continue
        path.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for i in range(layers):
            for mod in TARGETS:
                key = f"base_model.model.model.layers.{i}.self_attn.{mod}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, hidden, generator=g) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(outs[mod], r, generator=g) * 0.3
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "base_model_name_or_path": str(model)}))
    return paths


def reference(model: Path, adapters: dict[str, Path], rows: list[tuple[list[int], str | None]],
              new: int) -> list[list[int]]:
    """Greedy ``new`` tokens of each ``(prompt, adapter name or None)`` from transformers, the
    adapter merged into a fresh copy of the weights (full forward per token, float32)."""
    import torch
    import transformers as tf
    from safetensors.torch import load_file

    merged: dict[str | None, Any] = {}
    for name in {a for _, a in rows}:
        m = tf.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
        if name is not None:
            r, alpha, _ = ADAPTERS[name]
            w = load_file(str(adapters[name] / "adapter_model.safetensors"))
            with torch.no_grad():
                for i, layer in enumerate(m.model.layers):
                    for mod in TARGETS:
                        key = f"base_model.model.model.layers.{i}.self_attn.{mod}"
                        lin = getattr(layer.self_attn, mod)
                        lin.weight += (alpha / r) * w[f"{key}.lora_B.weight"] \
                            @ w[f"{key}.lora_A.weight"]
        merged[name] = m
    out = []
    with torch.no_grad():
        for prompt, name in rows:
            ids = list(prompt)
            for _ in range(new):
                logits = merged[name](torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            out.append(ids[len(prompt):])
    return out


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    """In the fresh process: one engine per ``max_loras`` of the spec, the rows in one
    ``generate`` each."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc

    from vllm import LLM, SamplingParams
    from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
    from vllm.lora.request import LoRARequest

    from tests.helpers.vllm_engine import engine_args

    built: list[Any] = []
    native_init = PunicaWrapperBase.__init__

    def recording_init(self: Any, *a: Any, **kw: Any) -> None:
        native_init(self, *a, **kw)
        built.append(self)

    PunicaWrapperBase.__init__ = recording_init  # type: ignore[method-assign]
    ids = {name: i + 1 for i, name in enumerate(sorted(spec["adapters"]))}
    lora = [None if a is None else LoRARequest(a, ids[a], spec["adapters"][a])
            for _, a in spec["rows"]]
    reqs = [{"prompt_token_ids": p} for p, _ in spec["rows"]]
    result: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = spec.get("settings") or {
        str(n): {"max_loras": n} for n in spec["max_loras"]}
    for key, setting in settings.items():
        built.clear()
        kw = {"max_num_seqs": 16, "max_num_batched_tokens": 256} | setting
        llm = LLM(model=spec["model"], **engine_args(enable_lora=True, max_lora_rank=8, **kw))
        try:
            arenas = {}
            for w in built:
                arena = getattr(w, "arena", None)
                if arena is not None:
                    arenas[id(w)] = arena.pool.storage.data_ptr()
            refills: list[int] = []
            for w in built:
                arena = getattr(w, "arena", None)
                if arena is not None:
                    native_refill = arena.refill

                    def counting(*a: Any, _f: Any = native_refill, _n: list[int] = refills,
                                 **kw: Any) -> None:
                        _n.append(1)
                        _f(*a, **kw)

                    arena.refill = counting
            sp = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True)
            outs = llm.generate(reqs, sp, lora_request=lora, use_tqdm=False)
            wrappers = []
            for w in built:
                row: dict[str, Any] = {"cls": type(w).__name__}
                arena = getattr(w, "arena", None)
                if arena is not None:
                    base = arena.pool.storage.untyped_storage().data_ptr()
                    row["views"] = all(
                        getattr(w, "_" + k).untyped_storage().data_ptr() == base
                        for k in arena.tensors)
                    row["ptr_stable"] = arenas[id(w)] == arena.pool.storage.data_ptr()
                wrappers.append(row)
            preempted = int(sum(getattr(m, "value", 0) for m in llm.get_metrics()
                                if m.name == "vllm:num_preemptions"))
            result[key] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                           "wrappers": wrappers, "refills": len(refills),
                           "preemptions": preempted}
        finally:
            del llm
            gc.collect()
    return result


def generate_apart(model: Path, adapters: dict[str, Path],
                   rows: list[tuple[list[int], str | None]], new: int, max_loras: list[int],
                   attnpool: bool, threads: int = 2,
                   settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """:func:`_run` in a fresh Python process with ``ATTNPOOL_VLLM`` set to ``attnpool``: one
    engine per ``max_loras`` (results keyed ``str(max_loras)``) or, with ``settings``, one per
    named setting (``max_loras`` and any other engine arguments; results keyed by name)."""
    spec = {"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()},
            "rows": rows, "new": new, "max_loras": max_loras, "settings": settings}
    code = ("import json, sys; from tests.helpers import vllm_lora as vl; "
            "print('RESULT' + json.dumps(vl._run(json.loads(sys.argv[1]))))")
    env = dict(os.environ, ATTNPOOL_VLLM="1" if attnpool else "0",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], cwd=root, env=env,
                         capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    if out.returncode or not lines:
        raise RuntimeError(f"vLLM LoRA run failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT"):])
    return result

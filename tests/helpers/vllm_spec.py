"""vLLM's speculative decoding on a CPU, natively or with attnpool's backend, one engine per
fresh process: greedy tokens, vLLM's spec-decode counters and which pool phase served the
steps.

Each run is its own Python process (:func:`run`): vLLM cannot start a second engine in a
process that ran its n-gram proposer (:func:`tests.helpers.vllm_engine.generate_apart`), and a
fresh process also gives every run the same start (seeds, caches). Inside it the engine runs
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), through
:func:`tests.helpers.vllm_engine.generate`, with the same engine arguments native and with
attnpool; :data:`attnpool.integrations.vllm.served.SERVED` points at a file of the run's own,
so the result says how many refills each pool phase served, and ``corrupt=True`` sets the
verify view's negative-control hook
(:data:`attnpool.integrations.vllm.served.CORRUPT_VERIFY`).

Models, tiny random Llamas derived from :func:`tests.helpers.tiny_models.save_tiny`'s (nothing
is downloaded):

- :func:`save_models`, for draft-model speculation: a target of two layers whose second layer
  adds little to the residual stream (its output projections scaled by :data:`SECOND_LAYER`),
  and a draft that is the target cut to its first layer (same embeddings, norm and head), so
  that the draft agrees with the target often. The target's attention still decides its
  tokens (its first layer is the random one).
- :func:`save_cyclic`, for n-gram speculation: a random model's greedy tokens do not repeat, so
  the n-gram proposer would find nothing to propose. This target's layers add only
  :data:`CYCLIC_LAYERS` of their output to the residual stream, which stays near the current
  token's embedding, and its head adds :data:`CYCLIC_PULL` times that embedding's direction to
  the logit of the token's successor in a cycle of :data:`CYCLE` ids: greedy runs follow the
  cycles (the n-gram drafts are accepted) and jump between them where attention decides.

Also a script (``python -m tests.helpers.vllm_spec ARGS_JSON``): the child side of :func:`run`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: scale of the target's second layer's ``o_proj`` and ``down_proj`` (see the module doc)
SECOND_LAYER = 0.25
#: the cyclic target (see the module doc): its layers' output scale, the pull towards each
#: token's successor, and the cycles' length (a divisor of the vocabulary, 512)
CYCLIC_LAYERS, CYCLIC_PULL, CYCLE = 0.01, 4.0, 8
#: the spec-decode counters :func:`run` reads from ``LLM.get_metrics()``
_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
_ROOT = Path(__file__).resolve().parents[2]


def save_models(root: Path) -> tuple[Path, Path]:
    """The target and its draft (see the module doc) under ``root``, made once."""
    target, draft = root / "llama_spec_target", root / "llama_spec_draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return target, draft
    import torch
    import transformers as tf

    from tests.helpers.tiny_models import save_tiny

    base = save_tiny("llama", root)
    cfg = tf.LlamaConfig.from_pretrained(base)
    model = tf.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        last = model.model.layers[1]
        last.self_attn.o_proj.weight.mul_(SECOND_LAYER)
        last.mlp.down_proj.weight.mul_(SECOND_LAYER)
    model.save_pretrained(target)
    sd = model.state_dict()
    small = tf.LlamaForCausalLM(tf.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1}))
    small.load_state_dict({k: v for k, v in sd.items()
                           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")})
    small.to(torch.float32).save_pretrained(draft)
    return target, draft


def save_cyclic(root: Path) -> Path:
    """The n-gram target (see the module doc) under ``root``, made once."""
    path = root / "llama_cyclic"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers as tf

    from tests.helpers.tiny_models import save_tiny

    model = tf.LlamaForCausalLM.from_pretrained(save_tiny("llama", root), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(CYCLIC_LAYERS)
            layer.mlp.down_proj.weight.mul_(CYCLIC_LAYERS)
        emb = model.model.embed_tokens.weight
        ids = torch.arange(emb.shape[0])
        successor = ids - ids % CYCLE + (ids + 1) % CYCLE
        model.lm_head.weight[successor] += CYCLIC_PULL * emb / emb.norm(dim=1, keepdim=True)
    model.save_pretrained(path)
    return path


def ngram(k: int) -> dict[str, Any]:
    """vLLM's n-gram speculation, ``k`` drafts per step."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}


def draft_model(draft: Path, k: int) -> dict[str, Any]:
    """vLLM's draft-model speculation with the model at ``draft``, ``k`` drafts per step."""
    return {"model": str(draft), "num_speculative_tokens": k}


def prompts() -> list[dict[str, list[int]]]:
    """Six token-id prompts, repetitive ones (periods 3 to 7, so the n-gram proposer finds
    matches) and two plain ones; lengths 25 to 70 tokens."""
    reqs = [[5, 6, 7, 8] * 12, [9, 10, 11] * 20 + [4], [40, 41, 42, 43, 44, 45, 46] * 10,
            [100, 3, 100, 7] * 8 + [60, 61], list(range(200, 225)), list(range(300, 340))]
    return [{"prompt_token_ids": r} for r in reqs]


@dataclass(frozen=True, slots=True)
class Result:
    """One run's outcome.

    Fields:
        tokens: each request's greedy output token ids.
        drafts, draft_tokens, accepted: vLLM's spec-decode counters of the run.
        per_pos: accepted drafts per draft position.
        served: pool refills per phase (``decode``, ``extend``, ``verify``; empty natively).
    """

    tokens: list[list[int]]
    drafts: int
    draft_tokens: int
    accepted: int
    per_pos: list[int]
    served: dict[str, int]

    def counts(self) -> tuple[int, int, int, list[int]]:
        """The acceptance counters, for comparing two runs."""
        return self.drafts, self.draft_tokens, self.accepted, self.per_pos


def run(model: Path, attnpool: bool, spec: dict[str, Any], max_tokens: int, *,
        reqs: list[dict[str, list[int]]] | None = None, corrupt: bool = False,
        env: dict[str, str] | None = None, **kw: Any) -> Result:
    """Generate ``reqs`` (default :func:`prompts`) with ``speculative_config=spec`` in a
    fresh process (see the module doc); ``env``: more environment for it; ``kw``: more engine
    arguments."""
    from attnpool.integrations.vllm import served

    with tempfile.TemporaryDirectory() as tmp:
        counts = os.path.join(tmp, "served")
        child = dict(os.environ, **(env or {}))
        child[served.SERVED] = counts
        child.pop(served.CORRUPT_VERIFY, None)
        if corrupt:
            child[served.CORRUPT_VERIFY] = "1"
        arg = json.dumps({"model": str(model), "on": attnpool, "spec": spec, "new": max_tokens,
                          "reqs": prompts() if reqs is None else reqs, "kw": kw})
        out = subprocess.run([sys.executable, "-m", "tests.helpers.vllm_spec", arg],
                             cwd=_ROOT, env=child, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
        if out.returncode or not lines:
            raise RuntimeError(f"vLLM run failed ({out.returncode}):\n{out.stderr[-4000:]}")
        got = json.loads(lines[-1][len("RESULT"):])
        by_phase = served.read(counts)
    return Result(served={k.name.lower(): v for k, v in by_phase.items()} if attnpool else {},
                  **got)


def _child(arg: str) -> None:
    """The child side of :func:`run`: one engine, its result printed as one ``RESULT`` line."""
    from tests.helpers import vllm_engine as ve

    a = json.loads(arg)
    tokens, _, metrics = ve.generate(Path(a["model"]), a["on"], a["reqs"], a["new"],
                                     speculative_config=a["spec"], **a["kw"])
    got: dict[str, Any] = {"tokens": tokens, "per_pos": [],
                           **dict.fromkeys(_COUNTERS.values(), 0)}
    for m in metrics:
        if m.name in _COUNTERS:
            got[_COUNTERS[m.name]] += int(m.value)
        elif m.name == _PER_POS:
            got["per_pos"] = [int(v) for v in m.values]
    print("RESULT" + json.dumps(got))


if __name__ == "__main__":
    _child(sys.argv[1])

"""Greedy tokens and accept counts from SGLang's own CPU speculative decoding: the reference
that attnpool's speculative views will be compared with.

SGLang 0.5.23's CPU engine serves speculative decoding only on ``attention_backend="intel_amx"``
(``torch_native`` refuses it), which runs here with

- the platform override ``has_amx=True`` (``ATTNPOOL_SGLANG_AMX=1``, applied in every process
  by ``tests/helpers/sglang_cpu/sitecustomize.py``), and
- the pure-torch stand-ins for the ``sgl_kernel`` CPU ops it calls
  (``tests/helpers/sglang_cpu/sgl_kernel``).

Run as a script in the SGLang environment, one process per run (the engine's scheduler is a
spawned process; every run starts fresh)::

    python -m tests.helpers.sglang_spec --models DIR --run EAGLE-2 --out run.json

A run (:data:`RUNS`) is an algorithm with its settings, or ``plain`` (no speculation,
``torch_native``: the tokens every speculative run must reproduce). It generates the batch of
:func:`prompts` twice (the second round repeats the prompts: their prefixes are cached, and
NGRAM finds the first round's continuations in its corpus) and writes
``{"run": ..., "rounds": [{"tokens": [[...], ...], "spec": [{meta_info spec_*}, ...]}, ...]}``;
with ``--corrupt MODE`` a third round (``"corrupted"``) runs with the draft model's decode
metadata corrupted (the negative control of ``tests/helpers/sglang_cpu/sgl_kernel/_spec.py``).

Models (:func:`save_models`): the tiny random Llama target of :mod:`tests.helpers.tiny_models`
(vocab 512, hidden 128, 2 layers, 4 heads / 2 KV heads, ``initializer_range`` 0.3) and three
drafts derived from it, so that drafts agree with the target often enough for the accept counts
to mean something:

- ``standalone``: a 1-layer Llama, the target's first layer, final norm and head;
- ``eagle``: a ``LlamaForCausalLMEagle`` head (one layer whose ``fc`` passes the token's
  embedding, scaled to unit RMS on average, and ignores the target's hidden state; the layer is
  the target's first one, without its input norm, as EAGLE's first layer has none); embeddings
  and head are the target's (SGLang shares them);
- ``eagle3``: a ``LlamaForCausalLMEagle3`` head (``midlayer`` attends with the target's first
  layer over the normalised token embedding; ``fc`` 2h -> h over the two hidden states it
  captures from the 2-layer target, small and random; full vocabulary, ``d2t`` zero).

Accepted drafts per run (12 requests, first round): STANDALONE 42 (topk 1) / 59 (topk 2), EAGLE
29 / 32, EAGLE3 15 / 19; NGRAM 0 in the first round, 17 per request in the second.

``--backend attnpool`` runs the same settings on attnpool's backend instead of ``intel_amx``
(environment :func:`env` with ``amx=False``: no platform override); ``--corrupt verify`` /
``--corrupt draft`` then corrupt one field of attnpool's verify or draft view in the extra round
(``tests/integrations/sglang/test_sglang_spec_attnpool.py``).

``ATTNPOOL_SGLANG_SPEC_PROBE=<file>`` in a run's environment records what reaches SGLang's
attention backends per forward mode (``tests/helpers/sglang_cpu/sitecustomize.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

from tests.helpers import sglang_engine as se

#: each run's engine arguments
_EAGLE_STEPS = 3
RUNS: dict[str, dict[str, Any]] = {
    "plain": {"attention_backend": "torch_native"},
    # no speculation, on SGLang's CPU path (the stand-ins' attention alone)
    "amx": {},
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    **{f"{algo}-{k}": {"speculative_algorithm": algo, "speculative_eagle_topk": k,
                       "speculative_num_steps": _EAGLE_STEPS,
                       "speculative_num_draft_tokens": _EAGLE_STEPS + 1 if k == 1 else 6,
                       "speculative_draft_model_path": draft}
       for algo, draft in (("STANDALONE", "standalone"), ("EAGLE", "eagle"),
                           ("EAGLE3", "eagle3"))
       for k in (1, 2)},
}
#: engine arguments every run shares (on top of :data:`tests.helpers.sglang_engine.BASE`)
COMMON: dict[str, Any] = {"attention_backend": "intel_amx", "page_size": 1,
                          "max_running_requests": 16}
#: new tokens per request
MAX_NEW = 24
#: the environment of a run on top of :func:`tests.helpers.sglang_engine.env`: the platform
#: override, and one OpenMP thread per process (two engines side by side on a 2-core machine
#: with torch's default threads spin-wait on each other: rounds of 0.4 s took 20 to 30 s)
SPEC_ENV = {"ATTNPOOL_SGLANG_AMX": "1", "OMP_NUM_THREADS": "1"}


def env(amx: bool = True, **extra: str) -> dict[str, str]:
    """An engine process's environment: SGLang's CPU engine, the kernel stand-ins and the
    platform override (``amx=False``: without it, as attnpool's runs go: nothing of SGLang's
    ``intel_amx`` path is used)."""
    spec = SPEC_ENV if amx else {k: v for k, v in SPEC_ENV.items()
                                  if k != "ATTNPOOL_SGLANG_AMX"}
    got = se.env(**spec, **extra)
    if not amx:
        got.pop("ATTNPOOL_SGLANG_AMX", None)
    return got


def prompts(n: int = 12, seed: int = 7) -> list[list[int]]:
    """``n`` token-id prompts of 1 to 90 tokens, the last three sharing a 40-token prefix."""
    rng = random.Random(seed)
    lengths = [1, 3, 8, 17, 30, 45, 64, 90][: max(n - 3, 0)]
    lengths += [rng.randrange(2, 60) for _ in range(n - 3 - len(lengths))]
    out = [[rng.randrange(1, 500) for _ in range(m)] for m in lengths]
    prefix = [rng.randrange(1, 500) for _ in range(40)]
    out += [prefix + [rng.randrange(1, 500) for _ in range(k + 1)] for k in range(3)]
    return out


def save_models(root: Path) -> dict[str, Path]:
    """The target and its three drafts under ``root`` (made once): name -> folder."""
    from tests.helpers.tiny_models import save_tiny

    target = save_tiny("llama", root)
    paths = {"target": target, **{name: root / f"llama_{name}" for name in
                                  ("standalone", "eagle", "eagle3")}}
    if all((p / "config.json").exists() for p in paths.values()):
        return paths

    import torch
    import transformers as tf
    from safetensors.torch import save_file

    cfg = tf.LlamaConfig.from_pretrained(target)
    sd = tf.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).state_dict()
    h = cfg.hidden_size
    layer0 = {k[len("model.layers.0."):]: v for k, v in sd.items()
              if k.startswith("model.layers.0.")}

    # STANDALONE: the target cut to its first layer
    small = tf.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
    model = tf.LlamaForCausalLM(small).to(torch.float32)
    model.load_state_dict({k: v for k, v in sd.items()
                           if not k.startswith("model.layers.") or
                           k.startswith("model.layers.0.")})
    model.save_pretrained(paths["standalone"])

    def head(path: Path, arch: str, weights: dict[str, torch.Tensor], **extra: Any) -> None:
        path.mkdir(parents=True, exist_ok=True)
        conf = {**cfg.to_dict(), "architectures": [arch], "num_hidden_layers": 1, **extra}
        conf.pop("transformers_version", None)
        (path / "config.json").write_text(json.dumps(conf, indent=1))
        save_file({k: v.contiguous() for k, v in weights.items()},
                  str(path / "model.safetensors"))

    # EAGLE: fc(cat(embedding, hidden)) keeps the embedding, scaled to unit RMS on average
    # (EAGLE's first layer has no input norm; the target's norm weights are ones)
    emb = sd["model.embed_tokens.weight"]
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h) / emb.pow(2).mean().sqrt()
    eagle = {f"layers.0.{k}": v for k, v in layer0.items() if "input_layernorm" not in k}
    head(paths["eagle"], "LlamaForCausalLMEagle",
         {**eagle, "fc.weight": fc, "fc.bias": torch.zeros(h),
          "embed_tokens.weight": sd["model.embed_tokens.weight"],
          "lm_head.weight": sd["lm_head.weight"]})

    # EAGLE3: q/k/v read the normalised embedding half of the midlayer's 2h input; fc over
    # the two captured target hidden states (2h -> h) is small and random
    gen = torch.Generator().manual_seed(3)
    mid = {}
    for k, v in layer0.items():
        if k.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            v = torch.cat([v, torch.zeros_like(v)], dim=1)
        mid[f"midlayer.{k}"] = v
    mid["midlayer.hidden_norm.weight"] = torch.ones(h)
    head(paths["eagle3"], "LlamaForCausalLMEagle3",
         {**mid, "fc.weight": torch.randn(h, 2 * h, generator=gen) * 0.02,
          "norm.weight": sd["model.norm.weight"], "lm_head.weight": sd["lm_head.weight"],
          "d2t": torch.zeros(cfg.vocab_size, dtype=torch.int64),
          "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool)},
         draft_vocab_size=cfg.vocab_size, num_aux_hidden_states=2,
         eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 0]})
    return paths


def run(models: dict[str, Path], name: str, batch: list[list[int]], max_new: int = MAX_NEW,
        rounds: int = 2, corrupt: str | None = None, flag: Path | None = None,
        backend: str | None = None) -> dict[str, Any]:
    """One run's tokens and spec counters (see the module doc). ``corrupt``: one more round,
    ``"corrupted"``, with the draft's decode metadata corrupted that way (the stand-in's
    negative control, or attnpool's: ``verify`` / ``draft`` corrupt one field of attnpool's
    verify or draft view, ``tests/helpers/sglang_cpu/sitecustomize.py``; switched on in the
    running engine through the file ``flag``). ``backend``: the attention backend instead of
    the run's own (``attnpool``: attnpool's backend serves the target and the draft)."""
    import sglang

    args = {**se.BASE, **COMMON, **RUNS[name]}
    if backend is not None:
        args["attention_backend"] = backend
    draft = args.get("speculative_draft_model_path")
    if draft is not None:
        args["speculative_draft_model_path"] = str(models[draft])
    params = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}
    if corrupt is not None:
        assert flag is not None and not flag.exists()
        os.environ["ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE"] = str(flag)  # (the scheduler's)
    t = time.perf_counter()
    engine = sglang.Engine(model_path=str(models["target"]), **args)
    started = time.perf_counter() - t
    out: dict[str, Any] = {"run": name, "backend": args["attention_backend"],
                           "args": {k: str(v) for k, v in RUNS[name].items()},
                           "start_s": round(started, 1), "rounds": []}

    def generate() -> dict[str, Any]:
        t = time.perf_counter()
        got = engine.generate(input_ids=batch, sampling_params=params)
        return {"tokens": [g["output_ids"] for g in got],
                "spec": [{k: v for k, v in g["meta_info"].items() if k.startswith("spec_")}
                         for g in got],
                "seconds": round(time.perf_counter() - t, 2)}

    try:
        for _ in range(rounds):
            out["rounds"].append(generate())
        if corrupt is not None:
            assert flag is not None
            flag.write_text(corrupt)
            out["corrupted"] = {"how": corrupt, **generate()}
    finally:
        engine.shutdown()
        if flag is not None:
            flag.unlink(missing_ok=True)
    return out


def result(results: dict[str, Any], key: str) -> dict[str, Any]:
    """One run's output from a test's results (a run that failed left its log's tail there
    instead: the assertion shows it)."""
    got = results[key]
    assert isinstance(got, dict), f"the {key} run failed:\n{got}"
    return got


def correct_drafts(round_: dict[str, Any]) -> list[int]:
    """Each request's accepted drafts in one round of a run."""
    return [s["spec_num_correct_drafts"] for s in round_["spec"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=Path, required=True, help="folder for save_models")
    ap.add_argument("--run", required=True, choices=sorted(RUNS))
    ap.add_argument("--max-new", type=int, default=MAX_NEW)
    ap.add_argument("--corrupt", choices=("self", "prefix", "verify", "draft"),
                    help="then one more round with the draft's decode metadata corrupted "
                         "(self, prefix: SGLang's own path) or one field of attnpool's verify "
                         "or draft view (verify, draft: --backend attnpool)")
    ap.add_argument("--backend", help="the attention backend instead of the run's own "
                                      "(attnpool; such a run needs no ATTNPOOL_SGLANG_AMX)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if (RUNS[a.run].get("speculative_algorithm") and a.backend is None
            and os.environ.get("ATTNPOOL_SGLANG_AMX") != "1"):
        raise SystemExit("a speculative run needs ATTNPOOL_SGLANG_AMX=1 (see env())")
    result = run(save_models(a.models), a.run, prompts(), a.max_new, corrupt=a.corrupt,
                 flag=a.out.with_suffix(".corrupt"), backend=a.backend)
    a.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

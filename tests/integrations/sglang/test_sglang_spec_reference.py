"""SGLang's own speculative decoding on a CPU gives the greedy tokens of its plain
(non-speculative) ``torch_native`` run: the reference that attnpool's speculative views will be
compared with, token for token and accept count for accept count.

SGLang 0.5.23's CPU engine serves speculative decoding only on its ``intel_amx`` path, which runs
here under the platform override ``has_amx=True`` with pure-torch stand-ins for the
``sgl_kernel`` CPU ops it calls (``tests/helpers/sglang_cpu``; see
:mod:`tests.helpers.sglang_spec`). Every run is a fresh process (``float32``, greedy, 12
requests of 1 to 90 prompt tokens, three sharing a prefix, 24 new tokens each, generated twice:
the second round repeats the prompts, so their prefixes come from the radix cache and NGRAM finds
the first round's continuations in its corpus):

- ``plain``: no speculation, ``torch_native``;
- ``NGRAM`` (4 draft tokens, a tree mask); ``STANDALONE``, ``EAGLE`` and ``EAGLE3`` with topk
  1 and 2 (3 draft steps; 4 draft tokens for topk 1, 6 for topk 2), each on a tiny draft
  derived from the tiny random Llama target.

Checks per run: tokens identical to ``plain`` in both rounds; every request went through
speculative verification (``spec_verify_ct`` > 0) and the drafts were accepted somewhere (so
the accept counts are worth comparing); for the draft-model algorithms, the second round accepts
exactly as many drafts per request as the first (the draft's KV for cached prefixes is reused).

The negative control: EAGLE topk 2's engine runs a third round with the draft's decode
metadata corrupted (the stand-in's table names the newest committed token's K/V slot where the
step-0 query's own should be: ``ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE``). Its tokens stay
identical (verification corrects every draft), but the per-request accept counts
(``meta_info["spec_num_correct_drafts"]``) move: comparing accept counts sees draft-phase errors
that tokens do not.

CI runs NGRAM, EAGLE topk 2 and STANDALONE topk 1 (four engine processes with ``plain``, two at
a time); ``ATTNPOOL_SGLANG_SPEC_FULL=1`` runs the whole matrix, plus ``amx`` (no speculation on
the ``intel_amx`` path: the stand-ins' attention alone).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

from tests.helpers import sglang_engine as se
from tests.helpers import sglang_spec as ss
from tests.helpers.processes import log_tail, run_all

FULL = os.environ.get("ATTNPOOL_SGLANG_SPEC_FULL") == "1"
#: the speculative runs, and the sample CI runs
MATRIX = ("NGRAM", "STANDALONE-1", "STANDALONE-2", "EAGLE-1", "EAGLE-2", "EAGLE3-1",
          "EAGLE3-2")
SAMPLE = ("NGRAM", "EAGLE-2", "STANDALONE-1")
#: the negative control: this run's engine, one more round with its draft decode metadata
#: corrupted this way
CONTROL, CORRUPTION = "EAGLE-2", "self"
#: engine processes at a time (the CI machine has 2 cores)
PARALLEL = int(os.environ.get("ATTNPOOL_SGLANG_SPEC_PARALLEL", "2"))
REPORT = os.environ.get("ATTNPOOL_SGLANG_REPORT")


def _selected() -> list[str]:
    return ["plain", *(MATRIX if FULL else SAMPLE), *(["amx"] if FULL else [])]


def _record(**row: Any) -> None:
    print(json.dumps(row))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every selected run, ``PARALLEL`` engine processes at a time:
    name -> the helper's JSON, or the process's log where it failed."""
    root = tmp_path_factory.mktemp("sglang_spec")
    models = root / "models"
    ss.save_models(models)  # (once, before the processes read them)
    jobs = {key: ([sys.executable, "-m", "tests.helpers.sglang_spec", "--models", str(models),
                   "--run", key, "--out", str(root / f"{key}.json"),
                   *(["--corrupt", CORRUPTION] if key == CONTROL else [])], ss.env())
            for key in _selected()}
    t0 = time.perf_counter()
    status = run_all(jobs, root, parallel=PARALLEL, cwd=se.ROOT)
    out = {key: json.loads((root / f"{key}.json").read_text()) if code == 0 else
           log_tail(root, key) for key, code in status.items()}
    _record(test="spec reference", processes=len(jobs),
            seconds=round(time.perf_counter() - t0, 1))
    yield out


@pytest.mark.parametrize("name", MATRIX)
def test_spec_tokens(name: str, results: dict[str, Any]) -> None:
    if name not in _selected():
        pytest.skip("not in CI's sample: ATTNPOOL_SGLANG_SPEC_FULL=1 runs the whole matrix")
    plain, run = ss.result(results, "plain"), ss.result(results, name)
    for r, (want, got) in enumerate(zip(plain["rounds"], run["rounds"], strict=True)):
        spec = got["spec"]
        _record(run=name, round=r, requests=len(want["tokens"]),
                identical=sum(a == b for a, b in zip(want["tokens"], got["tokens"],
                                                     strict=True)),
                correct_drafts=ss.correct_drafts(got),
                proposed=sum(s["spec_num_proposed_drafts"] for s in spec),
                verify_steps=sum(s["spec_verify_ct"] for s in spec), seconds=got["seconds"])
        assert got["tokens"] == want["tokens"], f"{name}, round {r}"
        assert all(s["spec_verify_ct"] > 0 for s in spec), f"{name}: a request not verified"
    first, last = (ss.correct_drafts(r) for r in (run["rounds"][0], run["rounds"][-1]))
    assert sum(last) > 0, f"{name}: no draft ever accepted"
    if name != "NGRAM":  # (NGRAM's corpus grows with the first round)
        assert first == last, name


def test_amx_plain(results: dict[str, Any]) -> None:
    """No speculation on the intel_amx path: the stand-ins' attention gives the tokens of
    ``torch_native``."""
    if "amx" not in _selected():
        pytest.skip("ATTNPOOL_SGLANG_SPEC_FULL=1 runs it")
    plain, amx = ss.result(results, "plain"), ss.result(results, "amx")
    assert [r["tokens"] for r in amx["rounds"]] == [r["tokens"] for r in plain["rounds"]]


def test_negative_control_moves_accept_counts(results: dict[str, Any]) -> None:
    plain, run = ss.result(results, "plain"), ss.result(results, CONTROL)
    clean, bad = run["rounds"][-1], run["corrupted"]
    assert bad["tokens"] == plain["rounds"][-1]["tokens"]
    before, after = ss.correct_drafts(clean), ss.correct_drafts(bad)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    _record(run=f"{CONTROL} corrupted draft metadata ({bad['how']})",
            correct_drafts=after, clean=before, changed_requests=changed)
    assert changed, "corrupting the draft's decode metadata left every accept count unchanged"

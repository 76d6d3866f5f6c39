"""SGLang's speculative decoding served by attnpool's backend on a CPU: the target's verify
batches through ``pool.verify``, the draft model's decode steps through ``pool.draft`` and its
extends through ``pool.draft_extend`` (``attention_backend="attnpool"``, SDPA attending, no
platform override: nothing of SGLang's ``intel_amx`` path runs).

Every run is a fresh engine process of :mod:`tests.helpers.sglang_spec` (``float32``, greedy,
12 requests of 1 to 90 prompt tokens, three sharing a prefix, 24 new tokens each, generated
twice):

- ``plain``: no speculation, ``torch_native``: the tokens every run must give;
- per algorithm, SGLang's own CPU speculative path (``intel_amx`` under the platform
  override, with the ``sgl_kernel`` stand-ins: the reference of
  ``test_sglang_spec_reference.py``) and attnpool's backend.

Checks per algorithm: attnpool's tokens are the plain run's in both rounds, and the accepted
drafts of every request (``meta_info["spec_num_correct_drafts"]``, the sharp check: a
draft-phase error moves them while verification keeps the tokens) are those of SGLang's own
path, round for round; the pool served the run (its refill counts:
:class:`attnpool.integrations.sglang.backend.Served`): verify refills, and for the draft-model
algorithms draft rounds and draft extends.

Negative controls, in the same engines (one more round with one field of attnpool's view
corrupted, ``tests/helpers/sglang_cpu/sitecustomize.py``): EAGLE topk 2 with its draft view's
first request one committed key short (the accept counts must move), STANDALONE topk 1 with its
verify view's (the tokens or the accept counts must move).

CI runs NGRAM, EAGLE topk 2 and STANDALONE topk 1 (seven engine processes, two at a time);
``ATTNPOOL_SGLANG_SPEC_FULL=1`` runs the whole matrix (STANDALONE, EAGLE, EAGLE3 with topk 1
and 2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from tests.helpers import sglang_engine as se
from tests.helpers import sglang_spec as ss
from tests.helpers.processes import log_tail, run_all

FULL = os.environ.get("ATTNPOOL_SGLANG_SPEC_FULL") == "1"
MATRIX = ("NGRAM", "STANDALONE-1", "STANDALONE-2", "EAGLE-1", "EAGLE-2", "EAGLE3-1",
          "EAGLE3-2")
SAMPLE = ("NGRAM", "EAGLE-2", "STANDALONE-1")
#: the negative controls: attnpool's run of this algorithm gets one more round with this
#: view corrupted
CONTROLS = {"EAGLE-2": "draft", "STANDALONE-1": "verify"}
PARALLEL = int(os.environ.get("ATTNPOOL_SGLANG_SPEC_PARALLEL", "2"))
#: one JSON line per comparison, appended where this points (as the other SGLang tests)
REPORT = os.environ.get("ATTNPOOL_SGLANG_REPORT")


def _selected() -> tuple[str, ...]:
    return MATRIX if FULL else SAMPLE


def _record(**row: Any) -> None:
    print(json.dumps(row))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


def _job(root: Path, models: Path, key: str) -> tuple[list[str], dict[str, str]]:
    """A run's command line and environment: ``key`` is ``plain``, ``<run>`` (SGLang's own
    path) or ``<run>@attnpool``."""
    name, _, backend = key.partition("@")
    cmd = [sys.executable, "-m", "tests.helpers.sglang_spec", "--models", str(models),
           "--run", name, "--out", str(root / f"{key}.json")]
    if not backend:
        return cmd, ss.env()
    cmd += ["--backend", backend]
    if name in CONTROLS:
        cmd += ["--corrupt", CONTROLS[name]]
    from attnpool.integrations.sglang.backend import REPORT as SERVED

    # (the backend's refill counts, in their own files: SERVED is also this test's report)
    return cmd, ss.env(amx=False, **{SERVED: str(root / f"{key}.served")})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every run, ``PARALLEL`` engine processes at a time: key -> the helper's JSON (with the
    pool's refill counts under ``"served"`` for attnpool's runs), or the process's log where
    it failed."""
    from attnpool.integrations.sglang.backend import Served

    root = tmp_path_factory.mktemp("sglang_spec_attnpool")
    models = root / "models"
    ss.save_models(models)
    keys = ["plain", *(k for name in _selected() for k in (f"{name}@attnpool", name))]
    t0 = time.perf_counter()
    status = run_all({key: _job(root, models, key) for key in keys}, root, parallel=PARALLEL,
                     cwd=se.ROOT)
    out: dict[str, Any] = {}
    for key, code in status.items():
        if code != 0:
            out[key] = log_tail(root, key)
            continue
        got = json.loads((root / f"{key}.json").read_text())
        if "@" in key:
            got["served"] = Served.read_all(str(root / f"{key}.served"))
        out[key] = got
    _record(test="spec attnpool", processes=len(keys), seconds=round(time.perf_counter() - t0, 1))
    yield out


@pytest.mark.parametrize("name", MATRIX)
def test_attnpool_spec_tokens_and_accept_counts(name: str, results: dict[str, Any]) -> None:
    from attnpool.integrations.sglang.backend import Served

    if name not in _selected():
        pytest.skip("not in CI's sample: ATTNPOOL_SGLANG_SPEC_FULL=1 runs the whole matrix")
    plain, own, ours = (ss.result(results, k) for k in ("plain", name, f"{name}@attnpool"))
    assert ours["backend"] == se.NAME and own["backend"] == "intel_amx"
    for r, (want, ref, got) in enumerate(zip(plain["rounds"], own["rounds"], ours["rounds"],
                                             strict=True)):
        _record(run=f"{name} attnpool", round=r,
                identical=sum(a == b for a, b in zip(want["tokens"], got["tokens"],
                                                     strict=True)),
                correct_drafts=ss.correct_drafts(got), sglang_correct_drafts=ss.correct_drafts(ref),
                seconds=got["seconds"], sglang_seconds=ref["seconds"])
        assert got["tokens"] == want["tokens"], f"{name}, round {r}: tokens"
        assert ss.correct_drafts(got) == ss.correct_drafts(ref), f"{name}, round {r}: accept counts"
        assert [s["spec_verify_ct"] for s in got["spec"]] == \
            [s["spec_verify_ct"] for s in ref["spec"]], f"{name}, round {r}: verify steps"
    served = ours["served"]
    _record(run=f"{name} attnpool served", decode=served[Served.DECODE],
            extend=served[Served.EXTEND], verify=served[Served.VERIFY],
            draft_rounds=served[Served.DRAFT], draft_extend=served[Served.DRAFT_EXTEND])
    assert served[Served.VERIFY] > 0 and served[Served.EXTEND] > 0
    if name == "NGRAM":
        assert served[Served.DRAFT] == served[Served.DRAFT_EXTEND] == 0
    else:
        assert served[Served.DRAFT] > 0 and served[Served.DRAFT_EXTEND] > 0


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_negative_control(name: str, results: dict[str, Any]) -> None:
    """One field of attnpool's view corrupted: the accept counts (a draft view) or the tokens
    or the accept counts (a verify view) move, so the comparisons above see such errors."""
    if name not in _selected():
        pytest.skip("not in this selection")
    plain, ours = ss.result(results, "plain"), ss.result(results, f"{name}@attnpool")
    clean, bad = ours["rounds"][-1], ours["corrupted"]
    tokens_moved = bad["tokens"] != plain["rounds"][-1]["tokens"]
    before, after = ss.correct_drafts(clean), ss.correct_drafts(bad)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    _record(run=f"{name} attnpool, {bad['how']} view corrupted", tokens_moved=tokens_moved,
            correct_drafts=after, clean=before, changed_requests=changed)
    if bad["how"] == "draft":  # verification keeps the tokens; the proposals change
        assert bad["tokens"] == plain["rounds"][-1]["tokens"]
        assert changed, "corrupting attnpool's draft view left every accept count unchanged"
    else:
        assert tokens_moved or changed, \
            "corrupting attnpool's verify view changed neither tokens nor accept counts"

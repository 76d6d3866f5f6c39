"""``attnpool demo`` runs a transformers model by default; ``attnpool bench --e2e`` compares it
with transformers' own generation paths in one run."""

from __future__ import annotations

import json
import pathlib

import pytest

from attnpool.tools import bench_e2e, cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY = bench_e2e.E2ECase("tiny", layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32,
                         vocab=64, prompts=5, lo=1, hi=20, new_tokens=4, max_bs=2, page_size=8)


def test_demo_runs_the_transformers_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--device", "cpu", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "attnpool demo (transformers)" in out and "steps/s" in out
    assert "matches model.generate (do_sample=False) on the first 3 prompts: ok" in out
    assert "acceptance 1.00" in out and "same tokens as plain decoding on 12/12" in out


def test_toy_demo_still_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--toy", "--device", "cpu", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "max|attn - dense|" in out
    # the kernel that runs, by name: SDPA reading each of the pool's layouts in turn
    assert "no flash-attn or FlashInfer kernel runs here" in out
    assert "SDPA reading FLASH_ATTN" in out and "SDPA reading FLASHINFER" in out


def test_bench_e2e_json(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench_e2e, "QUICK", TINY)
    monkeypatch.setattr(bench_e2e, "ROUNDS", 1)
    path = tmp_path / "e2e.json"
    assert cli.main(["bench", "--e2e", "--quick", "--device", "cpu", "--json", str(path)]) == 0
    table = capsys.readouterr().out
    rep = json.loads(path.read_text())
    got = {r["method"]: r for r in rep["results"]}
    assert set(got) == {"attnpool", "hf-continuous-batching", "hf-generate"}
    for name, r in got.items():
        assert r["tokens"] == TINY.prompts * TINY.new_tokens, name
        assert r["tokens_per_s_best"] > 0 and r["steps"] > 0 and r["metadata_us_per_step"] > 0
        assert r["same_tokens_as_hf_generate"] == TINY.prompts, name  # float32, same greedy
        assert f"| {name} |" in table
    assert rep["machine"]["transformers"] and rep["machine"]["threads"] == 1


def test_bench_e2e_rejects_plot(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--e2e", "--plot", "x.png"]) == 2
    assert "--plot" in capsys.readouterr().err

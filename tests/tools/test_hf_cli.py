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


def test_demo_runs_the_transformers_model(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ATTNPOOL_CACHE", str(tmp_path))  # no checkpoint: the tiny random model
    assert cli.main(["demo", "--device", "cpu", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "python -m attnpool fetch smollm2" in out  # how to get the trained one
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


def test_decode_step_breakdown_and_report() -> None:
    """``bench --e2e --model``'s report on the tiny model: each method's decode step split into
    its parts (which add up to the step), the ratios and the tables."""
    import torch

    from attnpool.tools import bench_e2e_model

    torch.manual_seed(0)
    model, wl = bench_e2e.tiny_model(TINY, torch.device("cpu")), TINY.workload()
    b = bench_e2e_model.breakdown(model, wl)
    assert set(b) == {"attnpool", "hf-generate"}
    for name, p in b.items():
        assert p["decode_steps"] > 0 and p["rows"] > 0, name
        assert min(p["attention"], p["kv_store"], p["rest_of_model"], p["step"]) > 0, (name, p)
        parts = sum(p[k] for k in ("metadata", "attention", "kv_store", "rest_of_model", "other"))
        assert abs(parts - p["step"]) < 1e-6 * p["step"], (name, p)
    # static batches run new_tokens - 1 decode steps each, over every row of the batch
    batches = -(-TINY.prompts // TINY.max_bs)
    assert b["hf-generate"]["decode_steps"] == batches * (TINY.new_tokens - 1)
    assert b["hf-generate"]["rows"] == pytest.approx(TINY.prompts / batches)
    res = bench_e2e.run_workload(model, wl, rounds=1, progress=False)
    text = bench_e2e_model.format_run({"workload": wl.describe(), "threads": 1, "results": res,
                                       "breakdown": b})
    for want in ("### tiny, 1 thread: ", "attnpool / hf-generate: ", "| kv_store | ",
                 "| rows computed per step | ", f"| {TINY.prompts}/{TINY.prompts} |"):
        assert want in text, (want, text)

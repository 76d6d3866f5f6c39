"""``attnpool bench``: runs end to end on tiny sizes, writes well-formed JSON, fails cleanly."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from attnpool.tools import bench, cli

TINY = bench.Suite(
    init_configs=("tiny",),
    update_parts=(("decode", 16), ("verify", 1)),
    update_bs=(1, 4),
    update_context=256,
    budget_s=0.002,
    min_rounds=2,
    max_rounds=3,
    configs={"tiny": {"max_bs": 4, "max_context_len": 256, "page_size": 16,
                      "num_draft_tokens": 4, "topk": 2, "spec_steps": 2}},
)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "QUICK", TINY)


def test_bench_quick_json(tiny: None, tmp_path: pathlib.Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert {"machine", "results", "memory", "ratios", "skipped", "quick"} <= rep.keys()
    assert rep["quick"] is True
    assert rep["machine"]["device"] == "cpu" and rep["machine"]["torch"]
    got = {(r["group"], r["case"], r["impl"]) for r in rep["results"]}
    init_impls = {i.name for i in bench.INIT_IMPLS}
    assert {("init", "tiny", i) for i in init_impls} <= got
    for case in ("decode-p16-bs1", "decode-p16-bs4", "verify-p1-bs1", "verify-p1-bs4"):
        assert ("update", case, "classic") in got and ("update", case, "attnpool-reference") in got
    for r in rep["results"]:
        assert r["median_s"] > 0 and r["min_s"] > 0 and 2 <= r["rounds"] <= 3
        assert r["config"]["max_bs"] == 4 and r["config"]["device"] == "cpu"
    assert all(r["nbytes"] > 0 for r in rep["results"] if r["group"] == "init")
    # one ratio per non-baseline result, each against its own case's baseline
    assert len(rep["ratios"]) == len(rep["results"]) - 1 - 4
    for r in rep["ratios"]:
        base = next(x for x in rep["results"] if (x["group"], x["case"], x["impl"])
                    == (r["group"], r["case"], r["baseline"]))
        mine = next(x for x in rep["results"] if (x["group"], x["case"], x["impl"])
                    == (r["group"], r["case"], r["impl"]))
        assert r["ratio"] == pytest.approx(mine["median_s"] / base["median_s"]) and r["ratio"] > 0
    (mem,) = rep["memory"]
    assert 0 < mem["overlaid_nbytes"] < mem["separate_nbytes"]  # verify/draft overlay decode
    assert all("interpret" in s["reason"] for s in rep["skipped"])
    text = capsys.readouterr().out
    assert "attnpool-reference / classic" in text and "attnpool arena / per-buffer zeros" in text


def test_bench_plot_without_matplotlib_is_a_clean_error(
        tiny: None, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec answers None
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--quick", "--json", str(out), "--plot",
                     str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "attnpool[plot]" in err
    assert not out.exists()  # refused before measuring anything


def test_bench_plot_writes_png(tiny: None, tmp_path: pathlib.Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the 'plot' extra) is not installed")
    png = tmp_path / "p.png"
    assert cli.main(["bench", "--quick", "--device", "cpu", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_bad_device_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--quick", "--device", "tpu0"]) == 2
    assert "--device must be cpu, cuda[:N] or auto, got 'tpu0'" in capsys.readouterr().err


def test_bench_help_names_the_options() -> None:
    out = subprocess.run([sys.executable, "-m", "attnpool", "bench", "--help"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert all(o in out.stdout for o in ("--quick", "--json", "--plot"))


def test_host_cost_table_covers_every_part_and_restores_the_kernels() -> None:
    import importlib.util

    import torch

    from attnpool.tools import bench_host

    triton = importlib.util.find_spec("triton") is not None
    rows = bench_host.run(torch.device("cpu"), triton, batch_sizes=(1,))
    assert [r.part for r in rows] == [p[0] for p in bench_host.PARTS]
    for r in rows:
        assert r.cost["reference"] is not None and r.cost["reference"] > 0
        assert (r.cost["classic"] is not None) == (r.part in ("decode", "verify chain"))
        assert (r.cost["fused eager"] is not None) == triton
    table = bench_host.table(rows)
    assert table.count("\n") == len(rows) + 1 and "reference / classic" in table
    if triton:
        from attnpool.update.triton import paged_kernels

        assert not isinstance(paged_kernels.paged_kernel, bench_host._NoLaunch)

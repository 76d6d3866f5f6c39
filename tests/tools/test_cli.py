"""The command line and the README, run as a user would."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnpool", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_plan_table_and_json() -> None:
    out = _run("plan", "--max-bs", "160", "--context", "131072")
    assert out.returncode == 0, out.stderr
    assert "page_table" in out.stdout and "160x131072" in out.stdout
    js = _run("plan", "--max-bs", "8", "--context", "1024", "--page-size", "16", "--layout",
              "both", "--json")
    d = json.loads(js.stdout)
    names = {b["name"] for b in d["buffers"]}
    assert {"page_table", "kv_indptr", "kv_indices", "kv_last_page_len"} <= names
    assert d["nbytes"] <= d["separate_nbytes"]


def test_plan_extend_tokens_sizes_the_extend_phase() -> None:
    js = _run("plan", "--max-bs", "8", "--context", "1024", "--page-size", "16",
              "--extend-tokens", "512", "--json")
    assert js.returncode == 0, js.stderr
    bufs = {(b["phase"], b["name"]): b for b in json.loads(js.stdout)["buffers"]}
    assert bufs[("extend", "positions")]["shape"] == [512]
    plain = json.loads(_run("plan", "--max-bs", "8", "--context", "1024", "--json").stdout)
    assert all(b["phase"] != "extend" for b in plain["buffers"])


def test_plan_flashmla_metadata() -> None:
    js = _run("plan", "--max-bs", "8", "--context", "1024", "--page-size", "64",
              "--draft-tokens", "3", "--flashmla-sms", "132", "--flashmla-heads", "128", "--json")
    assert js.returncode == 0, js.stderr
    bufs = {(b["phase"], b["name"]): b for b in json.loads(js.stdout)["buffers"]}
    assert bufs[("decode", "tile_scheduler_metadata")]["shape"] == [66, 8]
    assert bufs[("verify", "tile_scheduler_metadata")]["shape"] == [22, 8]
    assert bufs[("decode", "num_splits")]["shape"] == [9]
    _one_line_error(_run("plan", "--page-size", "16", "--flashmla-sms", "132",
                         "--flashmla-heads", "128"), "page_size=64", "got page_size=16")
    _one_line_error(_run("plan", "--page-size", "64", "--flashmla-sms", "132"),
                    "--flashmla-heads")


def test_plan_bad_config_is_a_clean_error() -> None:
    out = _run("plan", "--page-size", "3")
    assert out.returncode == 2
    assert "power of two" in out.stderr and "Traceback" not in out.stderr


def _one_line_error(out: subprocess.CompletedProcess[str], *words: str) -> None:
    """Exit code 2, nothing on stdout, exactly one line on stderr that names the problem."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "", out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("attnpool"), lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


BAD_ARGS = [
    (("demo", "--steps", "-3"), ("--steps", "-3")),
    (("demo", "--steps", "0"), ("--steps", "[1, ")),
    (("demo", "--toy", "--steps", "x"), ("--steps", "'x'")),
    (("demo", "--seed", "-1"), ("--seed",)),
    (("demo", "--device", "tpu0"), ("--device must be cpu, cuda[:N] or auto, got 'tpu0'",)),
    (("bench", "--device", "cpu:0", "--quick"), ("--device",)),
    (("plan", "--context", str(2**31)), ("--context", str(2**31))),
    (("plan", "--max-bs", "0"), ("--max-bs",)),
    (("plan", "--max-bs", "100000", "--context", "1000000"), ("--max-bs * --context", "int32")),
    (("plan", "--max-bs", "2048", "--context", "1000000", "--draft-tokens", "999999", "--topk",
      "2"), ("GiB", "64 GiB")),
    (("plan", "--page-size", "0"), ("--page-size",)),
    (("plan", "--draft-tokens", "-1"), ("--draft-tokens",)),
    (("plan", "--chunk", "0"), ("--chunk",)),
    (("plan", "--layout", "paged"), ("--layout",)),
    (("plan", "--draft-tokens", "2000", "--context", "1024"), ("num_draft_tokens", "2000")),
    (("plan", "--bogus"), ("--bogus",)),
    (("bench", "--e2e", "--plot", "x.png"), ("--plot",)),
    (("bench", "--model", "smollm2"), ("--model", "add --e2e")),
    (("demo", "--toy", "--prompt", "Hi"), ("--toy", "--prompt")),
    (("fetch", "tinyllama"), ("invalid choice: 'tinyllama'", "smollm2")),
    (("fetch",), ("name",)),
    ((), ("plan,demo,bench",)),
]


@pytest.mark.parametrize(("args", "words"), BAD_ARGS, ids=[" ".join(a) or "none" for a, _ in BAD_ARGS])
def test_bad_argument_is_one_line_and_exit_2(args: tuple[str, ...], words: tuple[str, ...],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # in-process: cli.main is what `python -m attnpool` exits with (checked by subprocess below)
    from attnpool.tools import cli

    code = cli.main(list(args))
    out = capsys.readouterr()
    _one_line_error(subprocess.CompletedProcess(args, code, out.out, out.err), *words)


@pytest.mark.parametrize("args", [("demo", "--steps", "-3"), ("plan", "--context", str(2**31))])
def test_bad_argument_exit_code_from_python_m(args: tuple[str, ...]) -> None:
    _one_line_error(_run(*args), args[1])


def test_demo_cuda_without_a_gpu_is_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    _one_line_error(_run("demo", "--device", "cuda", "--steps", "2"), "--device cuda", "CUDA")
    from attnpool.tools import cli

    assert cli.main(["bench", "--quick", "--device", "cuda:0"]) == 2


def test_bench_unwritable_output_fails_before_the_run(tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # paths no user (root included) can write: a missing folder, a folder, a file's child
    (tmp_path / "file").write_text("")
    from attnpool.tools import bench, cli

    def no_run(*args: object, **kwargs: object) -> int:
        raise AssertionError("the benchmark ran before its output path was checked")

    for path in (tmp_path / "missing" / "r.json", tmp_path, tmp_path / "file" / "r.json"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bench, "run_cli", no_run)
            code = cli.main(["bench", "--quick", "--device", "cpu", "--json", str(path)])
        out = capsys.readouterr()
        _one_line_error(subprocess.CompletedProcess([], code, out.out, out.err), "--json",
                        str(path), "cannot write")
        assert "cannot write" in out.err
    out = _run("bench", "--quick", "--json", str(tmp_path / "missing" / "r.json"), timeout=60)
    _one_line_error(out, "--json", "cannot write")  # and from a shell, before any timing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing left behind


def test_writable_check_leaves_no_file(tmp_path: pathlib.Path) -> None:
    from attnpool.tools import cli

    target = tmp_path / "r.json"
    cli._writable("--json", str(target))
    assert not target.exists()
    target.write_text("old")
    cli._writable("--json", str(target))
    assert target.read_text() == "old"


def test_help_is_fast_to_start_and_lists_every_command() -> None:
    # --help must not import torch (what made it take seconds): checked, not timed
    code = ("import sys\nfrom attnpool.tools import cli\ntry:\n    cli.main(['--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "False"
    for cmd in ("plan", "demo", "bench"):
        assert re.search(rf"^\s+{cmd}\s+\S", out.stdout, re.M), (cmd, out.stdout)


def test_plan_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from attnpool.tools import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["plan", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for want in ("(default: 160)", "(default: 131072)", "(default: flash_attn)", "2**31 - 1"):
        assert want in text, want


def test_import_attnpool_is_lazy_and_complete() -> None:
    code = ("import sys, attnpool\nassert 'torch' not in sys.modules\n"
            "from attnpool import *\nimport attnpool.adapters.sdpa as s\n"
            "missing = [n for n in attnpool.__all__ if not hasattr(attnpool, n)]\n"
            "assert not missing, missing\nassert attnpool.adapters.sdpa is s\n"
            "assert attnpool.BufferPool.__module__ == 'attnpool.pool'\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_demo_runs_on_cpu(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ATTNPOOL_CACHE", str(tmp_path))  # no checkpoint: the tiny random model
    out = _run("demo", "--device", "cpu", "--steps", "6", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "steps/s" in out.stdout
    # the kernel that really ran, by its name: never a library this machine may not have
    assert "attention: PyTorch SDPA (attnpool.adapters.sdpa) reading the pool's " in out.stdout


def test_readme_quickstart_runs() -> None:
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", text, re.S)
    assert code is not None
    assert len(code.group(1).strip().splitlines()) <= 12
    out = subprocess.run([sys.executable, "-c", code.group(1)], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "[37, 5, 900, 1]" in out.stdout


def test_readme_names_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "python -m attnpool demo" in text and "python -m pytest" in text


def test_demo_kernel_name_follows_the_resolved_backend() -> None:
    from attnpool import Layout
    from attnpool.adapters.backends import Backend
    from attnpool.tools.demo_hf import kernel_name

    assert kernel_name(Backend.SDPA, Layout.FLASH_ATTN) == (
        "PyTorch SDPA (attnpool.adapters.sdpa) reading the pool's FLASH_ATTN layout")
    assert kernel_name(Backend.FA3, Layout.FLASH_ATTN).startswith("flash-attn 3")
    assert "SDPA" in kernel_name(Backend.FA2, Layout.FLASH_ATTN)  # its prefill parts


def test_readme_and_docs_point_only_inside_the_repository() -> None:
    """Every file the README and docs/design.md name (links, `path.py`, `dir/`) exists here, and
    no text cites a design document the repository lacks."""
    for doc in ("README.md", "docs/design.md", "BENCHMARKS.md"):
        text = (ROOT / doc).read_text()
        base = (ROOT / doc).parent
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        paths = re.findall(r"`((?:[\w.-]+/)*[\w.-]+\.(?:md|py|toml|in)|[\w.-]+/(?:[\w.-]+/)*)`", text)
        for ref in [x for x in links if "://" not in x] + paths:
            assert (base / ref).exists() or (ROOT / ref).exists(), f"{doc} names {ref}"
        assert not re.search(r"D[E]SIGN|\xa7", text), doc  # no outside design document
    # the design doc's sections that code comments cite ("docs/design.md, Padding")
    heads = set(re.findall(r"^#{2,3} (.+)$", (ROOT / "docs" / "design.md").read_text(), re.M))
    cited: set[str] = set()
    for path in [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
                 ROOT / "BENCHMARKS.md"]:
        for m in re.finditer(r"docs/design\.md(?:'s)?, ([A-Z][\w ]*?)(?: and ([A-Z][\w ]*?))?[).:\]]",
                             path.read_text()):
            cited.update(g for g in m.groups() if g)
    assert cited and cited <= heads, cited - heads
    slugs = {re.sub(r"[^\w -]", "", h.lower()).replace(" ", "-") for h in heads}
    linking = (ROOT / "docs" / "design.md").read_text() + (ROOT / "BENCHMARKS.md").read_text()
    anchors = set(re.findall(r"\]\((?:docs/design\.md)?#([\w-]+)\)", linking))
    assert anchors and anchors <= slugs, anchors - slugs

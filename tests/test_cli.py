"""The command line and the README, run as a user would."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


def test_plan_bad_config_is_a_clean_error() -> None:
    out = _run("plan", "--page-size", "3")
    assert out.returncode == 2
    assert "power of two" in out.stderr and "Traceback" not in out.stderr


def test_demo_runs_on_cpu() -> None:
    out = _run("demo", "--device", "cpu", "--steps", "6", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "steps/s" in out.stdout


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

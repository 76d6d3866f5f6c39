"""Metadata update per step: the classic per-op replay vs attnpool's update paths.

Cases come from :data:`attnpool.tools.bench.FULL` (bs 1/8/64/160/256 with 1/8 of each batch padded,
mixed context lengths up to 32K, page sizes 1 and 16, decode and chain verify); paths from
:data:`attnpool.tools.bench.UPDATE_IMPLS`. Each benchmark also records the update's aten op counts
(launches, host syncs, temporaries; see ``dispatch_count.py``) in ``extra_info``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from attnpool.tools import bench

from dispatch_count import count

CASES = bench.update_cases(bench.FULL)


@pytest.fixture(scope="module")
def inputs() -> dict[bench.UpdateCase, bench.UpdateInputs]:
    return {}


@pytest.mark.parametrize("impl", bench.UPDATE_IMPLS, ids=lambda i: i.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_update(record: Callable[..., None], timed: Callable[..., None], device: torch.device,
                case: bench.UpdateCase, impl: bench.UpdateImpl,
                inputs: dict[bench.UpdateCase, bench.UpdateInputs]) -> None:
    why = impl.skip(case, device)
    if why is not None:
        pytest.skip(why)
    if case not in inputs:
        inputs.clear()  # one case's inputs at a time: tables are up to 64 MiB
        inputs[case] = bench.make_inputs(case, device)
    x = inputs[case]
    fn = impl.prepare(case, x, device)
    fn()
    ops = count(fn, device, host=[x.seq_lens_cpu])
    record("update", case.name, impl.name, case.config(device), baseline=impl.baseline,
           bs=case.bs, n=case.n, triton_launches=ops.triton,
           launches=ops.launch, host_syncs=ops.sync, temporaries=ops.alloc)
    timed(fn)

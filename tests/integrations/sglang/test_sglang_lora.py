"""SGLang's LoRA backend ``attnpool``: the ``torch_native`` LoRA math over one attnpool arena.

Engine checks (SGLang's CPU engine, float32, greedy; a tiny random Llama, two random adapters on
``q_proj`` / ``v_proj``, r=8 alpha=16 and r=4 alpha=8; 3 prompts x {base, adapter a, adapter b}
in one ``generate``, 16 new tokens): ``lora_backend="attnpool"`` and ``"torch_native"``, each
backend's engines in one fresh process, the two side by side; the reference is transformers
with each adapter merged into the weights (``W += alpha / r * B @ A``). SGLang's CPU engine
pins host memory for LoRA, which torch refuses without CUDA: the engines run with the test
stand-in ``ATTNPOOL_SGLANG_NO_PIN=1`` (``tests/helpers/sglang_cpu/no_pin.py``). The CI sample
runs ``max_loras_per_batch`` 2 with the radix cache and 3 without;
``ATTNPOOL_SGLANG_LORA_FULL=1`` runs all four pairs. The arena's counters
(``ATTNPOOL_SGLANG_LORA_REPORT``) show it served the batches.

Unit checks (no engine, in this process, with the same stand-in in ``torch_native``'s
module): the refilled batch info equals ``torch_native``'s and gives the same LoRA outputs
(eager and graph batches); every tensor is a view of the one arena and a refill of sizes seen
before runs no torch op; bad input raises
:class:`attnpool.PoolError` with the arena's bytes unchanged.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch

from attnpool import PoolError

from tests.helpers import sglang_lora as sl
from tests.helpers import vllm_lora as vl
from tests.helpers.opcount import OpRecorder
from tests.helpers.sglang_cpu import no_pin
from tests.helpers.tiny_models import save_tiny

NEW = 16
LENGTHS = (5, 9, 12)
ADAPTERS = vl.ROW_ADAPTERS
FULL = os.environ.get("ATTNPOOL_SGLANG_LORA_FULL") == "1"
SETTINGS = [{"max_loras_per_batch": m, "radix": r}
            for m, r in ([(2, True), (2, False), (3, True), (3, False)] if FULL
                         else [(2, True), (3, False)])]


# ---- engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sglang_lora")
    model = save_tiny("llama", root)
    adapters = vl.save_adapters(model, root)
    rows = vl.rows(LENGTHS, seed=3)
    procs = {b: sl.generate_apart(model, adapters, rows, NEW, b, SETTINGS)
             for b in ("attnpool", "torch_native")}
    ref = vl.reference(model, adapters, rows, NEW)  # while the engines run
    k = len(LENGTHS)
    for i in range(1, len(ADAPTERS)):  # every adapter changes every row's tokens
        for j in range(k):
            assert ref[i * k + j] != ref[j]
    runs = {b: sl.result(p) for b, p in procs.items()}
    return {"ref": ref, "runs": runs}


@pytest.mark.parametrize("setting", [f"{s['max_loras_per_batch']}/"
                                     f"{'radix' if s['radix'] else 'noradix'}"
                                     for s in SETTINGS])
def test_rows_equal_torch_native_and_reference(setup: dict[str, Any], setting: str) -> None:
    ours = setup["runs"]["attnpool"][setting]
    native = setup["runs"]["torch_native"][setting]
    assert ours["tokens"] == setup["ref"]
    assert native["tokens"] == setup["ref"]
    eager, graph, nbytes = ours["served"]
    # one refill per forward: at least a prefill and NEW - 1 decode steps
    assert eager >= NEW and graph == 0
    assert nbytes > 0
    assert "served" not in native


# ---- backend, no engine ------------------------------------------------------------------------
SLOTS, RANK = 3, 8


@pytest.fixture(scope="module")
def _unpinned() -> None:
    """torch_native pins host tensors, which a machine without CUDA refuses: its module's
    ``torch`` drops ``pin_memory`` (the test stand-in; only that module, so the reference's
    transformers is untouched)."""
    from sglang.srt.lora.backend import torch_backend

    no_pin.unpin_module(torch_backend)


def _args(**kw: Any) -> Any:
    base = {"max_lora_rank": RANK, "max_running_requests": 8, "chunked_prefill_size": 64,
            "max_prefill_tokens": 64, "context_length": None}
    return types.SimpleNamespace(**(base | kw))


@pytest.fixture
def pair(_unpinned: None) -> tuple[Any, Any]:
    return _pair()


def _pair() -> tuple[Any, Any]:
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend

    from attnpool.integrations.sglang.lora import AttnpoolLoRABackend

    dev = torch.device("cpu")
    return (AttnpoolLoRABackend(SLOTS, dev, server_args=_args()),
            TorchNativeLoRABackend(SLOTS, dev, server_args=_args()))


def _batch(lens: list[int] | None, decode_bs: int = 0) -> Any:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if lens is None:
        return types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=decode_bs)
    return types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(lens),
                                 extend_seq_lens_cpu=list(lens),
                                 extend_seq_lens=torch.tensor(lens, dtype=torch.int32))


RANKS, SCALINGS = [0, 8, 4], [0.0, 2.0, 0.5]
#: (extend lengths or None for decode, decode batch size, weight index per request)
BATCHES: list[tuple[list[int] | None, int, list[int]]] = [
    ([5, 9, 12, 3], 0, [1, 1, 0, 2]),
    (None, 6, [0, 2, 2, 1, 1, 0]),
    ([1, 1, 30, 1], 0, [2, 0, 0, 0]),
    ([40], 0, [1]),
    (None, 8, [1] * 8),
]


def _outputs(backend: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    h = backend.run_lora_a_sgemm(x, a)
    return backend.run_lora_b_sgemm(h, b, torch.tensor([0, b.shape[1]], dtype=torch.int32))  # type: ignore[no-any-return]


def test_eager_batches_equal_torch_native(pair: tuple[Any, Any]) -> None:
    ours, native = pair
    g = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, RANK, 16, generator=g)
    b = torch.randn(SLOTS, 12, RANK, generator=g)
    for lens, dbs, w in BATCHES:
        fb = _batch(lens, dbs)
        for be in (ours, native):
            be.prepare_lora_batch(fb, w, RANKS, SCALINGS, use_cuda_graph=False)
        oi, ni = ours.batch_info, native.batch_info
        assert (oi.bs, oi.num_segments, oi.use_cuda_graph) == (ni.bs, ni.num_segments, False)
        n = ni.num_segments
        for name in ("seg_lens_cpu", "weight_indices_cpu", "seg_indptr_cpu"):
            m = n + 1 if name == "seg_indptr_cpu" else n
            assert getattr(oi, name)[:m].tolist() == getattr(ni, name).tolist(), name
        for name in ("lora_ranks_cpu", "scalings_cpu", "lora_ranks", "scalings"):
            assert getattr(oi, name).tolist() == getattr(ni, name).tolist(), name
        assert int(oi.max_len) == int(ni.max_len)
        tokens = sum(lens) if lens is not None else dbs
        x = torch.randn(tokens, 16, generator=g)
        assert torch.equal(_outputs(ours, x, a, b), _outputs(native, x, a, b))


def test_graph_batches_equal_torch_native(pair: tuple[Any, Any]) -> None:
    ours, native = pair
    for be in (ours, native):
        be.init_decode_cuda_graph_batch_info(8, 1)
    info = ours.cuda_graph_batch_info
    g = torch.Generator().manual_seed(1)
    a = torch.randn(SLOTS, RANK, 16, generator=g)
    b = torch.randn(SLOTS, 12, RANK, generator=g)
    ptrs = {k: getattr(info, k).data_ptr() for k in ("weight_indices", "scalings", "seg_lens")}
    for _, dbs, w in [bt for bt in BATCHES if bt[0] is None]:
        fb = _batch(None, dbs)
        for be in (ours, native):
            be.prepare_lora_batch(fb, w, RANKS, SCALINGS, use_cuda_graph=True)
        assert ours.batch_info is info  # one persistent info: the captured graph reads it
        assert {k: getattr(info, k).data_ptr() for k in ptrs} == ptrs
        assert info.weight_indices[:dbs].tolist() == native.batch_info.weight_indices[:dbs].tolist()
        x = torch.randn(dbs, 16, generator=g)
        assert torch.equal(_outputs(ours, x, a, b), _outputs(native, x, a, b))


def test_views_of_one_arena_refilled_without_torch_ops(pair: tuple[Any, Any]) -> None:
    ours, _ = pair
    ours.init_decode_cuda_graph_batch_info(8, 1)
    ours.prepare_lora_batch(_batch(*BATCHES[0][:2]), BATCHES[0][2], RANKS, SCALINGS, False)
    storage = ours.pool.storage
    base, ptr = storage.untyped_storage().data_ptr(), storage.data_ptr()
    for i, (lens, dbs, w) in enumerate(BATCHES * 2):
        for graph in ((False, True) if lens is None else (False,)):
            fb = _batch(lens, dbs)
            with OpRecorder() as rec:
                ours.prepare_lora_batch(fb, w, RANKS, SCALINGS, graph)
            # a batch of a size not seen before makes its views once (slices, no storage);
            # after that a refill runs no torch op at all: numpy writes the arena
            assert set(rec.ops) <= {"aten.slice.Tensor"}, rec.ops
            if i >= len(BATCHES):
                assert rec.ops == [], rec.ops
            info = ours.batch_info
            for name in ("seg_lens", "seg_indptr", "weight_indices", "lora_ranks", "scalings",
                         "seg_lens_cpu", "seg_indptr_cpu", "weight_indices_cpu",
                         "lora_ranks_cpu", "scalings_cpu"):
                assert getattr(info, name).untyped_storage().data_ptr() == base, name
    assert ours.pool.storage.data_ptr() == ptr


@pytest.mark.parametrize("case", ["slot", "rank", "segments", "tokens", "graph_rows",
                                  "lengths"])
def test_bad_input_before_any_write(pair: tuple[Any, Any], case: str) -> None:
    ours, _ = pair
    ours.init_decode_cuda_graph_batch_info(4, 1)
    ours.prepare_lora_batch(_batch(*BATCHES[0][:2]), BATCHES[0][2], RANKS, SCALINGS, False)
    before = ours.pool.storage.view(torch.uint8).clone()
    ranks, graph = RANKS, False
    if case == "slot":  # an adapter index past the pool's slots
        fb, w = _batch([3, 4]), [1, SLOTS]
    elif case == "rank":  # a rank above max_lora_rank
        fb, w, ranks = _batch([3, 4]), [1, 2], [0, RANK + 1, 4]
    elif case == "segments":  # more segments than the arena holds (8 requests, 4 graph rows)
        fb, w = _batch([1] * 9), [1, 2] * 4 + [1]
    elif case == "tokens":  # more tokens than the prefill budget (64 + 8 requests)
        fb, w = _batch([40, 40]), [1, 2]
    elif case == "graph_rows":  # a graph batch larger than the captured one
        fb, w, graph = _batch(None, 5), [1] * 5, True
    else:
        fb, w = _batch([3, 4]), [1]
    with pytest.raises(PoolError) as e:
        ours.prepare_lora_batch(fb, w, ranks, SCALINGS, graph)
    assert any(ch.isdigit() for ch in str(e.value))  # names the bound and the value
    assert torch.equal(ours.pool.storage.view(torch.uint8), before)


def test_needs_a_rank_bound() -> None:
    from attnpool.integrations.sglang.lora import AttnpoolLoRABackend

    with pytest.raises(PoolError, match="max_lora_rank"):
        AttnpoolLoRABackend(SLOTS, torch.device("cpu"), server_args=_args(max_lora_rank=None))


def test_registered_by_the_plugin() -> None:
    from sglang.srt.lora.backend.lora_registry import get_backend_from_name

    from attnpool.integrations.sglang import register
    from attnpool.integrations.sglang.lora import AttnpoolLoRABackend

    register()
    assert get_backend_from_name("attnpool") is AttnpoolLoRABackend
    assert Path(no_pin.__file__).parent.name == "sglang_cpu"

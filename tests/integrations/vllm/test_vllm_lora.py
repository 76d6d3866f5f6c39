"""LoRA in vLLM with attnpool's punica wrapper (CPU, float32, greedy).

Under ``ATTNPOOL_VLLM=1`` the plugin points ``current_platform.get_punica_wrapper()`` at
:class:`attnpool.integrations.vllm.lora.AttnpoolPunicaWrapperCPU`: vLLM's CPU wrapper whose
index tensors are views of one :class:`attnpool.lora.LoRABatchPool` arena, refilled in place
from the host mapping, and whose rows without an adapter get no LoRA delta.

Engine checks (a tiny random Llama, two random adapters on ``q_proj`` / ``v_proj``, r=8
alpha=16 and r=4 alpha=8; 3 prompts x {base, adapter a, adapter b} in one batch, 16 greedy
tokens; each engine in a fresh process): the reference is transformers with each adapter merged
into the weights (``W += alpha / r * B @ A``).

- ``max_loras=2``, every slot full: attnpool's 9 rows equal the reference, and vLLM's own base
  rows do not (its torch ops read slot ``-1`` as the last slot): the negative control.
- ``max_loras=3``: attnpool, vLLM and the reference agree on all 9 rows.
- ``max_loras=3`` under scheduling pressure (prompts of 20-30 tokens): chunked prefill with a
  token budget (8) below every prompt, and a KV cache of 6 blocks of 32 tokens for 9 requests of
  two blocks each, which forces preemption (counted): attnpool, vLLM and the reference agree.

Unit checks (no engine): the refill writes what vLLM's own ``update_metadata`` writes, with no
torch op but a view after the first refill (no allocation, no copy through torch) and a stable
arena; bad input raises :class:`attnpool.PoolError` with the arena's bytes unchanged; base rows
get no delta with every slot full where vLLM's wrapper gives them the last slot's.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.lora.layers import LoRAMapping
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from attnpool import PoolError
from attnpool.integrations import vllm as ap_vllm
from attnpool.integrations.vllm.lora import AttnpoolPunicaWrapperCPU, PunicaArena

from tests.helpers import vllm_lora as vl
from tests.helpers.opcount import OpRecorder
from tests.helpers.tiny_models import save_tiny

NEW = 16
LENGTHS = (5, 9, 12)
ADAPTERS = vl.ROW_ADAPTERS


# ---- engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("vllm_lora")
    model = save_tiny("llama", root)
    adapters = vl.save_adapters(model, root)
    rows = vl.rows(LENGTHS, seed=3)
    ref = vl.reference(model, adapters, rows, NEW)
    # the adapters change every row's tokens: a row served with the wrong adapter shows
    k = len(LENGTHS)
    for i in range(1, len(ADAPTERS)):
        for j in range(k):
            assert ref[i * k + j] != ref[j]
    return {"model": model, "adapters": adapters, "rows": rows, "ref": ref, "k": k}


@pytest.fixture(scope="module")
def runs(setup: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: vl.generate_apart(setup["model"], setup["adapters"], setup["rows"], NEW,
                                    [2, 3], attnpool=name == "attnpool")
            for name in ("attnpool", "native")}


def test_wrapper_is_attnpools(runs: dict[str, dict[str, Any]]) -> None:
    for max_loras in ("2", "3"):
        ours, native = runs["attnpool"][max_loras], runs["native"][max_loras]
        assert [w["cls"] for w in ours["wrappers"]] == ["AttnpoolPunicaWrapperCPU"]
        assert all(w["views"] and w["ptr_stable"] for w in ours["wrappers"])
        assert ours["refills"] >= 1
        assert [w["cls"] for w in native["wrappers"]] == ["PunicaWrapperCPU"]


def test_every_slot_full(setup: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    """max_loras=2 with 2 adapters and base rows: attnpool is right where vLLM is not."""
    ref, k = setup["ref"], setup["k"]
    ours, native = runs["attnpool"]["2"]["tokens"], runs["native"]["2"]["tokens"]
    assert ours == ref
    # negative control: vLLM's own base rows are served with the last slot's adapter ...
    assert all(native[j] != ref[j] for j in range(k))
    # ... while its adapter rows are right
    assert native[k:] == ref[k:]


def test_spare_slot(setup: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    """max_loras=3: attnpool, vLLM and the merged reference agree."""
    ours, native = runs["attnpool"]["3"]["tokens"], runs["native"]["3"]["tokens"]
    assert ours == native == setup["ref"]


#: vLLM's scheduling under pressure, with longer prompts (each row then spans two KV blocks of
#: 32 tokens, vLLM's CPU block size): ``chunked``: a step's token budget (8) below every
#: prompt, so prompts are split across steps; ``preempt``: 6 blocks for 9 requests of 2 blocks
#: each, so the scheduler preempts running requests and recomputes them
SCHED_LENGTHS = (20, 25, 30)
SCHEDULING: dict[str, dict[str, Any]] = {
    "chunked": {"max_loras": 3, "max_num_seqs": 8, "max_num_batched_tokens": 8,
                "enable_chunked_prefill": True},
    "preempt": {"max_loras": 3, "max_model_len": 64, "num_gpu_blocks_override": 6},
}


@pytest.fixture(scope="module")
def sched_runs(setup: dict[str, Any]) -> dict[str, Any]:
    rows = vl.rows(SCHED_LENGTHS, seed=5)
    got: dict[str, Any] = {
        name: vl.generate_apart(setup["model"], setup["adapters"], rows, NEW, [],
                                attnpool=name == "attnpool", settings=SCHEDULING)
        for name in ("attnpool", "native")}
    got["ref"] = vl.reference(setup["model"], setup["adapters"], rows, NEW)
    return got


@pytest.mark.parametrize("setting", list(SCHEDULING))
def test_chunked_prefill_and_preemption(setup: dict[str, Any],
                                        sched_runs: dict[str, dict[str, Any]],
                                        setting: str) -> None:
    """Prompts split across steps, or requests preempted and recomputed: attnpool, vLLM and the
    reference still agree (max_loras=3)."""
    ours, native = sched_runs["attnpool"][setting], sched_runs["native"][setting]
    assert ours["tokens"] == native["tokens"] == sched_runs["ref"]
    assert [w["cls"] for w in ours["wrappers"]] == ["AttnpoolPunicaWrapperCPU"]
    assert all(w["views"] and w["ptr_stable"] for w in ours["wrappers"])
    assert ours["refills"] >= 1
    if setting == "chunked":  # a prompt longer than the step's token budget is split
        assert SCHEDULING[setting]["max_num_batched_tokens"] < min(SCHED_LENGTHS)
    else:
        assert ours["preemptions"] > 0 and native["preemptions"] > 0


# ---- wrapper, no engine ------------------------------------------------------------------------
T, B, SLOTS, RANK, VOCAB = 64, 8, 2, 8, 100


def _cfg(slots: int = SLOTS) -> Any:
    return types.SimpleNamespace(max_loras=slots, max_lora_rank=RANK)


def _pair(slots: int = SLOTS) -> tuple[Any, Any]:
    return (AttnpoolPunicaWrapperCPU(T, B, "cpu", lora_config=_cfg(slots)),
            PunicaWrapperCPU(T, B, "cpu", lora_config=_cfg(slots)))


def _mapping(tokens: list[int], prompt: list[int], prefill: bool = True) -> LoRAMapping:
    return LoRAMapping(index_mapping=tuple(tokens), prompt_mapping=tuple(prompt),
                       is_prefill=prefill)


#: (per-token LoRA ids, per-sampled-row LoRA ids, is_prefill); ids 7 and 9 are resident
MAPPINGS = [
    ([0, 0, 7, 7, 7, 9, 0, 9], [0, 7, 9, 0, 9], True),
    ([9, 9, 9], [9], True),
    ([0, 0, 0, 0], [0, 0], True),
    ([7, 0, 9, 7], [7, 0, 9, 7], False),
    ([7] * 40 + [0] * 20 + [9] * 4, [7, 0, 9], True),
]


def _update(w: Any, m: LoRAMapping, ids: list[int | None] | None = None) -> None:
    w.update_metadata(m, [7, 9] if ids is None else ids, SLOTS + 1, VOCAB)


def test_refill_matches_vllm() -> None:
    ours, native = _pair()
    for tokens, prompt, prefill in MAPPINGS:
        m = _mapping(tokens, prompt, prefill)
        _update(ours, m)
        _update(native, m)
        for name in ("token_lora_indices", "sampler_indices", "sampler_indices_padded"):
            assert getattr(ours, name).tolist() == getattr(native, name).tolist(), name
        n = len(tokens)
        assert ours._embeddings_indices[:n].tolist() == native._embeddings_indices[:n].tolist()
        assert ours.indices_len == native.indices_len
        assert ours.is_prefill == native.is_prefill == prefill
        if prefill:
            a, b = ours.prefill_metadata, native.prefill_metadata
            assert [t.tolist() for t in a[:3]] == [t.tolist() for t in b[:3]]
            assert a[3:] == b[3:]
            assert ours.no_lora == native.no_lora
        assert ours._token_no_lora[:n].tolist() == [t == 0 for t in tokens]
        assert ours._sampler_no_lora[: len(prompt)].tolist() == [t == 0 for t in prompt]


def test_refill_in_place() -> None:
    """After the first refill, update_metadata runs no torch op but one view (so allocates and
    copies nothing through torch: numpy writes the arena), and every metadata tensor stays a
    view of the one arena."""
    ours, _ = _pair()
    arena: PunicaArena = ours.arena
    storage = arena.pool.storage
    ptr = storage.data_ptr()
    names = [n for n in arena.tensors]
    ptrs = {n: getattr(ours, "_" + n).data_ptr() for n in names}
    _update(ours, _mapping(*MAPPINGS[0][:2]))
    for tokens, prompt, prefill in MAPPINGS * 2:
        m = _mapping(tokens, prompt, prefill)
        with OpRecorder() as rec:
            _update(ours, m)
        # the one op is a view: vLLM's ``token_lora_indices`` property, which its
        # ``update_metadata`` hands to ``_update_prefill_metadata`` (a no-op here)
        assert set(rec.ops) <= {"aten.slice.Tensor"}, rec.ops
        assert rec.storages <= {storage.untyped_storage().data_ptr()}
    assert storage.data_ptr() == ptr
    for n in names:
        t = getattr(ours, "_" + n)
        assert t.data_ptr() == ptrs[n]
        assert t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()


@pytest.mark.parametrize("case", ["tokens", "rows", "runs", "unknown_id", "slots",
                                  "max_loras", "not_ints"])
def test_bad_input_before_any_write(case: str) -> None:
    ours, _ = _pair()
    _update(ours, _mapping(*MAPPINGS[0][:2]))
    before = ours.arena.pool.storage.clone()
    scalars = (list(ours.indices_len), ours.batch_size, ours.max_length, ours.token_nums,
               ours.no_lora)
    ids: list[int | None] = [7, 9]
    max_loras = SLOTS + 1
    if case == "tokens":  # a batch larger than the pool
        m = _mapping([7] * (T + 1), [7])
    elif case == "rows":
        m = _mapping([7], [7] * (T + 1))
    elif case == "runs":  # more runs of one adapter than max_batches
        m = _mapping([7, 9] * B + [7], [7])
    elif case == "unknown_id":  # an adapter no slot holds
        m = _mapping([7, 5], [7])
    elif case == "slots":  # an adapter index past the pool's slots
        m = _mapping([7, 8], [7])
        ids = [7, 9, 8]
    elif case == "max_loras":
        m = _mapping([7], [7])
        max_loras = SLOTS + 2
    else:
        m = _mapping([7], [7])
        m.index_mapping = ("x",)  # type: ignore[assignment]
    with pytest.raises(PoolError):
        ours.update_metadata(m, ids, max_loras, VOCAB)
    assert torch.equal(ours.arena.pool.storage, before)
    assert (list(ours.indices_len), ours.batch_size, ours.max_length, ours.token_nums,
            ours.no_lora) == scalars


@pytest.mark.parametrize("prefill", [True, False])
def test_base_rows_get_no_delta(prefill: bool) -> None:
    """Every slot full: vLLM's CPU wrapper adds the last slot's delta to base rows, attnpool's
    adds none; adapter rows are the same."""
    torch.manual_seed(0)
    n_in, n_out = 16, 12
    lora_a = torch.randn(SLOTS, 1, RANK, n_in)
    lora_b = torch.randn(SLOTS, 1, n_out, RANK)
    tokens = [0, 7, 7, 9, 0, 0, 9, 7]
    x = torch.randn(len(tokens), n_in)
    ys = []
    for w in _pair():
        _update(w, _mapping(tokens, [0, 7, 9], prefill))
        y = torch.zeros(len(tokens), n_out)
        w.add_lora_linear(y, x, (lora_a,), (lora_b,), 1.0, (n_out,))
        ys.append(y)
    ours, native = ys
    base = torch.tensor([t == 0 for t in tokens])
    assert torch.equal(ours[base], torch.zeros_like(ours[base]))
    assert not torch.allclose(native[base], torch.zeros_like(native[base]))
    torch.testing.assert_close(ours[~base], native[~base])


def test_plugin_redirects_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"
    answer = {"v": cpu}
    platform = types.SimpleNamespace(get_punica_wrapper=lambda: answer["v"])
    ap_vllm.redirect_punica(platform)
    ap_vllm.redirect_punica(platform)  # once per process, however often the plugin runs
    monkeypatch.setenv(ap_vllm.SWITCH, "1")
    assert platform.get_punica_wrapper() == ap_vllm.PUNICA_WRAPPERS[cpu]
    answer["v"] = "some.other.Wrapper"
    assert platform.get_punica_wrapper() == "some.other.Wrapper"
    answer["v"] = cpu
    monkeypatch.setenv(ap_vllm.SWITCH, "0")
    assert platform.get_punica_wrapper() == cpu
    from vllm.utils.import_utils import resolve_obj_by_qualname

    for native, ours in ap_vllm.PUNICA_WRAPPERS.items():
        try:
            base = resolve_obj_by_qualname(native)
        except ImportError:  # pragma: no cover - a build without the GPU ops
            continue
        assert issubclass(resolve_obj_by_qualname(ours), base)



def test_pool_extra_buffers() -> None:
    """``LoRAConfig.extra_buffers``: the same layout without them; with them, named views at the
    tail of the one storage, typed alike over a host image, poisoned with the rest, and refused
    when malformed."""
    from attnpool.lora import LoRABatchPool, LoRAConfig

    kw: dict[str, Any] = {"max_bs": 4, "max_loras_per_batch": 2, "max_lora_rank": 8,
                          "device": "cpu"}
    plain = LoRABatchPool(LoRAConfig(**kw))
    assert plain.extras == {} and plain.extras_nbytes == 0
    assert plain.nbytes == plain.meta_nbytes
    extras = (("i", torch.int64, 5), ("m", torch.bool, 3))
    pool = LoRABatchPool(LoRAConfig(**kw, extra_buffers=extras))
    assert pool.meta_nbytes == plain.meta_nbytes
    assert pool.nbytes == plain.nbytes + pool.extras_nbytes
    assert [(t.dtype, t.shape[0]) for t in pool.extras.values()] == [(torch.int64, 5),
                                                                     (torch.bool, 3)]
    for t in pool.extras.values():
        assert t.untyped_storage().data_ptr() == pool.storage.untyped_storage().data_ptr()
    img = pool.typed_extras(torch.zeros(pool.extras_nbytes, dtype=torch.uint8))
    assert [t.shape for t in img.values()] == [t.shape for t in pool.extras.values()]
    with pytest.raises(PoolError):
        pool.typed_extras(torch.zeros(pool.extras_nbytes + 1, dtype=torch.uint8))
    pool.poison_()
    assert bool((pool.extras["i"] == torch.iinfo(torch.int64).max).all())
    assert bool(pool.extras["m"].all())
    for bad in ((("seg_lens", torch.int64, 2),), (("i", torch.int64, 2), ("i", torch.bool, 2)),
                (("i", "int64", 2),), (("i", torch.int64, 0),), [("i", torch.int64, 2)]):
        with pytest.raises(PoolError):
            LoRAConfig(**kw, extra_buffers=bad)  # type: ignore[arg-type]

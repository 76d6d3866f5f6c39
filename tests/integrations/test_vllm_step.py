"""attnpool's vLLM backend without vLLM: the plugin switch, the cache views and store, and the
per-step refill of a group's pool from a vLLM-shaped batch (mixed prefill and decode rows),
checked against dense attention. (tests/integrations/vllm/ runs vLLM itself, in its own
environment.)"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from attnpool import CapacityError, DecodeView, ExtendView, LayoutError
from attnpool.adapters.backends import Backend
from attnpool.config import Impl
from attnpool.integrations.vllm import SWITCH, enabled
from attnpool.integrations.vllm.cache import cpu_views, slot_index_, store_
from attnpool.integrations.vllm.step import EngineSizes, StepFiller, group_window

from tests.helpers.dense import dense_attention
from tests.helpers.opcount import count

H, H_KV, D, P = 4, 2, 32, 16


def test_plugin_does_nothing_unless_switched_on() -> None:
    """With the switch off, ``register`` returns before importing anything of vLLM (it runs
    in every vLLM process once attnpool is installed)."""
    code = ("import sys; from attnpool.integrations import vllm as v; v.register(); "
            "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != SWITCH}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    for value, on in (("1", True), ("0", False), ("", False), ("yes", False)):
        os.environ[SWITCH] = value
        try:
            assert enabled() is on
        finally:
            os.environ.pop(SWITCH)


def _kv(blocks: int) -> torch.Tensor:
    """A vLLM CPU cache tensor ``[blocks, H_kv, P, 2D]``: NaN in every block's unwritten
    lanes (what a block freed by another request may hold, as far as a row past its length is
    concerned), block 0 zero (vLLM allocates its caches zeroed, and only padded tokens' finite
    K/V are stored there)."""
    kv = torch.full((blocks, H_KV, P, 2 * D), float("nan"), dtype=torch.float64)
    kv[0] = 0
    return kv


def test_store_and_views_round_trip_padding_to_the_null_block() -> None:
    kv = _kv(6)
    k, v = cpu_views(kv)
    assert k.shape == v.shape == (6, P, H_KV, D) and k.data_ptr() == kv.data_ptr()
    slots = torch.tensor([17, 3, -1, 95, 40], dtype=torch.int32)
    key, val = torch.randn(5, H_KV, D, dtype=torch.float64), torch.randn(5, H_KV, D,
                                                                          dtype=torch.float64)
    blocks, offsets = torch.empty(8, dtype=torch.int64), torch.empty(8, dtype=torch.int64)
    slot_index_(slots, P, blocks, offsets)
    store_(k, v, key, val, blocks, offsets)
    for t, s in enumerate(slots.tolist()):
        b, o = divmod(max(s, 0), P)
        assert torch.equal(k[b, o], key[t]) and torch.equal(v[b, o], val[t])
    # the keys of one block and head are stored transposed (D x P), then the values (P x D)
    assert torch.equal(kv[1, 0].reshape(-1)[: P * D].view(D, P)[:, 1], key[0, 0])
    assert torch.equal(kv[1, 0].reshape(-1)[P * D:].view(P, D)[1], val[0, 0])


def _filler(impl: Impl = Impl.REFERENCE, window: int | None = None, poison: bool = False
            ) -> StepFiller:
    sizes = EngineSizes(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=128,
                        block_size=P, sliding_window=window, num_blocks=24,
                        device=torch.device("cpu"))
    f = StepFiller(sizes, Backend.SDPA, H, H_KV, torch.float64)
    if impl is not Impl.REFERENCE or poison:
        import dataclasses

        from attnpool import BufferPool
        f.pool = BufferPool(dataclasses.replace(f.pool.cfg, impl=impl), poison=poison)
        f._decode, f._extend = f.pool.decode, f.pool.extend
        f._decode_step = f._decode.host_step
        f._extend_offsets = f._extend.host_step_offsets if f._extend.host_route else None
    return f


def _batch() -> dict[str, object]:
    """A mixed step as vLLM's scheduler sends it: a decode row, a prefill chunk over a cached
    prefix, a fresh prompt and another decode row (in that order)."""
    q_lens, seq_lens = [1, 9, 13, 1], [40, 25, 13, 70]
    qsl = torch.tensor([0, *itertools_acc(q_lens)], dtype=torch.int32)
    table = torch.zeros(6, 8, dtype=torch.int32)  # rows past num_reqs: vLLM's padding
    next_block = 1  # block 0: vLLM's null block
    for r, n in enumerate(seq_lens):
        pages = math.ceil(n / P)
        table[r, :pages] = torch.arange(next_block, next_block + pages)
        next_block += pages
    slots = []
    for r, (q, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(n - q, n):
            slots.append(int(table[r, pos // P]) * P + pos % P)
    return {"num_reqs": 4, "num_actual_tokens": sum(q_lens), "max_query_len": max(q_lens),
            "query_start_loc": qsl, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "block_table": table, "slot_mapping": torch.tensor([*slots, -1, -1],
                                                               dtype=torch.int64),
            "q_lens": q_lens}


def itertools_acc(xs: list[int]) -> list[int]:
    out, s = [], 0
    for x in xs:
        s += x
        out.append(s)
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_mixed_step_matches_dense_attention(window: int | None) -> None:
    """One extend update serves decode rows and prefill chunks together: the view's lengths
    and pages are vLLM's, and attention over a cache stored through the same step's slots
    equals dense attention per query (causal, end-aligned; windowed for a sliding layer)."""
    b = _batch()
    q_lens = b.pop("q_lens")
    f = _filler(window=window)
    md = f.fill(**b)  # type: ignore[arg-type]
    assert isinstance(md.view, ExtendView)
    assert md.view.cache_seqlens[:4].tolist() == b["seq_lens"].tolist()  # type: ignore[attr-defined]
    assert md.view.cu_seqlens_q[:5].tolist() == b["query_start_loc"].tolist()  # type: ignore[attr-defined]
    torch.manual_seed(0)
    kv = _kv(24)
    k, v = cpu_views(kv)
    table, lens = b["block_table"], b["seq_lens"].tolist()  # type: ignore[attr-defined]
    # the cached prefixes (stored by earlier steps), then this step's tokens through md
    for r, n in enumerate(lens):
        for pos in range(n):
            blk = int(table[r, pos // P])  # type: ignore[index]
            k[blk, pos % P] = torch.randn(H_KV, D, dtype=torch.float64)
            v[blk, pos % P] = torch.randn(H_KV, D, dtype=torch.float64)
    t = md.num_actual_tokens
    new_k, new_v = torch.randn(t + 2, H_KV, D, dtype=torch.float64), \
        torch.randn(t + 2, H_KV, D, dtype=torch.float64)
    store_(k, v, new_k, new_v, md.blocks, md.offsets)
    q = torch.randn(t, H, D, dtype=torch.float64)
    out = md.run(q, k, v, D ** -0.5, window=window is not None)
    keys: list[list[int]] = []
    for r, (qn, n) in enumerate(zip(q_lens, lens, strict=True)):  # type: ignore[call-overload]
        for j in range(qn):
            pos = n - qn + j
            lo = 0 if window is None else max(0, pos - window + 1)
            keys.append([int(table[r, p // P]) * P + p % P for p in range(lo, pos + 1)])  # type: ignore[index]
    ref, _ = dense_attention(q, k, v, keys, D ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_uniform_decode_step_is_a_decode_update() -> None:
    f = _filler()
    qsl = torch.arange(4, dtype=torch.int32)
    table = torch.arange(1, 25, dtype=torch.int32).view(3, 8)
    md = f.fill(num_reqs=3, num_actual_tokens=3, max_query_len=1, query_start_loc=qsl,
                seq_lens=torch.tensor([5, 17, 33], dtype=torch.int32), block_table=table,
                slot_mapping=torch.tensor([4, 8 * P + 0, 16 * P + 32], dtype=torch.int64))
    assert type(md.view).__name__ == "DecodeView" and md.view.max_seqlen_k == 33


def test_refill_allocates_nothing_on_the_fused_path() -> None:
    """Once warm, a step's refill allocates no tensor: the query lengths and the store's
    block / offset pairs go to staging buffers (``out=``), the fused update writes the arena."""
    pytest.importorskip("triton")
    b = _batch()
    b.pop("q_lens")
    f = _filler(Impl.TRITON)
    f.fill(**b)  # type: ignore[arg-type]
    c = count(lambda: f.fill(**b))  # type: ignore[arg-type]
    assert not c.made, c.ops
    assert c.launches == 1


def test_device_refill_is_graph_safe() -> None:
    """What ``build_for_cudagraph_capture`` and each replay's ``build`` rely on, on the path a
    CUDA device takes (no host lengths): a uniform decode batch of one size refills the same
    decode view's tensors in place (the addresses a captured graph baked in), reads no device
    value on the host (no ``item`` / ``tolist``: ``_local_scalar_dense``) and allocates nothing
    once warm (fused path)."""
    pytest.importorskip("triton")
    f = _filler(Impl.TRITON)
    f.host = False  # the CUDA path: vLLM's lengths stay on the device, nothing read back
    table = torch.arange(1, 25, dtype=torch.int32).view(3, 8)

    qsl, slots = torch.arange(4, dtype=torch.int32), torch.tensor([3, 20, 40])

    def step(lens: torch.Tensor) -> object:
        return f.fill(num_reqs=3, num_actual_tokens=3, max_query_len=1, query_start_loc=qsl,
                      seq_lens=lens, block_table=table, slot_mapping=slots)

    captured = step(torch.tensor([5, 17, 33], dtype=torch.int32)).view  # type: ignore[attr-defined]
    ptrs = [t.data_ptr() for t in (captured.cache_seqlens, captured.page_table,
                                   captured.cu_seqlens_q)]
    lens = torch.tensor([9, 2, 40], dtype=torch.int32)
    c = count(lambda: step(lens))
    again = step(lens).view  # type: ignore[attr-defined]
    assert [t.data_ptr() for t in (again.cache_seqlens, again.page_table,
                                   again.cu_seqlens_q)] == ptrs
    assert again.cache_seqlens[:3].tolist() == [9, 2, 40]
    assert again.max_seqlen_k == captured.max_seqlen_k == 128  # a static bound, not the batch's
    assert not c.host_reads, c.ops
    assert not c.made, c.ops


def test_refusals() -> None:
    with pytest.raises(LayoutError, match=r"one sliding window per KV-cache group, got \[32, 64\]"):
        group_window({32, None, 64})
    assert group_window({None, 48}) == 48 and group_window({None}) is None
    b = _batch()
    b.pop("q_lens")
    b["num_reqs"] = 5
    with pytest.raises(CapacityError, match="max_num_seqs=4"):
        _filler().fill(**b)  # type: ignore[arg-type]


def test_kernel_metadata_is_the_constructors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel step's metadata, made from a template in one C call where the host route's
    module is built, has the fields the dataclass's constructor gives, with or without it;
    each call makes a new object (vLLM may set ``slot_mapping`` on one step's)."""
    from dataclasses import fields

    from attnpool.integrations.vllm.step import StepMetadata, kernel_metadata
    from attnpool.update import host

    none = torch.empty(0, dtype=torch.int64)
    view, step = object(), (torch.zeros(2), torch.ones(1), torch.zeros(1, 4), torch.ones(3))
    want = StepMetadata(view, None, none, none, 5, step)  # type: ignore[arg-type]
    made = []
    for built in (True, False):
        if not built:
            monkeypatch.setattr(host, "load", lambda: None)
        elif host.load() is None:
            continue  # (the C module is not built here: the constructor's case below)
        make = kernel_metadata(none)
        module = host.load()
        assert (getattr(make, "func", None) is module.with_slots) if built else module is None
        got = make(view, 5, step)  # type: ignore[arg-type]
        assert type(got) is StepMetadata
        assert all(getattr(got, f.name) is getattr(want, f.name)
                   or getattr(got, f.name) == getattr(want, f.name) for f in fields(want))
        assert make(view, 5, step) is not got
        got.slot_mapping = none  # (vLLM's cross-attention builder sets it)
        made.append(got)
    assert made[-1].view is view and made[-1].kernel is step and made[-1].num_actual_tokens == 5


def test_too_many_slots_are_refused_before_any_write() -> None:
    """A step whose ``slot_mapping`` is past ``max_num_batched_tokens`` is refused before the
    pool is refilled: the arena keeps the last step's bytes."""
    f = _filler()
    b = _batch()
    b.pop("q_lens")
    f.fill(**b)  # type: ignore[arg-type]
    before = f.pool.arena.storage.view(torch.uint8).clone()
    b["seq_lens"] = b["seq_lens"] + 1  # type: ignore[operator]  # (a step that would write)
    b["slot_mapping"] = torch.zeros(49, dtype=torch.int64)  # (the filler's T is 48)
    with pytest.raises(CapacityError, match="49 slots"):
        f.fill(**b)  # type: ignore[arg-type]
    assert torch.equal(f.pool.arena.storage.view(torch.uint8), before)


@pytest.mark.parametrize("decode", [True, False])
def test_rows_past_num_reqs_are_not_the_steps(decode: bool) -> None:
    """vLLM may hand tensors taller than the step (rows of its persistent buffers past
    ``num_reqs``). On a CPU the phases' ``host_step`` reads a taller block table's first rows
    only, and the lengths are cut to the step's rows; the pool holds what the exact tensors
    give, bounds included."""
    b = _batch()
    b.pop("q_lens")
    if decode:
        b.update(max_query_len=1, num_actual_tokens=4,
                 query_start_loc=torch.arange(5, dtype=torch.int32),
                 slot_mapping=torch.tensor([39, 64, 92, 149], dtype=torch.int64))
    tall = dict(b)
    qsl = b["query_start_loc"]
    assert isinstance(qsl, torch.Tensor)
    tall["seq_lens"] = torch.cat([b["seq_lens"], torch.tensor([127, 3], dtype=torch.int32)])  # type: ignore[list-item]
    tall["query_start_loc"] = torch.cat([qsl, qsl[-1:] + 5])
    got: list[tuple[torch.Tensor, tuple[int, int]]] = []
    for inputs in (b, tall):
        f = _filler(poison=True)  # (both arenas start from the same bytes)
        view = f.fill(**inputs).view  # type: ignore[arg-type]
        assert isinstance(view, DecodeView if decode else ExtendView)
        got.append((f.pool.arena.storage.clone(), (view.max_seqlen_q, view.max_seqlen_k)))
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]

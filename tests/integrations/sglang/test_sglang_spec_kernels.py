"""The pure-torch stand-ins for SGLang's speculative CPU ops (``tests/helpers/sglang_cpu``)
on small hand-made cases: the ones :mod:`test_sglang_spec_reference` runs inside SGLang's
engine. Runs where SGLang is installed (the ops mirror its kernels; the module registers torch
ops in the ``sgl_kernel`` namespace)."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

pytest.importorskip("sglang")

from tests.helpers import sglang_engine as se


@pytest.fixture(scope="module")
def sk():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(se.SHIM))
    try:
        mod = importlib.import_module("sgl_kernel")
        spec = importlib.import_module("sgl_kernel.speculative")
    finally:
        sys.path.remove(str(se.SHIM))
    assert mod.__file__ is not None and mod.__file__.startswith(str(se.SHIM))
    return mod, spec


# A tree of topk 2 over 3 steps, 6 nodes: the root (the bonus token), then the selected draft
# candidates 0, 1 (the root's children), 2, 3 (children of candidate 0) and 6 (a child of
# candidate 2). parent_list names each candidate group's parent: group g (candidates
# 2g, 2g + 1) hangs under candidate parent_list[g] (group 0: the root).
PARENTS = torch.tensor([[-1, 0, 1, 2, 3]])
SELECTED = torch.tensor([[0, 1, 2, 3, 6]])
#: node -> its parent node
TREE = {1: 0, 2: 0, 3: 1, 4: 1, 5: 3}


def _tree(sk, mode: int, seq_len: int = 7):  # type: ignore[no-untyped-def]
    n = 6
    mask = torch.full((n * (seq_len + n) if mode == 0 else n * n,), True)
    pos = torch.empty(n, dtype=torch.long)
    idx, nxt, sib = torch.full((3, 1, n), -1, dtype=torch.long)
    sk.build_tree_kernel_efficient_cpu(PARENTS, SELECTED, torch.tensor([seq_len]), mask, pos,
                                       idx, nxt, sib, 2, 3, n, mode)
    return mask, pos, idx, nxt, sib


def test_build_tree(sk) -> None:  # type: ignore[no-untyped-def]
    mod, _ = sk
    mask, pos, idx, nxt, sib = _tree(mod, mode=1)
    assert pos.tolist() == [7, 8, 8, 9, 9, 10]
    assert idx.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert nxt.tolist() == [[1, 3, -1, 5, -1, -1]]  # first child
    assert sib.tolist() == [[-1, 2, -1, 4, -1, -1]]  # next sibling
    want = torch.zeros(6, 6, dtype=torch.bool)
    for node in range(6):
        at = node
        while True:
            want[node, at] = True
            if at == 0:
                break
            at = TREE[at]
    assert torch.equal(mask.reshape(6, 6), want)
    # FULL_MASK: the same block after each row's 7 prefix columns (left as filled)
    full, *_ = _tree(mod, mode=0)
    full = full.reshape(6, 13)
    assert full[:, :7].all() and torch.equal(full[:, 7:], want)


def test_reconstruct_matches_build(sk) -> None:  # type: ignore[no-untyped-def]
    mod, spec = sk
    mask, pos, idx, nxt, sib = _tree(mod, mode=1)
    got = torch.empty(6, dtype=torch.long), *torch.empty((3, 1, 6), dtype=torch.long)
    spec.reconstruct_indices_from_tree_mask(mask, torch.tensor([7]), *got, 1, 6)
    for a, b in zip(got, (pos, idx, nxt, sib), strict=True):
        assert torch.equal(a, b)


def test_verify_tree_greedy(sk) -> None:  # type: ignore[no-untyped-def]
    mod, _ = sk
    _, _, idx, nxt, sib = _tree(mod, mode=1)
    candidates = torch.tensor([[50, 11, 12, 13, 14, 15]])
    # the target predicts 12 after the root (node 2 matches, node 1 does not), then 99
    target = torch.tensor([[12, 0, 99, 0, 0, 0]])
    predicts = torch.full((6,), -1, dtype=torch.long)
    accept = torch.full((1, 4), -1, dtype=torch.long)
    count = torch.zeros(1, dtype=torch.long)
    mod.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept, accept_token_num=count,
                               candidates=candidates, retrive_index=idx,
                               retrive_next_token=nxt, retrive_next_sibling=sib,
                               target_predict=target)
    assert count.tolist() == [1] and accept.tolist() == [[0, 2, -1, -1]]
    assert predicts.tolist() == [12, -1, 99, -1, -1, -1]
    # along node 1 -> 3 -> 5 every draft matches: all three accepted
    target = torch.tensor([[11, 13, 0, 15, 0, 77]])
    predicts.fill_(-1), accept.fill_(-1)
    mod.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept, accept_token_num=count,
                               candidates=candidates, retrive_index=idx,
                               retrive_next_token=nxt, retrive_next_sibling=sib,
                               target_predict=target)
    assert count.tolist() == [3] and accept.tolist() == [[0, 1, 3, 5]]
    assert predicts.tolist() == [11, 13, -1, 15, -1, 77]


def test_cache_loc_ops(sk) -> None:  # type: ignore[no-untyped-def]
    mod, _ = sk
    table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    out = torch.empty(5, dtype=torch.int64)
    mod.assign_extend_cache_locs_cpu(torch.tensor([2, 0]), table, torch.tensor([3, 0]),
                                     torch.tensor([6, 2]), out, 10)
    assert out.tolist() == [23, 24, 25, 0, 1]
    out = torch.empty(8, dtype=torch.int64)
    mod.assign_draft_cache_locs_contiguous_cpu(torch.tensor([1, 3]), table,
                                               torch.tensor([2, 5]), out, 10, 2, 2)
    assert out.tolist() == [12, 13, 14, 15, 35, 36, 37, 38]
    # the draft's decode table: the committed slots, then the branch's own slots
    draft = mod.build_draft_decode_metadata_cpu(table, torch.tensor([1]), torch.tensor([3]),
                                                2, 2, 10)
    assert draft[:, :5].tolist() == [[10, 11, 12, 13, 14], [10, 11, 12, 15, 16]]
    bonus = torch.empty(2, dtype=torch.long)
    mod.fill_bonus_tokens_cpu(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([2, 3]),
                              bonus, 3)
    assert bonus.tolist() == [6, 10]
    dst = torch.zeros(4, dtype=torch.long)
    mod.fill_accept_out_cache_loc_cpu(torch.tensor([[0, 2, -1], [3, -1, -1]]),
                                      torch.tensor([100, 101, 102, 103]), dst)
    assert dst.tolist() == [100, 102, 103, 0]


def test_copy_all_layer_kv_cache(sk) -> None:  # type: ignore[no-untyped-def]
    mod, _ = sk
    bufs = [torch.arange(24, dtype=torch.float32).reshape(6, 2, 2) + 100 * i for i in range(2)]
    want = [b.clone() for b in bufs]
    for w in want:  # rows 1 <- 3 and 3 <- 1 (a swap: every read before any write)
        w[[1, 3]] = w[[3, 1]].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    mod.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 3]), torch.tensor([3, 1]))
    for b, w in zip(bufs, want, strict=True):
        assert torch.equal(b, w)


def test_attention_ops(sk) -> None:  # type: ignore[no-untyped-def]
    del sk  # (registers the ops)
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 8
    kbuf, vbuf = torch.randn(2, 32, hkv, d)
    table = torch.arange(64, dtype=torch.int32).reshape(2, 32) % 32
    # request 0: 5 cached + 3 new tokens; request 1: no cache, 2 new tokens
    q = torch.randn(5, hq, d)
    k, v = torch.randn(2, 5, hkv, d)
    o = torch.empty_like(q)
    torch.ops.sgl_kernel.extend_attention_cpu(
        q, k, v, o, kbuf, vbuf, 1.0, 1.0, table, torch.tensor([0, 1]), torch.tensor([8, 2]),
        torch.tensor([3, 2]), torch.tensor([0, 3]), 3, 0.5, 0.0, False, 0, None, None, None,
        True)

    def ref(qr, kr, vr, causal_from: int):  # type: ignore[no-untyped-def]
        kr, vr = (t.repeat_interleave(hq // hkv, 1).transpose(0, 1) for t in (kr, vr))
        n, s = qr.shape[0], kr.shape[1]
        mask = torch.ones(n, s, dtype=torch.bool)
        mask[:, causal_from:] = torch.ones(n, n, dtype=torch.bool).tril()
        return torch.nn.functional.scaled_dot_product_attention(
            qr.transpose(0, 1), kr, vr, attn_mask=mask, scale=0.5).transpose(0, 1)

    want0 = ref(q[:3], torch.cat([kbuf[:5], k[:3]]), torch.cat([vbuf[:5], v[:3]]), 5)
    want1 = ref(q[3:], k[3:], v[3:], 0)
    torch.testing.assert_close(o, torch.cat([want0, want1]))
    # decode: K/V written at loc, then attention over the row's first seq_len slots
    q1 = torch.randn(2, hq, d)
    k1, v1 = torch.randn(2, 2, hkv, d)
    o1 = torch.empty_like(q1)
    torch.ops.sgl_kernel.decode_attention_cpu(
        q1, kbuf, vbuf, 1.0, 1.0, o1, k1, v1, torch.tensor([6, 20]), torch.empty(0),
        table, torch.tensor([0, 0]), torch.tensor([7, 21]), 0.5, 0.0, False, 0, None, None)
    assert torch.equal(kbuf[6], k1[0]) and torch.equal(vbuf[20], v1[1])
    for i, s in enumerate((7, 21)):
        want = ref(q1[i:i + 1], kbuf[:s], vbuf[:s], s)
        torch.testing.assert_close(o1[i:i + 1], want)

"""vLLM's speculative decoding with attnpool's backend: vLLM's own tokens and acceptance counts,
uniform verify steps served by the pool's verify view (float32, CPU, eager).

vLLM 0.32's CPU build runs both speculation modes tested here natively, with its own CPU
attention backend: n-gram drafts (``method="ngram"``) and a draft model (``model=<draft>``).
Every run is a fresh process with the same engine arguments, natively and with attnpool
(:mod:`tests.helpers.vllm_spec`), and compares

- the greedy tokens (speculation never changes them, so any difference is attention's),
- vLLM's spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position:
  a verify step that attended differently would accept differently),
- which pool phase served each refill (``ATTNPOOL_VLLM_SERVED``): steps in which every request
  runs ``1 + k`` queries are verify refills, and the runs must have some.

The negative control corrupts each verify refill (``ATTNPOOL_VLLM_CORRUPT_VERIFY``: the first
row's ``cache_seqlens`` shortened by one) in the draft-model run: the target's tokens change
(the drafter's own steps could change only the acceptance counts), so the target's verify
steps read the pool's verify view.

Without an engine: the builder's routing (a uniform step is a verify refill whose attention
equals the extend refill's, a step with a request that has nothing cached or with fewer drafts
is an extend refill), the refill counts and the hook, and the CUDA graph support declared with
speculative decoding (read as vLLM's GPU runner reads it; no GPU here, so no graph runs).

The CI sample runs five engines (about a minute unloaded); ``ATTNPOOL_VLLM_SPEC_MATRIX=1``
adds more draft counts, attnpool's torch paths (``ATTNPOOL_VLLM_CPU_KERNEL=attnpool``) and
eight concurrent requests.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.attention.backend import AttentionCGSupport

from attnpool import ExtendView, VerifyView
from attnpool.adapters.backends import Backend
from attnpool.integrations.vllm import served
from attnpool.integrations.vllm.backend import AttnpoolMetadataBuilder
from attnpool.integrations.vllm.cache import cpu_views
from attnpool.integrations.vllm.step import EngineSizes, StepFiller, StepMetadata

from tests.helpers import vllm_engine as ve
from tests.helpers import vllm_spec as vs

NEW = 32
MATRIX = os.environ.get("ATTNPOOL_VLLM_SPEC_MATRIX", "0") == "1"
matrix = pytest.mark.skipif(not MATRIX, reason="set ATTNPOOL_VLLM_SPEC_MATRIX=1")


H, H_KV, D, P, N = 4, 2, 32, 16, 4
F64 = torch.float64


def _filler(num_draft_tokens: int, window: int | None = None) -> StepFiller:
    sizes = EngineSizes(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160,
                        block_size=P, sliding_window=window, num_blocks=48,
                        device=torch.device("cpu"), num_draft_tokens=num_draft_tokens)
    return StepFiller(sizes, Backend.SDPA, H, H_KV, F64)


def _fill(f: StepFiller, seq_lens: list[int], q_lens: list[int]) -> StepMetadata:
    """One step of ``len(seq_lens)`` requests with ``q_lens`` queries each, over scattered
    blocks (the same for every call)."""
    n = len(seq_lens)
    table = torch.zeros(4, 10, dtype=torch.int32)
    free = [b for b in torch.randperm(47, generator=torch.Generator().manual_seed(1)).add(1)
            .tolist()]
    for r, length in enumerate(seq_lens):
        pages = math.ceil(length / P)
        table[r, :pages] = torch.tensor(free[:pages], dtype=torch.int32)
        free = free[pages:]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return f.fill(num_reqs=n, num_actual_tokens=sum(q_lens), max_query_len=max(q_lens),
                  query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                  block_table=table, slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64))


@pytest.mark.parametrize("window", [None, 20])
def test_uniform_step_is_a_verify_refill_with_extends_attention(window: int | None) -> None:
    """Every request runs N queries: a verify refill (chain: cache_seqlens are vLLM's
    seq_lens, query offsets step N), and its attention (the SDPA adapter, with a sliding
    window) equals the extend refill's of the same step, float64."""
    seq_lens = [5, 16, 37, 70]
    md = _fill(_filler(N, window), seq_lens, [N] * 4)
    assert isinstance(md.view, VerifyView) and md.view.expand is None
    prefix = md.view.prefix
    assert prefix.cache_seqlens[:4].tolist() == seq_lens
    assert prefix.cu_seqlens_q[:5].tolist() == [0, 4, 8, 12, 16]
    ref = _fill(_filler(0, window), seq_lens, [N] * 4)
    assert isinstance(ref.view, ExtendView)
    kv = torch.randn(48, H_KV, P, 2 * D, dtype=F64, generator=torch.Generator().manual_seed(2))
    kv[0] = 0  # vLLM's null block
    k, v = cpu_views(kv)
    q = torch.randn(4 * N, H, D, dtype=F64)
    assert md.run is not None and ref.run is not None
    out = md.run(q, k, v, D ** -0.5, window=window is not None)
    want = ref.run(q, k, v, D ** -0.5, window=window is not None)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("seq_lens", "q_lens"), [
    ([5, 16, 37], [N, N - 2, N]),  # a request with fewer drafts
    ([N, 16, 37], [N, N, N]),  # a new prompt of exactly N tokens: nothing cached
    ([5, 16, 37], [1, 1, 1]),  # decode
])
def test_other_steps_keep_their_phase(seq_lens: list[int], q_lens: list[int],
                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(served.SERVED, str(tmp_path / "counts"))
    monkeypatch.setattr(served.Counts, "_open", {})
    md = _fill(_filler(N), seq_lens, q_lens)
    decode = max(q_lens) == 1
    assert not isinstance(md.view, VerifyView)
    assert isinstance(md.view, ExtendView) is not decode
    got = served.read(str(tmp_path / "counts"))
    assert got == {served.Kind.DECODE: int(decode), served.Kind.EXTEND: int(not decode),
                   served.Kind.VERIFY: 0}


def test_refills_are_counted_and_the_hook_corrupts_verify_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(served.SERVED, str(tmp_path / "counts"))
    monkeypatch.setenv(served.CORRUPT_VERIFY, "1")
    monkeypatch.setattr(served.Counts, "_open", {})
    f = _filler(N)
    md = _fill(f, [5, 16, 37], [N] * 3)
    assert isinstance(md.view, VerifyView)
    assert md.view.prefix.cache_seqlens[:3].tolist() == [4, 16, 37]  # row 0 lost a key
    ext = _fill(f, [5, 16, 37], [N, 2, N])
    assert isinstance(ext.view, ExtendView)
    assert ext.view.cache_seqlens[:3].tolist() == [5, 16, 37]
    assert served.read(str(tmp_path / "counts")) == {
        served.Kind.DECODE: 0, served.Kind.EXTEND: 1, served.Kind.VERIFY: 1}


def _config(backends: list[Backend], device: str, k: int | None) -> Any:
    return ve.config_stub(backends, device, speculative_tokens=k)


@pytest.mark.parametrize(("backend", "device", "k", "want"), [
    (Backend.FA2, "cuda", 3, AttentionCGSupport.UNIFORM_BATCH),
    (Backend.FA2, "cuda", None, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    (Backend.FA3, "cuda", 3, AttentionCGSupport.ALWAYS),
    (Backend.FLASHINFER, "cuda", 3, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    (Backend.SDPA, "cuda", 3, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
    (Backend.SDPA, "cpu", 3, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE),
])
def test_graph_support_with_speculative_decoding(backend: Backend, device: str, k: int | None,
                                                 want: AttentionCGSupport) -> None:
    """Declared only (no GPU here: no graph is captured or replayed)."""
    cfg = _config([backend], device, k)
    assert AttnpoolMetadataBuilder.get_cudagraph_support(cfg, None) is want


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("vllm_spec_models")


@pytest.fixture(scope="module")
def draft_native(root: Path) -> vs.Result:
    """The draft-model run on vLLM's own backend (shared by two tests)."""
    target, draft = vs.save_models(root)
    return vs.run(target, False, vs.draft_model(draft, 3), NEW)


def _same(native: vs.Result, ours: vs.Result) -> None:
    """attnpool's run gives native's tokens and acceptance counts, with drafts accepted and
    verify steps served by the pool's verify view."""
    same = sum(a == b for a, b in zip(native.tokens, ours.tokens, strict=True))
    assert ours.tokens == native.tokens, f"{same}/{len(native.tokens)} requests identical"
    assert ours.counts() == native.counts()
    assert native.accepted > 0 and native.drafts > 0, native.counts()
    assert ours.served["verify"] > 0, ours.served


def test_draft_model_matches_native(root: Path, draft_native: vs.Result) -> None:
    target, draft = vs.save_models(root)
    ours = vs.run(target, True, vs.draft_model(draft, 3), NEW)
    _same(draft_native, ours)


def test_ngram_matches_native(root: Path) -> None:
    """Two requests at a time, so that steps in which both carry three drafts (verify) and
    steps in which they do not (extend) both occur."""
    target = vs.save_cyclic(root)
    native = vs.run(target, False, vs.ngram(3), NEW, max_num_seqs=2)
    ours = vs.run(target, True, vs.ngram(3), NEW, max_num_seqs=2)
    _same(native, ours)
    assert ours.served["extend"] > 0, ours.served


def test_corrupted_verify_view_changes_the_tokens(root: Path, draft_native: vs.Result) -> None:
    target, draft = vs.save_models(root)
    bad = vs.run(target, True, vs.draft_model(draft, 3), NEW, corrupt=True)
    assert bad.served["verify"] > 0, bad.served
    assert bad.tokens != draft_native.tokens


@matrix
@pytest.mark.parametrize("kernel", ["vllm", "attnpool"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_matrix_draft_model(root: Path, k: int, kernel: str) -> None:
    """Draft counts 1, 2, 4 with eight concurrent requests, through vLLM's kernel and
    attnpool's torch paths (the SDPA adapter over the verify view)."""
    target, draft = vs.save_models(root)
    env = {"ATTNPOOL_VLLM_CPU_KERNEL": kernel}
    native = vs.run(target, False, vs.draft_model(draft, k), NEW, max_num_seqs=8)
    ours = vs.run(target, True, vs.draft_model(draft, k), NEW, max_num_seqs=8, env=env)
    _same(native, ours)


@matrix
@pytest.mark.parametrize("kernel", ["vllm", "attnpool"])
@pytest.mark.parametrize("k", [1, 4])
def test_matrix_ngram(root: Path, k: int, kernel: str) -> None:
    """n-gram drafts, one request at a time (every step with ``k`` drafts is a verify step),
    through vLLM's kernel and attnpool's torch paths."""
    target = vs.save_cyclic(root)
    env = {"ATTNPOOL_VLLM_CPU_KERNEL": kernel}
    native = vs.run(target, False, vs.ngram(k), NEW, max_num_seqs=1)
    ours = vs.run(target, True, vs.ngram(k), NEW, max_num_seqs=1, env=env)
    _same(native, ours)

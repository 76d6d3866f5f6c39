"""FlashInfer's MLA wrapper through :class:`MLAGraphWrappers` == absorbed SDPA, eager and replayed.

One function, :func:`run_case`, drives a phase (decode, chain verify, tree verify, draft extend)
through :class:`attnpool.adapters.mla.flashinfer.MLAGraphWrappers` and compares each step with
:func:`attnpool.adapters.mla.attention` (``Layout.FLASHINFER``) computed in float32 from the same
inputs. The pool (``max_bs = 8``), the latent cache (every slot random, so every value is finite)
and the queries live on the device under test.

* ``graphs=False``: wrappers made on the capture view, then per batch ``update_``, ``plan`` of
  each part, ``attention`` with the packed query and with the split (contiguous) one.
* ``graphs=True``: ``attention`` captured once at ``bs = 8`` (after a warm-up on a side stream),
  then per batch: ``update_`` in place, ``plan`` outside the graph, new queries copied into the
  captured query buffer, replay; the replayed kernel reads the pool's buffers. On CPU the replay
  is simulated (the captured call runs again on the capture view and the static query).

On CPU the wrapper is the fake of ``tests/helpers/fakes_flashinfer_mla.py`` (float32); on CUDA it
is FlashInfer's ``BatchMLAPagedAttentionWrapper`` (bfloat16, DeepSeek's latent 512 / rope 64),
compared within 2e-2. Real rows are compared; padded rows (no pages) must be finite.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from attnpool import BufferPool, Layout, PagedView, PoolConfig
from attnpool.adapters import mla
from attnpool.adapters.merge import Attn
from attnpool.adapters.mla import flashinfer as mla_fi
from attnpool.kv import KVCachePool
from attnpool.kv.mla_shape import MLAShape

from tests.helpers.batches import make_batch, make_table, tree_mask
from tests.helpers.fakes_flashinfer_mla import BatchMLAPagedAttentionWrapper as FakeMLA

ND, BS = 4, 8
PHASES = ["decode", "chain", "tree", "draft_extend"]
#: batches per case: full, one request, some padding
SIZES = [8, 1, 5]


def _shape(heads: int) -> MLAShape:
    return MLAShape(num_heads=heads, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    kv_lora_rank=512)


def _parts(view: object) -> list[PagedView]:
    if isinstance(view, PagedView):
        return [view]
    return [p for p in (view.prefix, view.expand) if p is not None]  # type: ignore[attr-defined]


class Case:
    """A pool of one phase, a latent cache filled everywhere, and random batches over them."""

    def __init__(self, phase: str, dev: torch.device, dtype: torch.dtype, page: int,
                 heads: int, seed: int) -> None:
        self.phase, self.dev, self.dtype = phase, dev, dtype
        self.shape = _shape(heads)
        self.rng = random.Random(seed)
        ctx = 1024 if dev.type == "cuda" else 64  # the fake loops over rows on the host
        self.cfg = PoolConfig(max_bs=BS, max_context_len=ctx, page_size=page, device=dev,
                              layout=Layout.FLASHINFER, pad_page=0, num_draft_tokens=ND,
                              topk=2 if phase == "tree" else 1)
        self.pool = BufferPool(self.cfg, poison=True)
        self.table = make_table(self.cfg, 2 * BS, self.rng)
        pages = int(self.table.max()) // page + 2
        kvp = KVCachePool(self.shape.latent_config(pages, page, dtype=dtype, device=dev))
        self.kv = kvp.kv_cache(0)
        g = torch.Generator().manual_seed(seed)
        self.kv.copy_(torch.randn(tuple(self.kv.shape), generator=g).to(dev, dtype))
        self.kv_f32 = self.kv.float()  # the reference's cache: the same values, float32
        self.gen = g

    @property
    def ph(self) -> Any:
        return self.pool.decode if self.phase == "decode" else (
            self.pool.draft_extend if self.phase == "draft_extend" else self.pool.verify)

    def q_rows(self) -> int:
        return BS if self.phase == "decode" else BS * ND

    def queries(self) -> Tensor:
        s = self.shape
        q = torch.randn(self.q_rows(), s.num_heads, s.latent_row, generator=self.gen)
        return q.to(self.dev, self.dtype)

    def update(self, n: int, full_accept: bool = False) -> tuple[object, int]:
        """Refill the phase in place at ``bs = 8`` with ``n`` random requests: ``(view, real
        query rows)``."""
        b = make_batch(self.cfg, n, self.rng, extra=ND, table=self.table)
        kw = b.inputs(self.dev)
        if self.phase == "decode":
            return self.ph.update_(BS, **kw), n
        if self.phase == "draft_extend":
            acc = [ND if full_accept else self.rng.randint(1, ND) for _ in range(n)]
            seq = torch.tensor([s + a for s, a in zip(b.seq_lens, acc, strict=True)],
                               device=self.dev)
            view = self.ph.update_(BS, seq_lens=seq, accept_lens=torch.tensor(acc, device=self.dev),
                                   req_pool_indices=kw["req_pool_indices"],
                                   req_to_token=kw["req_to_token"])
            return view, sum(acc)
        mask = tree_mask(n, ND, self.rng, self.dev) if self.phase == "tree" else None
        return self.ph.update_(BS, **kw, tree_mask=mask), n * ND

    def check(self, view: object, q: Tensor, got: Attn, rows: int, what: str) -> None:
        want = mla.attention(view, q.float(), self.kv_f32, self.shape, layout=Layout.FLASHINFER)
        tol = 1e-5 if self.dtype == torch.float32 else 2e-2
        assert got.out.shape == (q.shape[0], self.shape.num_heads, self.shape.kv_lora_rank)
        torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=tol,
                                   rtol=tol, msg=lambda m: f"{what} out: {m}")
        torch.testing.assert_close(got.lse[:rows].float(), want.lse[:rows].float(), atol=tol,
                                   rtol=tol, msg=lambda m: f"{what} lse: {m}")
        # padded rows own no pages: their output is discarded but must not be NaN / inf
        assert torch.isfinite(got.out[rows:]).all(), f"{what}: padded rows' output not finite"
        assert not torch.isnan(got.lse[rows:]).any(), f"{what}: padded rows' lse is NaN"


def _wrappers(c: Case, wrapper_cls: type[Any] | None) -> mla_fi.MLAGraphWrappers:
    size = 128 << 20 if c.dev.type == "cuda" else 256
    ws = torch.zeros(size, dtype=torch.uint8, device=c.dev)
    return mla_fi.MLAGraphWrappers(ws, c.shape, wrapper_cls=wrapper_cls)


def _plan(w: mla_fi.MLAGraphWrappers, view: object, dtype: torch.dtype) -> None:
    for part in _parts(view):
        w.plan(part, q_dtype=dtype)


def run_case(phase: str, dev: torch.device, wrapper_cls: type[Any] | None, dtype: torch.dtype,
             graphs: bool, *, page: int = 16, heads: int = 16, capture_on_batch: bool = True
             ) -> None:
    """Three batches (``SIZES`` real requests, padded to ``bs = 8``) of ``phase``, each checked
    against absorbed SDPA. ``capture_on_batch``: plan the capture on a full random batch (else
    on the phase's own capture view, as :class:`attnpool.graphs.GraphRunner` does)."""
    c = Case(phase, dev, dtype, page, heads, seed=PHASES.index(phase) * 7 + page + heads)
    w = _wrappers(c, wrapper_cls)
    cap = c.ph.view(BS)
    for part in _parts(cap):  # before capture: construction allocates
        w.wrapper(part)
    assert len(w) == len(_parts(cap))
    if not graphs:
        for i, n in enumerate(SIZES):
            view, rows = c.update(n)
            _plan(w, view, dtype)
            q = c.queries()
            c.check(view, q, w.attention(view, q, c.kv), rows, f"{phase} eager {i} packed")
            lat = c.shape.kv_lora_rank
            split = w.attention(view, q[..., :lat].contiguous(), c.kv,
                                q_pe=q[..., lat:].contiguous())
            c.check(view, q, split, rows, f"{phase} eager {i} split")
        return
    if capture_on_batch:  # a full batch, every row accepting all drafts: the most query rows
        c.update(BS, full_accept=True)
    _plan(w, cap, dtype)
    q_buf = c.queries()

    def fwd() -> Attn:
        return w.attention(cap, q_buf, c.kv)

    replay: Callable[[], Attn]
    if dev.type == "cuda":
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd()  # warm-up: lazy initialisation never inside a capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fwd()

        def replay() -> Attn:
            graph.replay()
            return captured
    else:  # simulated: the captured call again, on the capture view and the static query
        fwd()
        replay = fwd
    for i, n in enumerate(SIZES):
        view, rows = c.update(n)
        _plan(w, view, dtype)  # outside the graph, before the replay
        q_buf.copy_(c.queries())
        got = replay()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        c.check(view, q_buf, got, rows, f"{phase} replay {i}")


# ---- CPU: the fake (proves the sequence of calls and the buffers it reads) ---------------------
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "simulated-graph"])
@pytest.mark.parametrize("phase", PHASES)
def test_fake_cpu(phase: str, graphs: bool) -> None:
    run_case(phase, torch.device("cpu"), FakeMLA, torch.float32, graphs)


@pytest.mark.parametrize("phase", ["decode", "draft_extend"])
def test_fake_cpu_capture_view_page1(phase: str) -> None:
    run_case(phase, torch.device("cpu"), FakeMLA, torch.float32, True, page=1,
             capture_on_batch=False)


# ---- CUDA: FlashInfer's wrapper (bfloat16; the JIT compiles once per head count) ---------------
def _cuda() -> torch.device:
    pytest.importorskip("flashinfer")
    return torch.device("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("phase", PHASES)
def test_flashinfer_mla_cuda(phase: str, graphs: bool) -> None:
    run_case(phase, _cuda(), None, torch.bfloat16, graphs)


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("phase", ["decode", "tree"])
def test_flashinfer_mla_cuda_page1(phase: str, graphs: bool) -> None:
    run_case(phase, _cuda(), None, torch.bfloat16, graphs, page=1)


@pytest.mark.cuda
@pytest.mark.parametrize("phase", ["decode", "draft_extend"])
def test_flashinfer_mla_cuda_graph_on_capture_view(phase: str) -> None:
    """The capture planned on the phase's capture view (rows without pages), as GraphRunner
    captures; the replays re-planned on real batches."""
    run_case(phase, _cuda(), None, torch.bfloat16, True, capture_on_batch=False)


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_flashinfer_mla_cuda_128_heads(graphs: bool) -> None:
    """DeepSeek V3's 128 heads on one device (another JIT build: last, on its own)."""
    run_case("decode", _cuda(), None, torch.bfloat16, graphs, heads=128)

"""Bad config and bad input: a clear PoolError naming expected vs actual, and no write."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

import attnpool
from attnpool import BufferPool, CapacityError, Impl, InputError, Layout, PoolConfig, PoolError
from attnpool.update.reference import rows as row_layouts

from tests.helpers.batches import make_batch


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_bs": 0}, "max_bs must be >= 1, got 0"),
        ({"page_size": 3}, "power of two"),
        ({"page_size": 0}, "power of two"),
        ({"max_context_len": 8, "page_size": 16}, "max_context_len must be >= page_size"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"topk": 0}, "topk must be >= 1"),
        ({"topk": 4}, "topk > 1 needs"),
        ({"pad_seq_len": 0}, "pad_seq_len"),
        ({"pad_page": -1}, "pad_page"),
        ({"attention_chunk_size": 24, "page_size": 16}, "multiple of page_size"),
        ({"max_encoder_len": 4096}, "max_encoder_len"),
        ({"layout": "flash_attn"}, "Layout"),
        ({"device": "nonsense"}, "device"),
        ({"max_bs": 2.0}, "max_bs must be an int"),
        ({"num_pages": 0}, "num_pages"),
        ({"spec_steps": 2, "layout": Layout.FLASHINFER}, "needs Layout.FLASH_ATTN"),
        ({"max_extend_tokens": -1}, "max_extend_tokens must be >= 0, got -1"),
        ({"max_extend_tokens": 2**28}, "max_extend_tokens \\* max_bs must be < 2\\*\\*31"),
        ({"max_extend_tokens": True}, "max_extend_tokens must be an int"),
    ],
)
def test_bad_config(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {"max_bs": 8, "max_context_len": 1024, "device": "cpu"}
    with pytest.raises(PoolError, match=match):
        PoolConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def _setup(impl: Impl = Impl.REFERENCE) -> tuple[BufferPool, list[torch.Tensor]]:
    cfg = PoolConfig(max_bs=8, max_context_len=256, page_size=16, device="cpu",
                     layout=Layout.BOTH, impl=impl)
    pool = BufferPool(cfg, poison=True)
    b = make_batch(cfg, 4, random.Random(0))
    pool.decode.update_(6, **b.inputs())
    return pool, list(b.tensors())


def _bad_calls() -> list[tuple[str, type[PoolError], Callable[..., object]]]:
    def call(bs: int = 6, seq: object = None, rpi: object = None, table: object = None,
             cpu: object = None) -> Callable[[BufferPool, list[torch.Tensor]], object]:
        def f(pool: BufferPool, t: list[torch.Tensor]) -> object:
            return pool.decode.update_(
                bs,
                seq_lens=t[0] if seq is None else seq(t) if callable(seq) else seq,
                req_pool_indices=t[1] if rpi is None else rpi(t) if callable(rpi) else rpi,
                req_to_token=t[2] if table is None else table(t) if callable(table) else table,
                seq_lens_cpu=cpu,
            )
        return f

    return [
        ("bs > max_bs", CapacityError, call(bs=9)),
        ("bs < 1", CapacityError, call(bs=0)),
        ("n > bs", CapacityError, call(bs=3)),
        ("float seq_lens", InputError, call(seq=lambda t: t[0].float())),
        ("2-D seq_lens", InputError, call(seq=lambda t: t[0][None])),
        ("list seq_lens", InputError, call(seq=[1, 2, 3, 4])),
        ("rpi rows", InputError, call(rpi=lambda t: t[1][:3])),
        ("table too narrow", InputError, call(table=lambda t: t[2][:, :100])),
        ("table strided", InputError, call(table=lambda t: t[2].t().contiguous().t())),
        ("table 1-D", InputError, call(table=lambda t: t[2][0])),
        ("host lens count", InputError, call(cpu=[1, 2])),
        ("host lens too long", CapacityError, call(cpu=[1, 2, 3, 257])),
        ("host lens zero", CapacityError, call(cpu=[0, 2, 3, 4])),
        ("host lens on meta", InputError, call(cpu=torch.ones(4, device="meta"))),
        ("seq_lens on meta", InputError, call(seq=lambda t: t[0].to("meta"))),
        ("strided seq_lens", InputError, call(seq=lambda t: t[0].repeat_interleave(2)[::2])),
    ]


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
@pytest.mark.parametrize(("what", "err", "fn"), _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_rejected_update_leaves_pool_unchanged(what: str, err: type[PoolError],
                                               fn: Callable[..., object], impl: Impl) -> None:
    pool, t = _setup(impl)
    before = pool.arena.storage.clone()
    with pytest.raises(err) as info:
        fn(pool, t)
    assert isinstance(info.value, ValueError)
    assert "got" in str(info.value), "messages name the actual value"
    assert torch.equal(pool.arena.storage, before), what


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
def test_out_of_range_request_index_gives_bounded_metadata(impl: Impl) -> None:
    """Values of device inputs are not read on the host (that would sync). An out-of-range
    ``req_pool_indices`` value is clamped into the table on both paths: wrong page ids of real
    pages, a valid read region, no raw IndexError and no stray write."""
    pool, t = _setup(impl)
    rows = t[2].shape[0]
    view = pool.decode.update_(6, seq_lens=t[0], req_pool_indices=t[1] + 10_000,
                               req_to_token=t[2])
    pool.check(view)
    got = view.page_table.clone()  # (the next update refills the same buffers)
    clamped = pool.decode.update_(6, seq_lens=t[0], req_to_token=t[2],
                                  req_pool_indices=torch.full_like(t[1], rows - 1))
    pages = -(-int(t[0].max()) // pool.cfg.page_size)
    assert torch.equal(got[:4, :pages], clamped.page_table[:4, :pages])


@pytest.mark.parametrize("impl", [Impl.REFERENCE, pytest.param(Impl.TRITON, marks=pytest.mark.triton)])
def test_local_csr_past_its_capacity_stays_in_bounds(impl: Impl) -> None:
    """A chunk longer than the context and a request table wider than it: lengths past the
    context (out of contract, only a sync could see them) would list more pages than the local
    CSR holds. Both paths drop the excess lanes (wrong metadata, never an IndexError half-way
    through the update, never a byte outside the local part's buffers)."""
    cfg = PoolConfig(max_bs=2, max_context_len=64, page_size=16, device="cpu", impl=impl,
                     attention_chunk_size=128, layout=Layout.FLASHINFER)
    pool = BufferPool(cfg)
    table = torch.arange(2 * 256, dtype=torch.int32).view(2, 256)
    rows = torch.tensor([0, 1])
    pool.local.update_(2, seq_lens=torch.tensor([60, 60]), req_pool_indices=rows,
                       req_to_token=table)
    own = [(p.offset, p.offset + p.nbytes) for p in pool.plan.placements
           if p.spec.phase is attnpool.Phase.LOCAL]
    outside = torch.ones(pool.nbytes, dtype=torch.bool)
    for lo, hi in own:
        outside[lo:hi] = False
    before = pool.arena.storage.clone()
    view = pool.local.update_(2, seq_lens=torch.tensor([100, 100]), req_pool_indices=rows,
                              req_to_token=table)
    assert torch.equal(pool.arena.storage[outside], before[outside])
    assert view.kv_indptr is not None and view.kv_indices is not None
    assert int(view.kv_indptr[-1]) >= 0


def test_reference_page_ids_do_not_depend_on_the_default_device() -> None:
    """The reference path's first update may run under ``torch.device(...)`` (an engine building
    a model): later updates of any pool still work and write the same bytes."""
    pool, t = _setup()
    want = pool.decode.update_(6, seq_lens=t[0], req_pool_indices=t[1], req_to_token=t[2])
    want_pt = want.page_table.clone()
    fresh = BufferPool(pool.cfg)
    row_layouts._SHIFTS.clear()  # (so the first update below makes its cached shift again)
    with torch.device("meta"):
        got = fresh.decode.update_(6, seq_lens=t[0], req_pool_indices=t[1], req_to_token=t[2])
    assert torch.equal(got.page_table[:4], want_pt[:4])
    again = fresh.decode.update_(6, seq_lens=t[0], req_pool_indices=t[1], req_to_token=t[2])
    assert torch.equal(again.page_table[:4], want_pt[:4])


def test_not_a_config() -> None:
    with pytest.raises(PoolError, match="PoolConfig"):
        BufferPool({"max_bs": 4})  # type: ignore[arg-type]
    assert issubclass(attnpool.LayoutError, PoolError)

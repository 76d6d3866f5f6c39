"""flash-attn 4 (``flash_attn.cute``) through the flash-attn adapter: on CPU against a fake that
enforces the real interface's checks (``fakes_fa4.py``), on a GPU with the real kernels.

Every part shape the adapter serves (decode, chain and tree verify, extend with a cached prefix,
draft extend, a sliding-window part) plus softcap and sinks is built from a pool's views and
compared with the SDPA adapter in float32 (bf16 inputs, as the kernels take them); the CPU tests
also check that the metadata passed is the pool's own memory and that refusals come before the
call.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnpool import BufferPool, InputError, LayoutError, Phase, PoolConfig
from attnpool.adapters import flash_attn as fa
from attnpool.adapters import sdpa

from tests.helpers.batches import make_batch, make_table, tree_mask
from tests.helpers.fakes_fa4 import FA4

BF16 = torch.bfloat16
H, H_KV, ND = 4, 2, 4
PARTS = ["decode", "verify-chain", "verify-tree", "extend", "draft-extend", "window"]


def _case(part: str, dev: str, d: int, page: int = 16, c: int = 256, seed: int = 0
          ) -> tuple[BufferPool, Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pool, view, q, k_cache, v_cache) of one part with 3 real rows padded to bs 4."""
    kw: dict[str, Any] = {}
    if part.startswith("verify") or part == "draft-extend":
        kw["num_draft_tokens"] = ND
    if part == "verify-tree":
        kw["topk"] = 2
    if part == "window":
        kw["sliding_window"] = 40
    if part == "extend":
        kw["max_extend_tokens"] = c * 3
    cfg = PoolConfig(max_bs=4, max_context_len=c, page_size=page, device=dev, pad_page=0, **kw)
    pool = BufferPool(cfg, poison=True)
    rng = random.Random(f"{part}-{seed}")
    table = make_table(cfg, 8, rng)
    b = make_batch(cfg, 3, rng, extra=ND, table=table)
    seq, rpi, tab = b.tensors(dev)
    g = torch.Generator().manual_seed(seed)
    pages = 8 * cfg.max_pages + 2
    k, v = (torch.randn(pages, page, H_KV, d, generator=g).to(BF16).to(dev) for _ in range(2))
    if part == "decode" or part == "window":
        view = pool.decode.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=tab)
        rows = 4
    elif part.startswith("verify"):
        mask = tree_mask(3, ND).to(dev) if part == "verify-tree" else None
        view = pool.verify.update_(4, seq_lens=seq, req_pool_indices=rpi, req_to_token=tab,
                                   tree_mask=mask)
        rows = 4 * ND
    elif part == "extend":
        ext = [rng.randint(1, s) for s in b.seq_lens]
        view = pool.extend.update_(3, seq_lens=seq, extend_lens=torch.tensor(ext, device=dev),
                                   req_pool_indices=rpi, req_to_token=tab,
                                   seq_lens_cpu=b.seq_lens, extend_lens_cpu=ext)
        rows = sum(ext)
    else:
        acc = [rng.randint(1, ND) for _ in range(3)]
        view = pool.draft_extend.update_(4, seq_lens=seq + ND, req_pool_indices=rpi,
                                         req_to_token=tab,
                                         accept_lens=torch.tensor(acc, device=dev))
        rows = 4 * ND
    if part == "window":
        view = view.window
    q = torch.randn(rows, H, d, generator=g).to(BF16).to(dev)
    return pool, view, q, k, v


def _real_rows(view: Any) -> int:
    """Query rows of the three real requests (the padded fourth may read nothing)."""
    part = getattr(view, "prefix", view)
    return int(part.cu_seqlens_q[3])


def _close(got: sdpa.Attn, want: sdpa.Attn, rows: int) -> None:
    # bf16 inputs, float32 accumulation in both: a few bf16 ulps
    torch.testing.assert_close(got.out[:rows].float(), want.out[:rows].float(), atol=2e-2,
                               rtol=2e-2)
    torch.testing.assert_close(got.lse[:rows].float(), want.lse[:rows].float(), atol=2e-2,
                               rtol=2e-2)


def _variant(name: str, dev: str) -> dict[str, Any]:
    if name == "softcap":
        return {"softcap": 5.0}
    if name == "sinks":
        return {"sinks": torch.linspace(-1.0, 2.0, H, device=dev)}
    return {}


# ---- CPU, through the fake ----------------------------------------------------------------------
def test_fa4_kwargs_alias_the_pool() -> None:
    pool, view, q, k, v = _case("decode", "cpu", 64)
    kw = fa.fa4_kwargs(view, q, k, v)
    assert set(kw) == {"q", "k", "v", "cu_seqlens_q", "seqused_k", "page_table", "max_seqlen_q",
                       "softmax_scale", "causal", "return_lse", "num_splits"}
    assert kw["num_splits"] == 1  # FA4's own default: no split-KV (Hopper has none)
    assert kw["q"] is q and kw["k"] is k and kw["v"] is v
    for name, buf in (("seqused_k", "cache_seqlens"), ("page_table", "page_table")):
        assert kw[name].data_ptr() == pool.arena.buffer(Phase.DECODE, buf).data_ptr(), name
        assert kw[name].dtype == torch.int32
    assert kw["cu_seqlens_q"].data_ptr() == pool.arena.buffer(None, "arange").data_ptr()
    assert kw["max_seqlen_q"] == 1 and kw["causal"] is True and kw["return_lse"] is True
    win = fa.fa4_kwargs(_case("window", "cpu", 64)[1], q, k, v)
    assert win["window_size"] == (39, 0)


@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("part", PARTS)
def test_fa4_call_path_matches_sdpa(install: Callable[[str, Any], None], part: str,
                                    variant: str) -> None:
    fake = FA4()
    install("flash_attn.cute", fake.module())
    kernel = fa.load_fa4()
    assert (kernel.name, kernel.version, kernel.style) == (
        "flash_attn.cute", fa.FlashAttnVersion.FA4, fa.CallStyle.CUTE)
    assert kernel.get_scheduler_metadata is None
    _, view, q, k, v = _case(part, "cpu", 64)
    extra = _variant(variant, "cpu")
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA4, kernel=kernel, **extra)
    want = sdpa.attention(view, q.float(), k.float(), v.float(), **extra)
    _close(got, want, _real_rows(view))
    last = fake.calls[-1]
    assert ("softcap" in extra) == bool(last["softcap"])
    assert (last["learnable_sink"] is not None) == ("sinks" in extra) or part == "verify-tree"


def test_fa4_token_slot_parts_read_pages_of_one(install: Callable[[str, Any], None]) -> None:
    fake = FA4()
    install("flash_attn.cute", fake.module())
    _, view, q, k, v = _case("verify-tree", "cpu", 64)
    fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA4)
    pages = [c["k"].shape[1] for c in fake.calls[-2:]]
    assert pages == [16, 1]  # the prefix pass on pages, the expand pass on token slots
    assert fake.calls[-1]["k"].data_ptr() == k.data_ptr()  # a view of the cache, not a copy


def test_fa4_refusals_come_before_the_call(install: Callable[[str, Any], None]) -> None:
    fake = FA4()
    install("flash_attn.cute", fake.module())
    _, view, q, k, v = _case("decode", "cpu", 64)
    with pytest.raises(LayoutError, match="fp8"):
        fa.run(view, q, k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn),
               version=fa.FlashAttnVersion.FA4, k_scale=torch.ones(1), v_scale=torch.ones(1))
    with pytest.raises(InputError, match="FA3 argument"):
        fa.run(view, q, k, v, version=fa.FlashAttnVersion.FA4, scheduler_metadata=torch.zeros(4))
    with pytest.raises(LayoutError, match=r"head sizes in \[8, 256\].*D=12"):
        fa.run(view, q[..., :12], k[..., :12], v[..., :12], version=fa.FlashAttnVersion.FA4)
    with pytest.raises(InputError, match="num_splits must be an int >= 0"):
        fa.fa4_kwargs(view, q, k, v, num_splits=-1)
    with pytest.raises(InputError, match="sinks must have shape"):
        fa.run(view, q, k, v, version=fa.FlashAttnVersion.FA4, sinks=torch.zeros(3))
    assert not fake.calls


def test_fa4_takes_different_k_and_v_head_sizes(install: Callable[[str, Any], None]) -> None:
    fake = FA4()
    install("flash_attn.cute", fake.module())
    _, view, q, k, _ = _case("extend", "cpu", 64)
    v = torch.randn(*k.shape[:3], 32).to(BF16)
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA4)
    want = sdpa.attention(view, q.float(), k.float(), v.float())
    assert got.out.shape[-1] == 32
    _close(got, want, _real_rows(view))


def test_load_fa4_says_what_is_missing(install: Callable[[str, Any], None]) -> None:
    with pytest.raises(ImportError, match=r"no FA4 module is importable; tried flash_attn\.cute"):
        fa.load_fa4()


# ---- real kernels (GPU) -------------------------------------------------------------------------
def _fa4_or_skip() -> fa.FlashKernel:
    try:
        return fa.load_fa4()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["plain", "softcap", "sinks"])
@pytest.mark.parametrize("part", PARTS)
def test_fa4_kernel_matches_sdpa(part: str, variant: str) -> None:
    kernel = _fa4_or_skip()
    _, view, q, k, v = _case(part, "cuda", 128)
    extra = _variant(variant, "cuda")
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA4, kernel=kernel, **extra)
    want = sdpa.attention(view, q.float(), k.float(), v.float(), **extra)
    _close(got, want, _real_rows(view))


@pytest.mark.cuda
@pytest.mark.parametrize("page", [1, 64, 128])
def test_fa4_kernel_page_sizes(page: int) -> None:
    """Page sizes other than 16, the key tile (128, loaded whole by TMA) included: the cache
    here is fully written, so rows past a row's length are finite as FA4 needs."""
    kernel = _fa4_or_skip()
    _, view, q, k, v = _case("verify-chain", "cuda", 128, page=page, c=512)
    got = fa.attention(view, q, k, v, version=fa.FlashAttnVersion.FA4, kernel=kernel)
    _close(got, sdpa.attention(view, q.float(), k.float(), v.float()), _real_rows(view))


@pytest.mark.cuda
def test_fa4_split_kv_refused_on_hopper() -> None:
    """flash-attn 4 4.0.0b36 asserts inside its SM 9.0 path for any split: refused before."""
    _fa4_or_skip()
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("a Hopper check")
    _, view, q, k, v = _case("decode", "cuda", 128)
    with pytest.raises(LayoutError, match="no split-KV on Hopper"):
        fa.fa4_kwargs(view, q, k, v, num_splits=0)

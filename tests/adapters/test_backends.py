"""The adapters' registry: each backend's record, and selection for a need (what runs, what is
refused and why)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from attnpool import LayoutError
from attnpool.adapters.backends import (
    AUTO_ORDER,
    CAPABILITIES,
    Backend,
    KVLayout,
    Need,
    capabilities,
    select,
)
from attnpool.adapters.flash_attn import FA2_PAGE_MULTIPLE, check_fa3_head_dims
from attnpool.errors import InputError


def _need(**kw: object) -> Need:
    base: dict[str, object] = {"device": "cuda", "dtype": torch.float16, "head_size": 128,
                               "page_size": 256}
    return Need(**(base | kw))  # type: ignore[arg-type]


def test_every_backend_has_a_frozen_record() -> None:
    assert set(CAPABILITIES) == set(Backend) - {Backend.AUTO}
    assert set(AUTO_ORDER) == set(CAPABILITIES) and AUTO_ORDER[-1] is Backend.SDPA
    rec = capabilities(Backend.SDPA)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.windows = False  # type: ignore[misc]
    with pytest.raises(InputError, match="per backend"):
        capabilities(Backend.AUTO)


def test_cpu_selects_sdpa_and_refuses_kernels_with_reasons() -> None:
    need = _need(device="cpu", dtype=torch.float32, page_size=16)
    assert select(need) is Backend.SDPA
    with pytest.raises(LayoutError, match=r"backend FA3 cannot run here: runs on \['cuda'\], "
                                          r"not cpu, takes dtypes bfloat16, float16, not float32"):
        select(need, Backend.FA3)
    with pytest.raises(LayoutError, match="drives"):
        select(need, Backend.FLASHINFER, among=(Backend.SDPA,))


def test_fa2_rules_match_the_adapter() -> None:
    fa2 = capabilities(Backend.FA2)
    assert fa2.missing(_need(page_size=FA2_PAGE_MULTIPLE)) in ([], [
        "needs the module 'flash_attn.flash_attn_interface', which does not import here"])
    why = fa2.missing(_need(page_size=16, head_size_v=64, sinks=True, varying_queries=True,
                            kv_dtype=torch.float8_e4m3fn))
    text = " | ".join(why)
    for part in ("multiple of 256", "D=128, Dv=64", "attention sinks", "varying query counts",
                 "float8_e4m3fn"):
        assert part in text, (part, text)


@pytest.mark.parametrize("pair", [(128, 128), (192, 128), (64, 512), (128, 64), (256, 128),
                                  (32, 32), (200, 128)])
def test_fa3_head_pairs_agree_with_the_adapter_check(pair: tuple[int, int]) -> None:
    d, dv = pair
    try:
        check_fa3_head_dims(d, dv)
        adapter = True
    except LayoutError:
        adapter = False
    assert capabilities(Backend.FA3).takes_heads(d, dv) is adapter


def test_auto_skips_what_cannot_serve_and_names_every_reason() -> None:
    # A float64 model on CUDA: only SDPA takes float64.
    assert select(_need(dtype=torch.float64)) is Backend.SDPA
    # An HND cache on CPU: SDPA reads it (strided views); FA2 alone cannot, and says why.
    assert select(_need(device="cpu", kv_layout=KVLayout.HND)) is Backend.SDPA
    with pytest.raises(LayoutError, match="no backend can serve") as e:
        select(_need(device="cpu", kv_layout=KVLayout.HND, dtype=torch.float32),
               among=(Backend.FA2,))
    assert "FA2 runs on ['cuda'], not cpu" in str(e.value) and "not HND" in str(e.value)


def test_head_size_v_defaults_to_head_size() -> None:
    assert _need(head_size=96).head_size_v == 96
    assert _need(head_size=192, head_size_v=128).head_size_v == 128


def test_fa4_rules_match_the_adapter() -> None:
    """FA4's record: Hopper head sizes in [8, 256] in multiples of 8, K/V sizes may differ, no
    fp8 here; a missing ``flash_attn`` parent package reads as not importable (no raise)."""
    fa4 = capabilities(Backend.FA4)
    assert fa4.takes_heads(192, 128) and fa4.takes_heads(8, 256)
    assert not fa4.takes_heads(12, 12) and not fa4.takes_heads(264, 264)
    why = " | ".join(fa4.missing(_need(head_size=12, kv_dtype=torch.float8_e4m3fn)))
    assert "D=12, Dv=12" in why and "float8_e4m3fn" in why
    assert fa4.importable() is (importlib.util.find_spec("flash_attn") is not None
                                and importlib.util.find_spec("flash_attn.cute") is not None)

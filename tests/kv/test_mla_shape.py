"""MLA shapes and the bytes of the latent vs expanded cache (the figures of BENCHMARKS.md's MLA
memory section come from these functions, through benchmarks/mla_memory.py)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from attnpool import InputError
from attnpool.kv import KVCachePool
from attnpool.kv.mla_shape import MLAShape, cache_bytes_per_token, tokens_in_budget

V3 = MLAShape(128, 128, 64, 128, 512)


def test_v3_bytes_per_token_and_layer() -> None:
    b = cache_bytes_per_token(V3, torch.bfloat16)
    assert b.latent == (512 + 64) * 2  # one row, one head
    assert b.expanded == 128 * ((128 + 64) + 128) * 2  # per head K and V
    assert b.ratio == b.expanded / b.latent
    assert cache_bytes_per_token(V3, torch.float8_e4m3fn).latent == 576


def test_the_accounting_is_the_allocations() -> None:
    """The per-token figure is what a cache of that config really allocates per page."""
    s = MLAShape(4, 8, 4, 6, 16)
    for cfg in (s.latent_config(10, 4, dtype=torch.float32),
                s.expanded_config(10, 4, dtype=torch.float32)):
        pool = KVCachePool(cfg)
        per_page = cfg.bytes_per_token * cfg.page_size
        assert cfg.cache_nbytes == (cfg.num_pages + 1) * per_page  # pages + a scratch page
        assert pool.nbytes >= cfg.cache_nbytes


def test_tokens_in_budget() -> None:
    lat, exp = tokens_in_budget(V3, torch.bfloat16, budget_bytes=40 << 30, num_layers=61)
    assert lat == (40 << 30) // (1152 * 61) and exp == (40 << 30) // (81920 * 61)
    with pytest.raises(InputError):
        tokens_in_budget(V3, torch.bfloat16, budget_bytes=-1, num_layers=61)
    with pytest.raises(InputError, match="qk_nope_head_dim must be an int >= 1"):
        MLAShape(4, 0, 4, 6, 16)


def test_benchmark_script_prints_the_functions_figures() -> None:
    script = pathlib.Path(__file__).parents[2] / "benchmarks" / "mla_memory.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         check=True).stdout
    lat, exp = tokens_in_budget(V3, torch.bfloat16, budget_bytes=40 << 30, num_layers=61)
    assert f"| {lat:,} |" in out and f"| {exp:,} |" in out and "| 1,152 |" in out

"""KV bytes of an MLA model's cache, latent vs expanded, at DeepSeek V3's shapes.

Prints the table of BENCHMARKS.md's MLA memory section; every figure comes from
:mod:`attnpool.kv.mla_shape` (the caches' own byte accounting). Run:
``python benchmarks/mla_memory.py [--budget-gib 40] [--layers 61]``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from attnpool.kv.config import fmt_bytes
from attnpool.kv.mla_shape import MLAShape, cache_bytes_per_token, tokens_in_budget

#: DeepSeek V3: 128 heads, nope 128, rope 64, v 128, latent 512
V3 = MLAShape(num_heads=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
              kv_lora_rank=512)


def table(shape: MLAShape = V3, dtype: torch.dtype = torch.bfloat16, budget_gib: float = 40.0,
          layers: int = 61, tp: int = 8) -> str:
    """The markdown table: bytes per token and layer, and tokens in the budget, per form; plus
    the expanded form per rank with the heads sharded ``tp`` ways (the latent row is not)."""
    b = cache_bytes_per_token(shape, dtype)
    budget = int(budget_gib * (1 << 30))
    lat, exp = tokens_in_budget(shape, dtype, budget_bytes=budget, num_layers=layers)
    name = str(dtype).removeprefix("torch.")
    sharded = dataclasses.replace(shape, num_heads=shape.num_heads // tp)
    bt = cache_bytes_per_token(sharded, dtype)
    _, exp_tp = tokens_in_budget(sharded, dtype, budget_bytes=budget, num_layers=layers)
    return "\n".join([
        f"| cache ({name}) | bytes / token / layer | bytes / token ({layers} layers) | "
        f"tokens in {budget_gib:g} GiB |",
        "|---|---|---|---|",
        f"| latent (c_kv {shape.kv_lora_rank} + k_pe {shape.qk_rope_head_dim}) | {b.latent:,} "
        f"| {fmt_bytes(b.latent * layers)} | {lat:,} |",
        f"| expanded ({shape.num_heads} heads x K {shape.qk_head_dim} + V {shape.v_head_dim}) "
        f"| {b.expanded:,} | {fmt_bytes(b.expanded * layers)} | {exp:,} |",
        f"| expanded / latent | {b.ratio:.1f}x | | |",
        f"| expanded per rank at TP {tp} ({shape.num_heads // tp} heads) | {bt.expanded:,} | "
        f"{fmt_bytes(bt.expanded * layers)} | {exp_tp:,} |",
        f"| expanded at TP {tp} / latent | {bt.ratio:.1f}x | | |",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=40.0)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tp", type=int, default=8)
    args = ap.parse_args()
    print(table(budget_gib=args.budget_gib, layers=args.layers, tp=args.tp))


if __name__ == "__main__":
    main()

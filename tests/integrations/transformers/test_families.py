"""Every decoder family of transformers that dispatches its attention through
``AttentionInterface`` gives ``model.generate``'s greedy tokens through ``PagedGenerator``.

Tiny random models (two layers, float64, ``initializer_range=0.3``), built from configs: no
download. Windows (4) and prompts (13 and 6 tokens, 5 new) are sized so that sliding windows
bite in every sliding layer. Three modes per family: page size 1, page size 4, and speculative
decoding (the draft is the model itself, three draft tokens, pages of 4). Mixture-of-experts
models run their experts eagerly (transformers' grouped kernels take no float64).

Families still refused are checked to be refused before any work, with the reason named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnpool import LayoutError  # noqa: E402
from attnpool.integrations.transformers import PagedGenerator  # noqa: E402
from attnpool.integrations.transformers.model import graph_blocker  # noqa: E402

from tests.helpers import hf_tiny  # noqa: E402

V, W = 96, 4
BASE: dict[str, Any] = dict(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None)
MOE = {"num_experts_per_tok": 2}
#: model_type -> config overrides (``None`` drops a base key the family does not have)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 2, "moe_intermediate_size": 16, **MOE},
    "mistral": {"sliding_window": None}, "mistral-window": {"sliding_window": W},
    "mixtral": {"num_local_experts": 2, **MOE},
    "gemma2": {"head_dim": 16, "sliding_window": W, "query_pre_attn_scalar": 16},
    "gemma3_text": {"head_dim": 16, "sliding_window": W, "query_pre_attn_scalar": 16,
                    "sliding_window_pattern": 2},
    "phi3": {}, "olmo2": {}, "olmo3": {"sliding_window": W},
    "gpt_neox": {"num_key_value_heads": None},
    "gpt2": {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256,
             "num_key_value_heads": None},
    "cohere": {}, "cohere2": {"sliding_window": W}, "granite": {}, "starcoder2": {},
    "gpt_oss": {"head_dim": 16, "sliding_window": W, "num_local_experts": 2, **MOE},
    "smollm3": {}, "exaone4": {"sliding_window": W}, "glm4": {},
    # chunked attention (chunks of 4) in 3 of 4 layers, the fourth without RoPE
    "llama4_text": {"head_dim": 16, "attention_chunk_size": 4, "num_local_experts": 2,
                    "intermediate_size_mlp": 96, "num_hidden_layers": 4, **MOE},
    # MLA: keys of 16 + 8 per head, values of 16
    "deepseek_v3": {"kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
                    "num_key_value_heads": 4,
                    "qk_nope_head_dim": 16, "v_head_dim": 16, "head_dim": 8,
                    "n_routed_experts": 4, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, **MOE},
}
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    # their attention is not dispatched through AttentionInterface: nothing to replace
    "falcon": ({"num_key_value_heads": None}, "does not dispatch its attention"),
    "stablelm": ({}, "does not dispatch its attention"),
}
PROMPTS = [[3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43], [2, 4, 6, 8, 10, 12]]
NEW = 5


def build(name: str, overrides: dict[str, Any]) -> Any:
    kw = {k: v for k, v in {**BASE, **overrides}.items()
          if not (v is None and k == "num_key_value_heads")}
    cfg = transformers.AutoConfig.for_model(name.split("-")[0], **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    return model.to(torch.float64).eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[str, Any, list[list[int]]]:
    name: str = request.param
    model = build(name, FAMILIES[name])
    return name, model, hf_tiny.greedy(model, PROMPTS, NEW)


@pytest.mark.parametrize("mode", ["page1", "page4", "spec"])
def test_family_gives_generates_tokens(family: tuple[str, Any, list[list[int]]],
                                       mode: str) -> None:
    name, model, ref = family
    kw: dict[str, Any] = {"max_bs": 2, "max_context_len": 40}
    if mode == "spec":
        kw.update(page_size=4, draft_model=model, num_draft_tokens=3)
    else:
        kw["page_size"] = 1 if mode == "page1" else 4
    gen = PagedGenerator(model, **kw)
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == ref, name
    window = getattr(model.config, "sliding_window", None)
    assert gen.pool.cfg.sliding_window == window


#: the families whose window or chunks bite, also with pages of 16 (longer than the window)
WINDOWED = [n for n, o in FAMILIES.items() if o.get("sliding_window") or
            o.get("attention_chunk_size")]


@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_family_with_pages_of_16(name: str) -> None:
    # chunks are whole pages (a pool refuses others): Llama 4 gets chunks of 16, which the
    # 13-token prompt and its 5 new tokens still cross
    over = FAMILIES[name] | ({"attention_chunk_size": 16} if name == "llama4_text" else {})
    model = build(name, over)
    gen = PagedGenerator(model, max_bs=2, max_context_len=40, page_size=16)
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == hf_tiny.greedy(model, PROMPTS, NEW), name


#: the families decode steps replay from CUDA graphs for (chunked models and eager experts run
#: eagerly, see test_eager_only_models_refuse_cuda_graphs)
GRAPHED = [n for n, o in FAMILIES.items() if not o.get("attention_chunk_size") and
           not o.get("num_experts_per_tok")]


@pytest.mark.cuda
@pytest.mark.parametrize("name", GRAPHED)
def test_family_on_cuda_replays_graphs_with_generates_tokens(name: str) -> None:
    """On a GPU, decode steps replay captured graphs (padded to a captured size) and still give
    ``generate``'s tokens, float64 on both sides."""
    model = build(name, FAMILIES[name]).to("cuda")
    ref = hf_tiny.greedy(model, PROMPTS, NEW)
    gen = PagedGenerator(model, max_bs=2, max_context_len=40, page_size=4, cuda_graphs=True)
    assert gen.generate(PROMPTS, max_new_tokens=NEW) == ref, name
    assert gen._graphs is not None and gen._graphs.graphs.use_graphs


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_eager_experts_refuse_cuda_graphs(name: str) -> None:
    """Eager experts route with data-dependent shapes, which a capture refuses:
    ``cuda_graphs=True`` is refused up front."""
    model = build(name, FAMILIES[name])
    with pytest.raises(LayoutError, match="mixture-of-experts model with transformers' eager"):
        PagedGenerator(model, max_bs=2, max_context_len=40, cuda_graphs=True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_graph_blocker_of_every_family(name: str) -> None:
    """``"auto"`` captures exactly the GRAPHED families; Llama 4 (chunked) and eager experts
    are refused with True; a dense config that names experts it does not build is not caught."""
    model = build(name, FAMILIES[name])
    chunk = FAMILIES[name].get("attention_chunk_size")
    got = graph_blocker(model, chunk)
    assert (got.reason == "") == (name in GRAPHED), (name, got)
    assert got.refuse == (name not in GRAPHED), (name, got)


def test_graph_blocker_of_other_expert_implementations() -> None:
    """Experts that are not eager (transformers' default ``grouped_mm``): avoided by ``"auto"``,
    allowed with True; a dense model whose config counts experts is not caught."""
    cfg = transformers.AutoConfig.for_model("qwen3_moe", **{**BASE, **FAMILIES["qwen3_moe"]})
    grouped = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    got = graph_blocker(grouped, None)
    assert got.reason and not got.refuse
    dense = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("doge", **{k: v for k, v in BASE.items()
                                                    if k != "num_key_value_heads"}))
    assert getattr(dense.config, "num_experts", 0) and graph_blocker(dense, None).reason == ""


@pytest.mark.parametrize("name", list(REFUSED))
def test_family_not_yet_served_is_refused_up_front(name: str) -> None:
    overrides, reason = REFUSED[name]
    model = build(name, overrides)
    with pytest.raises(LayoutError, match=reason):
        PagedGenerator(model, max_bs=2, max_context_len=40)


def test_a_draft_with_another_window_is_refused() -> None:
    target = build("mistral-window", {"sliding_window": W})
    draft = build("mistral-window", {"sliding_window": 2 * W})
    with pytest.raises(LayoutError, match="one pool's window parts serve both"):
        PagedGenerator(target, max_bs=2, max_context_len=40, draft_model=draft,
                       num_draft_tokens=3)


def test_mla_keeps_per_head_keys_and_smaller_values() -> None:
    """DeepSeek V3: the cache holds what the attention function receives, K of nope + rope per
    head and V of v_head_dim, for every query head."""
    model = build("deepseek_v3", FAMILIES["deepseek_v3"])
    gen = PagedGenerator(model, max_bs=2, max_context_len=40, page_size=4)
    kv = gen.target.kv
    assert kv is not None
    assert (kv.cfg.num_kv_heads, kv.cfg.head_dim, kv.cfg.head_dim_v) == (4, 24, 16)
    assert kv.v_cache(0).shape[-1] == 16 and kv.k_cache(0).shape[-1] == 24


def test_chunked_layers_read_the_local_phase_and_their_limits_are_refused() -> None:
    model = build("llama4_text", FAMILIES["llama4_text"])
    gen = PagedGenerator(model, max_bs=2, max_context_len=40, page_size=4)
    assert gen.pool.cfg.attention_chunk_size == 4 and not gen.use_graphs
    assert gen.target.spec.chunked_layers == frozenset({0, 1, 2})
    with pytest.raises(LayoutError, match="runs eagerly"):
        PagedGenerator(model, max_bs=2, max_context_len=40, cuda_graphs=True)
    # the no-RoPE layer's temperature reads packed token indices as positions: refused where
    # that would differ from the positions (floor_scale 16 here)
    model.config.floor_scale = 16
    for layer in model.model.layers:
        layer.self_attn.floor_scale = 16
    with pytest.raises(LayoutError, match="floor_scale=16"):
        PagedGenerator(model, max_bs=2, max_context_len=40)
    other = build("llama4_text", {**FAMILIES["llama4_text"], "attention_chunk_size": 8})
    with pytest.raises(LayoutError, match="attention_chunk_size must be the model's"):
        PagedGenerator(model, max_bs=1, max_context_len=12, max_prefill_tokens=12,
                       draft_model=other, num_draft_tokens=2)

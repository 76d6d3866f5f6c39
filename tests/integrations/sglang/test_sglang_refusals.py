"""What attnpool's SGLang backend does not serve is refused when SGLang builds it (at engine
start), with every reason and the setting to change, before a pool exists; what it serves
builds a pool sized from the runner."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch
from torch import nn

from attnpool import LayoutError


def _runner(layers: list[Any], **kw: Any) -> SimpleNamespace:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = kw.pop("kv", None) or MHATokenToKVPool(
        size=256, page_size=16, dtype=kw.pop("kv_dtype", torch.float32), head_num=2,
        head_dim=32, layer_num=len(layers), device="cpu", enable_memory_saver=False)
    table = SimpleNamespace(req_to_token=torch.zeros(8, 512, dtype=torch.int32), size=8)
    base = {"model": nn.ModuleList(layers), "use_mla_backend": False, "token_to_kv_pool": kv,
            "req_to_token_pool": table, "page_size": 16, "device": "cpu",
            "dtype": torch.float32, "server_args": SimpleNamespace(chunked_prefill_size=64,
                                                                   max_prefill_tokens=128),
            "spec_algorithm": None}
    return SimpleNamespace(**(base | kw))


def _layer(i: int, **kw: Any) -> Any:
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(4, 32, 32 ** -0.5, num_kv_heads=2, layer_id=i, **kw)


def test_served_runner_builds_its_pool() -> None:
    from attnpool.integrations.sglang.backend import AttnpoolAttnBackend

    b = AttnpoolAttnBackend(_runner([_layer(0, sliding_window_size=47, logit_cap=20.0),
                                     _layer(1)]))
    s = b.filler.sizes
    assert (s.max_requests, s.max_context_len, s.page_size, s.sliding_window) == (8, 512, 16, 48)
    assert s.max_extend_tokens == min(512 + 8, 256 + 16)  # a whole prompt, capped by the slots
    assert b.filler.masked  # softcap: the adapter's mask on every prefill
    holder = nn.Module()
    holder.sinks = nn.Parameter(torch.zeros(4))  # gpt-oss style: sinks passed to the layers
    plain = AttnpoolAttnBackend(_runner([_layer(0), _layer(1)]))
    with_sinks = AttnpoolAttnBackend(_runner([_layer(0), _layer(1), holder]))
    assert not plain.filler.masked and with_sinks.filler.masked


def test_unserved_runner_is_refused_with_every_reason(caplog: pytest.LogCaptureFixture) -> None:
    from sglang.srt.layers.radix_attention import AttentionType

    from attnpool.integrations.sglang.factory import backend_for

    layers = [_layer(0, is_cross_attention=True), _layer(1, sliding_window_size=10),
              _layer(2, sliding_window_size=20, attn_type=AttentionType.ENCODER_ONLY),
              _layer(3, v_head_dim=16), _layer(4, use_irope=True),
              _layer(5, logit_cap=5.0, logit_capping_method="not tanh")]
    spec = SimpleNamespace(is_none=lambda: False, name="DFLASH")
    args = SimpleNamespace(chunked_prefill_size=64, max_prefill_tokens=128, enable_pdmux=True)
    with caplog.at_level(logging.ERROR), pytest.raises(LayoutError) as e:
        backend_for(_runner(layers, kv_dtype=torch.float16, spec_algorithm=spec,
                                    use_mla_backend=True, attention_chunk_size=64,
                                    server_args=args))
    msg = str(e.value)
    for part in ("multi-head latent attention", "cross attention", "encoder_only",
                 "value head size", "more than one sliding window ([10, 20])",
                 "torch.float16 with a torch.float32 model", "speculative_algorithm=DFLASH",
                 "speculative decoding with page_size=16",
                 "chunked local attention", "logit capping other than tanh",
                 "PD-multiplexing", "another attention_backend"):
        assert part in msg
    assert msg in caplog.text  # logged at ERROR too, where SGLang's scheduler log shows it


def test_speculative_runner_builds_its_spec_phases() -> None:
    """With speculative decoding the pool has SGLang's verify and draft sizes (N, topk and
    steps from the server args; NGRAM a tree without draft steps), the runner's backends share
    it, and a GPU runner is refused at start (SGLang's GPU tree-mask layout is not read)."""
    from attnpool.integrations.sglang.factory import backend_for
    from attnpool.integrations.sglang.spec import AttnpoolDraftSteps

    def runner(algo: str, topk: int, device: str = "cpu") -> SimpleNamespace:
        table = SimpleNamespace(req_to_token=torch.zeros(8, 512, dtype=torch.int32), size=8)
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        kv = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=2,
                              head_dim=32, layer_num=2, device="cpu",
                              enable_memory_saver=False)
        args = SimpleNamespace(chunked_prefill_size=64, max_prefill_tokens=128,
                               speculative_num_draft_tokens=6 if topk > 1 else 4,
                               speculative_eagle_topk=topk, speculative_num_steps=3)
        return _runner([_layer(0), _layer(1)], page_size=1, kv=kv, req_to_token_pool=table,
                       server_args=args, device=device,
                       spec_algorithm=SimpleNamespace(is_none=lambda: False, name=algo))

    eagle = runner("EAGLE", 2)
    b = backend_for(eagle)
    cfg = b.filler.pool.cfg
    assert (cfg.num_draft_tokens, cfg.topk, cfg.spec_steps) == (6, 2, 3)
    steps = AttnpoolDraftSteps(eagle, 2, 3)
    assert steps.base is b and backend_for(eagle) is b and len(steps.attn_backends) == 2
    with pytest.raises(LayoutError, match="topk=1, 3 steps"):
        AttnpoolDraftSteps(eagle, 1, 3)
    cfg = backend_for(runner("NGRAM", 1)).filler.pool.cfg
    assert (cfg.num_draft_tokens, cfg.topk, cfg.spec_steps) == (4, 2, 0)
    with pytest.raises(LayoutError, match="speculative decoding on cuda"):
        backend_for(runner("EAGLE", 1, device="cuda"))


def test_the_adapter_is_the_fastest_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the registry's fastest installed flash-attn that serves the layers (SDPA only
    when none does); on a CPU SDPA; a forced kernel that cannot run is refused with the
    reason. Installation is simulated by which modules the capability records find."""
    from attnpool.adapters.backends import Backend, Capabilities
    from attnpool.integrations.sglang.backend import pick
    from attnpool.integrations.sglang.step import KERNEL

    monkeypatch.delenv(KERNEL, raising=False)
    layers = [_layer(0), _layer(1)]
    assert pick(_runner(layers), layers) is Backend.SDPA
    monkeypatch.setattr(Capabilities, "importable",
                        lambda self: self.module in (None, "flash_attn.cute"))
    cuda = _runner(layers, device="cuda", dtype=torch.bfloat16)
    assert pick(cuda, layers) is Backend.FA4
    assert pick(_runner(layers, device="cuda"), layers) is Backend.SDPA  # float32: no flash-attn
    monkeypatch.setenv(KERNEL, "fa3")
    with pytest.raises(LayoutError, match=r"FA3 cannot run here"):
        pick(cuda, layers)
    with pytest.raises(LayoutError, match=rf"{KERNEL} must name one of \['sdpa'\] on cpu"):
        pick(_runner(layers), layers)


def test_decode_graph_hooks() -> None:
    """SGLang's graph runner's calls: ``init_cuda_graph_state`` refuses while SDPA attends
    (it plans each batch on the host); capture binds the layers to the pool's decode view of
    the graph's size, and a replay refills that view's tensors in place."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from attnpool.integrations.sglang.backend import AttnpoolAttnBackend

    b = AttnpoolAttnBackend(_runner([_layer(0), _layer(1)]))
    with pytest.raises(LayoutError, match="only with flash-attn or FlashInfer attending"):
        b.init_cuda_graph_state(4, 4)
    assert b.get_cuda_graph_seq_len_fill_value() == 1
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=2,
                         req_pool_indices=torch.tensor([3, 0]), seq_lens=torch.tensor([20, 1]),
                         out_cache_loc=torch.tensor([19, 0]))
    b.init_forward_metadata_out_graph(fb, in_capture=True)
    assert b.run is not None
    captured = b.run.view
    b.req_to_token[3, :20] = torch.arange(16, 36)
    b.init_forward_metadata_out_graph(fb)
    assert b.run.view is captured  # the replay refilled it; the captured call is unchanged
    assert captured.cache_seqlens[:2].tolist() == [20, 1]
    assert captured.page_table[0, :2].tolist() == [1, 2]
    fb.forward_mode = ForwardMode.EXTEND
    with pytest.raises(LayoutError, match="decode graphs only"):
        b.init_forward_metadata_out_graph(fb, in_capture=True)

"""Cross attention (encoder-decoder models) served by attnpool's backend on SGLang's CPU engine:
an encoder-decoder model's decoder layers and cross layers read ``pool.encoder``'s view
(:mod:`attnpool.integrations.sglang.cross`), against SGLang's ``torch_native``.

Every run is a fresh engine process of :mod:`tests.helpers.sglang_cross` (tiny random models
built there, ``float32``, greedy, same engine arguments for both backends; the models and what
varies between their requests are described there):

- **mllama** (Llama 3.2 Vision): 4 requests of 1, 2, 3 and 1 images, so 10, 20, 30 and 10
  encoder tokens (checked from SGLang's own prompt-token counts), prompts of 3 to 14 words;
  one prefill batch mixing those encoder lengths, then decode batches; then a round of two
  text-only requests (no encoder input: the base's decode and extend views); then a round
  mixing two image requests and two text-only ones in each batch (through the encoder view:
  a text-only request's cross rows attend nothing), and that round's text-only requests in a
  batch of their own. Every engine process, the reference's too, runs with SGLang's mllama
  text-row mask of mixed prefills corrected (``tests/helpers/sglang_cpu/mllama_mask.py``:
  SGLang's masks the wrong rows there, differently from run to run as the scheduler batches).
- **whisper**: 4 requests of different tones. Whisper's encoder length is fixed by the model
  (1500 tokens for every request, ``max_source_positions``), and SGLang builds the same
  4-token decoder prompt for every request: what varies is the audio (so the cross keys) and
  each request's new tokens (7 to 16), so decode batches lose requests at different steps.

Checks per model: attnpool's tokens are ``torch_native``'s, request for request, in two rounds
(mllama's second finds its prompts, encoder tokens included, in the radix cache, so its
prefill reads a cached encoder); the requests' tokens differ (the encoder input shows in
them); the pool served the run through the encoder view (its refill count,
:class:`attnpool.integrations.sglang.served.Served`, ``ENCODER`` > 0, and no batch took the
plain decode or extend path); in the mixed round each request gives the tokens it gives in
a batch of its own kind (an image request its first round's, a text-only one the text-only
batch's). Negative control, in attnpool's engine: one more round with the
encoder view's cross lengths halved after every refill
(``tests/helpers/sglang_cpu/sitecustomize.py``) must change the tokens, where the uncorrupted
round before it repeated the first.

CI runs mllama (two engine processes, side by side); ``ATTNPOOL_SGLANG_CROSS_FULL=1`` adds
whisper.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("sglang")

import torch
from torch import nn

from attnpool import LayoutError
from attnpool.integrations.sglang.served import REPORT as SERVED
from attnpool.integrations.sglang.served import Served

from tests.helpers import sglang_cross as sc
from tests.helpers import sglang_engine as se

FULL = os.environ.get("ATTNPOOL_SGLANG_CROSS_FULL") == "1"
KINDS = ("mllama", "whisper")
SAMPLE = ("mllama",)
PARALLEL = int(os.environ.get("ATTNPOOL_SGLANG_CROSS_PARALLEL", "2"))
#: one JSON line per comparison, appended where this points (as the other SGLang tests)
REPORT = os.environ.get("ATTNPOOL_SGLANG_REPORT")


def _selected() -> tuple[str, ...]:
    return KINDS if FULL else SAMPLE


def _record(**row: Any) -> None:
    print(json.dumps(row))
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps(row) + "\n")


def _job(root: Path, model: Path, kind: str, backend: str) -> tuple[list[str], dict[str, str]]:
    key = f"{kind}@{backend}"
    cmd = [sys.executable, "-m", "tests.helpers.sglang_cross", "--model", str(model),
           "--kind", kind, "--backend", backend, "--out", str(root / f"{key}.json")]
    if backend == "torch_native":
        return cmd, sc.env()
    return [*cmd, "--corrupt"], sc.env(**{
        SERVED: str(root / f"{key}.served"),
        "ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE": str(root / f"{key}.corrupt")})


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every run, ``PARALLEL`` engine processes at a time: ``<kind>@<backend>`` -> the
    helper's JSON (with the pool's refill counts under ``"served"`` for attnpool's runs), or
    the process's log where it failed."""
    root = tmp_path_factory.mktemp("sglang_cross")
    models = {"mllama": sc.save_mllama, "whisper": sc.save_whisper}
    pending = [(kind, b) for kind in _selected() for b in ("attnpool", "torch_native")]
    paths = {kind: models[kind](root / "models") for kind in _selected()}
    jobs, running, out = len(pending), [], {}
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < PARALLEL:
            kind, backend = pending.pop(0)
            key = f"{kind}@{backend}"
            cmd, env = _job(root, paths[kind], kind, backend)
            with open(root / f"{key}.log", "w") as log:
                proc = subprocess.Popen(cmd, env=env, cwd=se.ROOT, stdout=log,
                                        stderr=subprocess.STDOUT)
            running.append((key, proc, time.perf_counter()))
        time.sleep(0.5)
        for item in list(running):
            key, proc, started = item
            if proc.poll() is None and time.perf_counter() - started < 900:
                continue
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            running.remove(item)
            if proc.returncode != 0:
                out[key] = (root / f"{key}.log").read_text()[-4000:]
                continue
            got = json.loads((root / f"{key}.json").read_text())
            if key.endswith("@attnpool"):
                got["served"] = Served.read_all(str(root / f"{key}.served"))
            out[key] = got
    _record(test="cross attnpool", processes=jobs, seconds=round(time.perf_counter() - t0, 1))
    yield out


def _result(results: dict[str, Any], key: str) -> dict[str, Any]:
    got = results[key]
    if isinstance(got, str):
        pytest.fail(f"the {key} engine run failed:\n{got}")
    return got  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", KINDS)
def test_cross_tokens_equal_torch_native(kind: str, results: dict[str, Any]) -> None:
    if kind not in _selected():
        pytest.skip("not in CI's sample: ATTNPOOL_SGLANG_CROSS_FULL=1 adds it")
    native = _result(results, f"{kind}@torch_native")
    ours = _result(results, f"{kind}@attnpool")
    assert native["backend"] == "torch_native" and ours["backend"] == se.NAME
    served = ours["served"]
    _record(run=f"{kind} cross", requests=len(native["tokens"]),
            identical=sum(a == b for a, b in zip(native["tokens"], ours["tokens"],
                                                 strict=True)),
            encoder_refills=served[Served.ENCODER], decode=served[Served.DECODE],
            extend=served[Served.EXTEND], encoder_lens=ours["encoder_lens"])
    assert len(native["tokens"]) >= 3
    assert ours["encoder_lens"] == native["encoder_lens"]
    if kind == "mllama":  # 10 encoder tokens an image, as SGLang counted the prompts
        assert ours["encoder_lens"] == [10 * n for n in sc.MLLAMA_IMAGES]
        assert len(set(ours["encoder_lens"])) >= 3
    else:  # whisper: fixed by the model
        assert set(ours["encoder_lens"]) == {1500}
        assert len({len(t) for t in ours["tokens"]}) >= 3
    assert len({tuple(t) for t in native["tokens"]}) == len(native["tokens"])
    assert ours["tokens"] == native["tokens"]
    # the second round (mllama: its prompts and encoder tokens from the radix cache)
    assert ours["again"] == native["again"]
    # every batch with encoder rows (each prefill and decode step) went through the encoder
    # view; mllama's text-only round (no encoder input) through the plain decode and extend
    # views, as the model skips its cross layers there
    assert served[Served.ENCODER] > 0
    if kind == "mllama":
        before, after = ours["served_before_text"], ours["served_after_text"]
        assert before[Served.ENCODER] > 0
        assert before[Served.DECODE] == before[Served.EXTEND] == 0
        assert after[Served.ENCODER] == before[Served.ENCODER]
        assert after[Served.DECODE] > 0 and after[Served.EXTEND] > 0
        assert ours["text"] == native["text"]
        # the mixed round: every batch has image rows, so all of it is encoder refills
        mixed = ours["served_after_mixed"]
        assert mixed[Served.ENCODER] > after[Served.ENCODER]
        assert (mixed[Served.DECODE], mixed[Served.EXTEND]) == (after[Served.DECODE],
                                                                after[Served.EXTEND])
        assert ours["mixed"] == native["mixed"]
        assert len({tuple(t) for t in native["mixed"]}) == len(sc.MIXED)
        # and, whatever the backend, what each request gives in a batch of its own kind: an
        # image request its first round's tokens, a text-only one those of a text-only batch
        alone = iter(ours["mixed_text_alone"])
        for got, (i, image) in zip(ours["mixed"], sc.MIXED, strict=True):
            assert got == (ours["tokens"][i] if image else next(alone)), (i, image)
        assert ours["mixed_text_alone"] == native["mixed_text_alone"]
    else:
        assert served[Served.DECODE] == served[Served.EXTEND] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_corrupted_encoder_view_changes_tokens(kind: str, results: dict[str, Any]) -> None:
    """The negative control: the same engine, its encoder view's cross lengths halved after
    each refill, gives other tokens (attention reads the view's cross part)."""
    if kind not in _selected():
        pytest.skip("not in CI's sample: ATTNPOOL_SGLANG_CROSS_FULL=1 adds it")
    ours = _result(results, f"{kind}@attnpool")
    changed = sum(a != b for a, b in zip(ours["again"], ours["corrupt"], strict=True))
    _record(run=f"{kind} cross corrupted", requests_changed=changed)
    # (the round before it, uncorrupted, repeats the first: only the corruption differs)
    assert ours["again"] == ours["tokens"]
    assert changed > 0


# --- without an engine: the refill against dense attention, the class choice, the refusals ---

H, H_KV, D, SLOTS, WIDTH = 4, 2, 32, 512, 96


def _encoder_table(rows: list[int], enc: list[int], dec: list[int]) -> torch.Tensor:
    """SGLang's layout: request ``r``'s row holds its encoder tokens, then its decoder tokens,
    on shuffled slots (slot 0 is SGLang's padding slot)."""
    table = torch.full((8, WIDTH), -1, dtype=torch.int32)
    free = torch.randperm(SLOTS - 1, generator=torch.Generator().manual_seed(3)) + 1
    at = 0
    for r, e, d in zip(rows, enc, dec, strict=True):
        table[r, :e + d] = free[at:at + e + d].to(torch.int32)
        at += e + d
    return table


@pytest.mark.parametrize("decode", [True, False])
def test_encoder_refill_is_causal_self_and_full_cross_attention(decode: bool) -> None:
    """``BatchFiller.encoder`` over SGLang's layout: each decoder query attends causally to its
    request's decoder tokens (after the encoder's, with a cached prefix), each cross query to
    all of its request's encoder tokens (none for a text-only request: output 0, as
    ``torch_native`` gives it); an extend batch's rows are its tokens."""
    from attnpool.adapters.backends import Backend
    from attnpool.integrations.sglang.step import BatchFiller, RunnerSizes, kv_pages

    from tests.helpers.dense import dense_attention

    sizes = RunnerSizes(max_requests=64, max_context_len=WIDTH, max_extend_tokens=64,
                        page_size=1, sliding_window=None, num_pages=SLOTS,
                        device=torch.device("cpu"), max_encoder_len=WIDTH - 1)
    f = BatchFiller(sizes, Backend.SDPA, H, H_KV, torch.float64)
    rows, enc, dec = [5, 0, 3, 6], [10, 30, 20, 0], [7, 1, 12, 5]
    q_lens = [1, 1, 1, 1] if decode else [3, 1, 12, 2]  # extend: prefixes of 4, 0, 0, 3
    table = _encoder_table(rows, enc, dec)
    run, cross = f.encoder(
        req_pool_indices=torch.tensor(rows), req_to_token=table, seq_lens=torch.tensor(dec),
        seq_lens_cpu=torch.tensor(dec), encoder_lens=torch.tensor(enc), encoder_lens_cpu=enc,
        extend_seq_lens=None if decode else torch.tensor(q_lens),
        extend_seq_lens_cpu=None if decode else q_lens)
    g = torch.Generator().manual_seed(1)
    k_buf = torch.randn(SLOTS, H_KV, D, dtype=torch.float64, generator=g)
    v_buf = torch.randn(SLOTS, H_KV, D, dtype=torch.float64, generator=g)
    q = torch.randn(sum(q_lens), H, D, dtype=torch.float64, generator=g)
    self_keys, cross_keys = [], []
    for r, e, d, n in zip(rows, enc, dec, q_lens, strict=True):
        for j in range(n):
            self_keys.append(table[r, e:e + d - n + j + 1].tolist())
            cross_keys.append(table[r, :e].tolist())
    k, v = kv_pages(k_buf, 1), kv_pages(v_buf, 1)
    assert cross_keys[-1] == []  # the text-only request's cross rows attend nothing
    for got_run, keys in ((run, self_keys), (cross, cross_keys)):
        ref, _ = dense_attention(q, k_buf.unsqueeze(1), v_buf.unsqueeze(1), keys, D ** -0.5)
        got = got_run(q, k, v, D ** -0.5)
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
        assert torch.isfinite(got).all()


def _layer(i: int, **kw: Any) -> Any:
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(4, 32, 32 ** -0.5, num_kv_heads=2, layer_id=i, **kw)


def _runner(layers: list[Any], page: int = 1, **kw: Any) -> SimpleNamespace:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    kv = MHATokenToKVPool(size=256, page_size=page, dtype=torch.float32, head_num=2,
                          head_dim=32, layer_num=len(layers), device="cpu",
                          enable_memory_saver=False)
    table = SimpleNamespace(req_to_token=torch.zeros(8, 512, dtype=torch.int32), size=8)
    base = {"model": nn.ModuleList(layers), "use_mla_backend": False, "token_to_kv_pool": kv,
            "req_to_token_pool": table, "page_size": page, "device": "cpu",
            "dtype": torch.float32, "server_args": SimpleNamespace(chunked_prefill_size=64,
                                                                   max_prefill_tokens=128),
            "spec_algorithm": None, "model_config": SimpleNamespace(is_encoder_decoder=True)}
    return SimpleNamespace(**(base | kw))


def test_encoder_decoder_runner_gets_the_cross_backend() -> None:
    """A runner with cross layers gets the cross backend: a pool with the encoder phase, rows
    for an extend batch's tokens; an encoder's own layers (whisper's) are not the backend's."""
    from sglang.srt.layers.radix_attention import AttentionType

    from attnpool.integrations.sglang.cross import AttnpoolCrossBackend
    from attnpool.integrations.sglang.factory import backend_for

    runner = _runner([_layer(0, attn_type=AttentionType.ENCODER_ONLY), _layer(1),
                      _layer(2, is_cross_attention=True)])
    b = backend_for(runner)
    assert type(b) is AttnpoolCrossBackend and backend_for(runner) is b
    cfg = b.filler.pool.cfg
    assert cfg.max_encoder_len == 511 and cfg.max_bs >= b.filler.sizes.max_extend_tokens
    assert b.filler.pool.encoder is not None


def test_cross_refusals(caplog: pytest.LogCaptureFixture) -> None:
    """Refused at start with every reason: pages of more than one token, sliding windows,
    cross layers of other heads, a GPU, cross layers in a model SGLang does not run as an
    encoder-decoder model (its Transformers fallback's encoder-only layers), and speculative
    decoding with cross layers (the speculative backend refuses cross attention)."""
    from attnpool.integrations.sglang.factory import backend_for

    cross = [_layer(0, sliding_window_size=8), _layer(1, is_cross_attention=True),
             _layer(2, is_cross_attention=True, v_head_dim=32)]
    cross[2].tp_q_head_num = 8
    with caplog.at_level(logging.ERROR), pytest.raises(LayoutError) as e:
        backend_for(_runner(cross, page=16, device="cuda",
                            model_config=SimpleNamespace(is_encoder_decoder=False)))
    msg = str(e.value)
    for part in ("cross attention with page_size=16", "cross attention with sliding-window",
                 "different heads or head sizes", "cross attention on cuda",
                 "not run as an encoder-decoder model"):
        assert part in msg
    assert msg in caplog.text
    spec = SimpleNamespace(is_none=lambda: False, name="EAGLE")
    with pytest.raises(LayoutError, match=r"cross attention \(encoder-decoder models"):
        backend_for(_runner([_layer(0), _layer(1, is_cross_attention=True)],
                            spec_algorithm=spec))


def test_cross_refill_checks_sglang_layout() -> None:
    """The cross backend's refill over SGLang-shaped batches: decoder slots after the encoder's,
    encoder slots first in the row, checked (a batch storing elsewhere is refused); a batch
    mixing requests with and without an encoder input goes through the encoder view too (a
    text-only request's decoder slots start its row); one without any goes the base's way (no
    cross call bound)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from attnpool.integrations.sglang.factory import backend_for

    b = backend_for(_runner([_layer(0), _layer(1, is_cross_attention=True)]))
    rows, enc, dec = [5, 0], [10, 20], [4, 2]
    table = _encoder_table(rows, enc, dec)
    b.req_to_token.copy_(table.new_zeros(b.req_to_token.shape))
    b.req_to_token[:, :WIDTH] = table

    def batch(decode: bool, **kw: Any) -> SimpleNamespace:
        q = [1, 1] if decode else [4, 2]
        fb = {"forward_mode": ForwardMode.DECODE if decode else ForwardMode.EXTEND,
              "batch_size": 2, "req_pool_indices": torch.tensor(rows),
              "seq_lens": torch.tensor(dec), "seq_lens_cpu": torch.tensor(dec),
              "encoder_lens": torch.tensor(enc), "encoder_lens_cpu": list(enc),
              "extend_seq_lens": None if decode else torch.tensor(q),
              "extend_seq_lens_cpu": None if decode else q,
              "extend_prefix_lens_cpu": None if decode else [0, 0],
              "encoder_cached": [True, True] if decode else [False, False],
              "out_cache_loc": torch.cat([table[r, e + d - n:e + d] for r, e, d, n in
                                          zip(rows, enc, dec, q, strict=True)]).long(),
              "encoder_out_cache_loc": None if decode else torch.cat(
                  [table[r, :e] for r, e in zip(rows, enc, strict=True)]).long()}
        return SimpleNamespace(**(fb | kw))

    for decode in (True, False):
        fb = batch(decode)
        b.init_forward_metadata(fb)
        assert b.run is not None and b.cross_run is not None
        with pytest.raises(LayoutError, match="out_cache_loc slots"):
            b.init_forward_metadata(batch(decode, out_cache_loc=fb.out_cache_loc.flip(0)))
    wrong = batch(False).encoder_out_cache_loc + 1
    with pytest.raises(LayoutError, match="encoder_out_cache_loc"):
        b.init_forward_metadata(batch(False, encoder_out_cache_loc=wrong))
    # request 5 text-only: its decoder tokens from column 0 of its row, its encoder slots none
    # (decode: the last decoder token of each; extend: all of them, and request 0's encoder)
    mixed = batch(True, encoder_lens=torch.tensor([0, 20]), encoder_lens_cpu=[0, 20],
                  out_cache_loc=torch.stack([table[5, dec[0] - 1], table[0, 21]]).long())
    b.init_forward_metadata(mixed)
    assert b.run is not None and b.cross_run is not None
    mixed = batch(False, encoder_lens=torch.tensor([0, 20]), encoder_lens_cpu=[0, 20],
                  out_cache_loc=torch.cat([table[5, :dec[0]], table[0, 20:20 + dec[1]]]).long(),
                  encoder_out_cache_loc=table[0, :20].long())
    b.init_forward_metadata(mixed)
    assert b.run is not None and b.cross_run is not None
    with pytest.raises(LayoutError, match="encoder_out_cache_loc"):  # (no slot for request 5)
        b.init_forward_metadata(batch(False, encoder_lens=torch.tensor([0, 20]),
                                      encoder_lens_cpu=[0, 20],
                                      out_cache_loc=mixed.out_cache_loc,
                                      encoder_out_cache_loc=table[:, :10].reshape(-1)[:30]
                                      .long()))
    with pytest.raises(LayoutError, match="out_cache_loc slots"):  # still checked
        b.init_forward_metadata(batch(True, encoder_lens=torch.tensor([0, 20]),
                                      encoder_lens_cpu=[0, 20]))
    plain = batch(True, encoder_lens_cpu=[0, 0], seq_lens=torch.tensor(dec),
                  out_cache_loc=torch.tensor([0, 0]))
    b.init_forward_metadata(plain)
    assert b.run is not None and b.cross_run is None

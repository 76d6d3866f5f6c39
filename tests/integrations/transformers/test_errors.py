"""Bad input to the transformers integration: a clear PoolError before anything runs or changes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnpool import CapacityError, InputError, LayoutError, PoolError
from attnpool.integrations.transformers import ATTN_NAME, Backend, PagedGenerator
from attnpool.integrations.transformers.attention import resolve_backend

from tests.helpers import hf_tiny

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def gen(llama: Any) -> PagedGenerator:
    return PagedGenerator(llama, max_bs=2, max_context_len=32, page_size=8)


def _untouched(gen: PagedGenerator, llama: Any) -> None:
    """A rejected call took no page or row and left the model's attention as it was."""
    assert gen.alloc.live() == () and gen.alloc.free_pages == gen.alloc.usable_pages
    assert llama.config._attn_implementation != ATTN_NAME


@pytest.mark.parametrize(("prompts", "new", "err", "match"), [
    ([[1, 2], []], 4, InputError, "prompt 1 must be a non-empty"),
    ([[1, 2], [3]], 0, InputError, "max_new_tokens must be an int >= 1, got 0"),
    ([[1, 2]], 1.5, InputError, "max_new_tokens"),
    ([list(range(30))], 3, CapacityError, r"30 tokens \+ max_new_tokens=3 must be <= max_con"),
    ([[1, hf_tiny.VOCAB]], 2, InputError, rf"token ids must be in \[0, {hf_tiny.VOCAB}\)"),
    ([[-1]], 2, InputError, "token ids"),
    ("hello", 2, InputError, "list of token-id lists"),
    ([[1], "ab"], 2, InputError, "prompt 1"),
    ([[1], [2.7, 3]], 2, InputError, "prompt 1 must be a non-empty list of integer"),
    ([[1], ["a"]], 2, InputError, "prompt 1 must be a non-empty list of integer"),
    ([[True, 2]], 2, InputError, "prompt 0 must be a non-empty list of integer"),
])
def test_bad_generate_input(gen: PagedGenerator, llama: Any, prompts: Any, new: Any,
                            err: type[PoolError], match: str) -> None:
    with pytest.raises(err, match=match):
        gen.generate(prompts, max_new_tokens=new)
    _untouched(gen, llama)


def test_integer_token_ids_of_any_kind(gen: PagedGenerator) -> None:
    """Token ids from a tensor or NumPy are taken as the ints they hold."""
    np = pytest.importorskip("numpy")
    want = gen.generate([[1, 2, 3]], max_new_tokens=3)
    assert gen.generate([[torch.tensor(1), np.int64(2), 3]], max_new_tokens=3) == want


def test_every_prompt_is_checked_before_any_runs(gen: PagedGenerator, llama: Any) -> None:
    """A bad prompt late in the list rejects the call before the good ones are generated."""
    with pytest.raises(InputError, match="prompt 2"):
        gen.generate([[1, 2], [3], []], max_new_tokens=2)
    _untouched(gen, llama)
    assert gen.stats.requests == 0


def test_head_layout_the_cache_cannot_hold() -> None:
    """4 query heads over 3 KV heads: no GQA grouping exists; refused at construction."""
    bad = hf_tiny.llama(num_key_value_heads=3)
    with pytest.raises(LayoutError, match="num_attention_heads=4, num_key_value_heads=3"):
        PagedGenerator(bad, max_bs=2, max_context_len=32)


def test_sliding_window_layers_are_served() -> None:
    """Once refused, now served through the window parts (test_families.py has every family):
    Qwen2's sliding layers give generate's tokens with a window the prompts exceed."""
    m = hf_tiny.qwen2(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    ps = hf_tiny.prompts((15, 20))
    gen = PagedGenerator(m, max_bs=2, max_context_len=48, page_size=4)
    assert gen.pool.cfg.sliding_window == 8
    assert gen.generate(ps, 10) == hf_tiny.greedy(m, ps, 10)


def test_chunked_layers_are_refused() -> None:
    m = hf_tiny.llama(layer_types=["chunked_attention", "full_attention"])
    with pytest.raises(LayoutError, match="chunked_attention"):
        PagedGenerator(m, max_bs=2, max_context_len=32)


def test_bad_construction(llama: Any) -> None:
    with pytest.raises(InputError, match="max_bs must be an int >= 1"):
        PagedGenerator(llama, max_bs=0, max_context_len=32)
    with pytest.raises(InputError, match="draft_model and num_draft_tokens"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, num_draft_tokens=2)
    with pytest.raises(InputError, match="draft_model and num_draft_tokens"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, draft_model=llama)
    other = hf_tiny.llama(vocab_size=hf_tiny.VOCAB + 1)
    with pytest.raises(InputError, match=f"expected {hf_tiny.VOCAB} tokens"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, draft_model=other,
                       num_draft_tokens=2)
    with pytest.raises(InputError, match="cuda_graphs=True needs a model on CUDA"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, cuda_graphs=True)
    with pytest.raises(InputError, match="device must be the model's device"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, device="meta")
    with pytest.raises(PoolError, match="page_size must be a power of two"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, page_size=3)
    with pytest.raises(InputError, match="must be a transformers PreTrainedModel"):
        PagedGenerator(torch.nn.Linear(2, 2), max_bs=2, max_context_len=32)


def test_a_request_larger_than_the_cache(llama: Any) -> None:
    """It could never be admitted (it would wait forever): refused up front."""
    gen = PagedGenerator(llama, max_bs=2, max_context_len=64, page_size=8, num_pages=4)
    with pytest.raises(CapacityError, match="needs 4 pages of 8, more than the 3 usable"):
        gen.generate([[1] * 20], max_new_tokens=8)
    _untouched(gen, llama)


def test_training_mode_is_refused(gen: PagedGenerator, llama: Any) -> None:
    llama.train()
    try:
        with pytest.raises(InputError, match="training mode"):
            gen.generate([[1, 2]], max_new_tokens=2)
    finally:
        llama.eval()


def test_attention_without_a_step_context(llama: Any) -> None:
    """The registered function used outside the generator says what it needs."""
    llama.set_attn_implementation(ATTN_NAME)
    try:
        with pytest.raises(InputError, match="needs the forward kwarg attnpool"), torch.no_grad():
            llama(torch.tensor([[1, 2, 3]]))
    finally:
        llama.set_attn_implementation("sdpa")


def test_an_error_mid_run_returns_every_page(gen: PagedGenerator, llama: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The model failing halfway (after prefills and decode steps) leaks no page or row."""
    calls, orig = [0], gen.target.forward

    def failing(*a: Any, **k: Any) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("model failed")
        return orig(*a, **k)

    monkeypatch.setattr(gen.target, "forward", failing)
    with pytest.raises(RuntimeError, match="model failed"):
        gen.generate([[1, 2], [3, 4, 5], [6]], max_new_tokens=6)
    _untouched(gen, llama)
    assert gen.alloc.free_rows == 2
    monkeypatch.undo()
    assert gen.generate([[1, 2]], max_new_tokens=2) == hf_tiny.greedy(llama, [[1, 2]], new=2)


def test_attention_backend_resolution(llama: Any) -> None:
    """On CPU the automatic choice is SDPA; a forced flash-attn kernel that cannot run is refused
    at construction, not at the first step."""
    cpu = torch.device("cpu")
    assert resolve_backend(Backend.AUTO, cpu, torch.float32, 16) is Backend.SDPA
    with pytest.raises(LayoutError, match="backend FA3 cannot run here"):
        resolve_backend(Backend.FA3, cpu, torch.float16, 16)
    with pytest.raises(LayoutError, match="backend FA2 cannot run here"):
        PagedGenerator(llama, max_bs=2, max_context_len=32, backend=Backend.FA2)

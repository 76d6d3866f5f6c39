"""A local transformers checkpoint for the demo and the end-to-end benchmark: find it, load it,
turn questions into prompts.

``--model`` takes a checkpoint name of :mod:`attnpool.tools.fetch` (``smollm2``: the cached
file), a GGUF file, or a folder ``from_pretrained`` reads (``config.json`` and weights, a
tokenizer when there is one). Nothing is ever downloaded here: a name that is not cached is an
error that says which command fetches it.

Loading a GGUF file dequantizes every tensor to float32 (transformers does it with the ``gguf``
package; it shows its own progress bar): the model then computes exactly like a float32
checkpoint, which is what the token-for-token comparisons need. Each stage says what it does
on stderr, with its time, since together they take seconds to tens of seconds on a CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError
from . import fetch

#: Questions the demo and the benchmark ask a chat model: short and long answers mixed, so a
#: batch's requests end at different steps (what continuous batching is for).
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 7 times 8?",
    "Write a haiku about the sea.",
    "Why is the sky blue? Answer in one sentence.",
    "Give me a synonym for happy.",
    "What does a CPU do in a computer? Explain briefly for a beginner.",
    "List two benefits of regular exercise.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water at sea level in degrees Celsius?",
    "Suggest a name for a small bakery that sells bread and cakes in a quiet village by the river.",
    "How many legs does a spider have?",
    "What is photosynthesis? Explain it simply in two sentences for a child who is ten years old.",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "Describe the taste of a lemon.",
)

#: Text the equal-length prompts are cut from (plain text, no chat template).
PASSAGE = (
    "The river wound slowly through the valley, past fields of wheat and old stone bridges. "
    "In the village by the water, the baker opened his shop before dawn, and the smell of fresh "
    "bread drifted over the square. Children ran to school along the narrow lanes, while their "
    "grandparents sat on benches and talked about the weather, the harvest and the news from "
    "the city. In the afternoon the market filled with farmers selling apples, cheese and honey, "
    "and travellers stopped to rest in the shade of the great oak tree near the church."
)


def note(msg: str) -> None:
    """Progress of long work, on stderr (stdout keeps the results)."""
    print(msg, file=sys.stderr, flush=True)


def resolve(arg: str) -> tuple[pathlib.Path, str | None, str]:
    """``(folder, gguf file name or None, display name)`` of a ``--model`` argument.

    Raises:
        InputError: a name of :data:`attnpool.tools.fetch.CHECKPOINTS` that is not cached yet
            (the message gives the fetch command), or a path that is neither a ``.gguf`` file
            nor a folder holding ``config.json``.
    """
    if arg in fetch.CHECKPOINTS:
        path = fetch.cached(arg)
        if path is None:
            raise InputError(f"--model {arg}: not in the cache ({fetch.path_of(arg)}); fetch it "
                             f"first: {fetch.FETCH_COMMAND.format(name=arg)}")
        return path.parent, path.name, arg
    p = pathlib.Path(arg).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name, p.name
    if p.is_dir() and (p / "config.json").is_file():
        return p, None, p.name
    raise InputError(f"--model must be a checkpoint name ({', '.join(sorted(fetch.CHECKPOINTS))}), "
                     f"a .gguf file or a folder with config.json; got {arg!r}")


@dataclass
class Loaded:
    """A loaded checkpoint.

    Attributes:
        model: the causal LM, in eval mode, float32 unless asked otherwise.
        tokenizer: its tokenizer, or None when the folder has none.
        name: for messages. eos: the token that ends an answer (None: run to max_new_tokens).
        load_s: seconds the load took.
    """

    model: Any
    tokenizer: Any
    name: str
    eos: int | None
    load_s: float

    @property
    def chat(self) -> bool:
        """Whether questions go through the tokenizer's chat template."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' loading logs warnings that say nothing about this run (a GGUF file's
    unused metadata, generation-config notes); its progress bars still show."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _eos(model: Any, tok: Any) -> int | None:
    ids = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(ids, (list, tuple)):
        ids = ids[0] if ids else None
    if ids is None and tok is not None:
        ids = tok.eos_token_id
    return ids if isinstance(ids, int) else None


def load(arg: str, device: torch.device, dtype: torch.dtype = torch.float32) -> Loaded:
    """Load ``--model``'s checkpoint (see :func:`resolve`) onto ``device`` in ``dtype``."""
    folder, gguf, name = resolve(arg)
    if gguf is not None and importlib.util.find_spec("gguf") is None:
        raise InputError(f"--model {arg}: reading a GGUF file needs the gguf package: "
                         "pip install 'attnpool[demo]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {} if gguf is None else {"gguf_file": gguf}
    t0 = time.perf_counter()
    with _quiet_transformers():
        note(f"loading the tokenizer of {name} ...")
        try:
            tok = AutoTokenizer.from_pretrained(folder, **extra)
        except (OSError, ValueError):
            tok = None  # a weights-only folder: prompts must then be token ids
        what = "dequantizing the GGUF tensors to " if gguf else "loading the weights as "
        note(f"{what}{str(dtype).removeprefix('torch.')} ...")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0
    note(f"loaded {name} in {load_s:.1f}s")
    return Loaded(model, tok, name, _eos(model, tok), load_s)


def prompts_of(loaded: Loaded, questions: Sequence[str]) -> list[list[int]]:
    """Token ids of each question: through the chat template (one user turn, the assistant's
    turn opened) for a chat model, plain text otherwise."""
    tok = loaded.tokenizer
    if tok is None:
        raise InputError(f"{loaded.name} has no tokenizer: text questions cannot be encoded")
    if loaded.chat:
        return [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, return_dict=False))
                for q in questions]
    return [list(tok(q)["input_ids"]) for q in questions]


def equal_prompts(loaded: Loaded, count: int, length: int) -> list[list[int]]:
    """``count`` plain-text prompts of exactly ``length`` tokens: consecutive windows of
    :data:`PASSAGE` (repeated as needed)."""
    if loaded.tokenizer is None:
        raise InputError(f"{loaded.name} has no tokenizer: text prompts cannot be encoded")
    ids: list[int] = list(loaded.tokenizer(PASSAGE)["input_ids"])
    while len(ids) < count * length:
        ids += ids
    return [ids[i * length : (i + 1) * length] for i in range(count)]

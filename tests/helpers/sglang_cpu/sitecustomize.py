"""Hooks for the SGLang tests and benchmark, loaded by every Python process started with this
folder on ``PYTHONPATH`` (SGLang's scheduler included). Without their variables nothing is
imported or changed.

- ``ATTNPOOL_SGLANG_CORRUPT=1`` (the tests' negative control): each decode refill of
  attnpool's pool is followed by one wrong value, the first row's ``cache_seqlens`` shortened
  by one (its newest key dropped), so that tokens change if and only if attention reads the
  pool.
- ``ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE=<file>`` (the speculative tests' negative control for
  attnpool): while that file exists and holds ``verify`` or ``draft``, each refill of
  attnpool's ``pool.verify`` (or ``pool.draft``) is followed by one wrong field, the real
  requests' lengths in the view's prefix part (``cache_seqlens``, the first draft step's)
  shortened by one: each request's newest key dropped (the newest committed one; a chain's
  newest draft); ``encoder``: each refill of ``pool.encoder`` (an encoder-decoder model's
  batches) is followed by its cross part's lengths halved (each query row loses the second half
  of its request's encoder keys). The file is read
  at every refill, so a running engine can be switched. (SGLang's own path reads the same
  file: ``self`` / ``prefix`` corrupt its stand-in's draft table, ``sgl_kernel/_spec.py``.)
- ``ATTNPOOL_SGLANG_TIMES=<file>`` (the benchmarks): the host time of the attention backend
  (SGLang's ``torch_native`` or ``intel_amx``, or attnpool's) per forward: its
  ``init_forward_metadata`` and its layers' ``forward_decode`` / ``forward_extend`` (K/V store
  and attention). The file holds ``{"<metadata|attention> <kind> <requests>": [calls,
  seconds]}``, ``kind`` being ``decode`` / ``extend`` for plain batches, ``target_verify``,
  ``draft_extend_v2``, or ``draft_decode`` for the draft model's multi-step decode (one metadata
  call for all its steps); totals since the engine started, over every timed class of the
  process, rewritten after every metadata call (the scheduler process is stopped, not exited,
  so nothing is left for an exit hook; a reader diffs two readings). The classes are wrapped
  when their modules are first imported (an import hook), so SGLang is not imported any
  earlier than it would be.
- ``ATTNPOOL_SGLANG_AMX=1`` (the speculative-decoding reference): the platform override
  ``override_platform(has_amx=True)``, installed as soon as ``sglang.srt.runtime_context`` is
  imported, in every process. Without it SGLang replaces ``attention_backend="intel_amx"``
  (its own CPU path, the one that serves speculative decoding) by ``torch_native`` on a CPU
  without AMX (``arg_groups/overrides.py``). Weight packing and SGLang's fused CPU layers ask
  the CPU itself (``cpu_has_amx_support``) and stay off.
- ``ATTNPOOL_SGLANG_SPEC_PROBE=<file>`` (facts for attnpool's speculative views): what reaches
  SGLang's ``intel_amx`` backends, one JSON line per call of ``init_forward_metadata`` (the
  target's and the draft's backends, and the draft's multi-step decode backend): the model
  (target or draft), forward mode, batch size, the shapes (and, for small ones, values) of the
  batch's index fields and of ``spec_info``'s fields. At most 4 lines per (backend, model,
  mode, batch size).
- ``ATTNPOOL_SGLANG_MLLAMA_MASK=1`` (the cross-attention tests): SGLang's mllama text-row
  mask of a prefill mixing image and text-only requests, corrected (``mllama_mask.py``: SGLang
  masks the wrong rows there), in every engine process, the reference's included.
- ``ATTNPOOL_SGLANG_NO_PIN=1`` (the LoRA tests and benchmark): ``pin_memory`` a no-op on a
  machine without CUDA (``no_pin.py``), in SGLang's LoRA modules as they are imported: its LoRA
  code pins host tensors on every device, which torch refuses without an NVIDIA driver. A test
  stand-in, changing no value.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

if os.environ.get("ATTNPOOL_SGLANG_CORRUPT") == "1":
    from attnpool.integrations.sglang import step as _step

    _fill = _step.BatchFiller.fill

    def _corrupted(self: Any, **kw: Any) -> Any:
        run = _fill(self, **kw)
        if kw["decode"]:
            run.view.cache_seqlens[0] -= 1
        return run

    _step.BatchFiller.fill = _corrupted  # type: ignore[method-assign]

def _corrupt_spec(module: ModuleType, flag: str) -> None:
    """The negative control of attnpool's speculative views (module doc)."""
    filler = module.BatchFiller

    def which() -> str | None:
        if not os.path.exists(flag):
            return None
        with open(flag) as f:
            return f.read().strip()

    verify, draft = filler.verify, filler.draft

    def corrupted_verify(self: Any, **kw: Any) -> Any:
        run = verify(self, **kw)
        if which() == "verify":
            run.view.prefix.cache_seqlens[:kw["seq_lens"].shape[0]] -= 1
        return run

    def corrupted_draft(self: Any, **kw: Any) -> Any:
        runs = draft(self, **kw)
        if which() == "draft" and runs:
            runs[0].view.prefix.cache_seqlens[:kw["seq_lens"].shape[0]] -= 1
        return runs

    encoder = filler.encoder

    def corrupted_encoder(self: Any, **kw: Any) -> Any:
        runs = encoder(self, **kw)
        if which() == "encoder":
            runs[1].view.cache_seqlens.floor_divide_(2)
        return runs

    filler.verify, filler.draft, filler.encoder = (corrupted_verify, corrupted_draft,
                                                   corrupted_encoder)


#: module -> the attention backend classes timed there; a subclass that keeps its base's
#: methods (attnpool's speculative backend) is timed through the base
_TIMED = {"sglang.srt.layers.attention.torch_native_backend": ("TorchNativeAttnBackend",),
          "sglang.srt.layers.attention.intel_amx_backend": ("IntelAMXAttnBackend",
                                                           "IntelAMXMultiStepDraftBackend"),
          "attnpool.integrations.sglang.backend": ("AttnpoolAttnBackend",),
          "attnpool.integrations.sglang.spec": ("AttnpoolDraftSteps", "AttnpoolDraftStep")}
#: the draft model's multi-step decode backends: one metadata call serves every draft step
_DRAFT_STEPS = ("IntelAMXMultiStepDraftBackend", "AttnpoolDraftSteps")
#: every timed class's totals, one dict for the process (one file holds them all)
_TOTALS: dict[str, list[float]] = {}


def _kind(forward_batch: Any, cls_name: str) -> str:
    """``decode`` / ``extend`` for a plain batch, ``draft_decode`` for the draft model's
    multi-step decode, else the forward mode's name (``target_verify``, ``draft_extend_v2``)."""
    if cls_name in _DRAFT_STEPS:
        return "draft_decode"
    mode = forward_batch.forward_mode
    if mode.is_decode():
        return "decode"
    return "extend" if mode.name == "EXTEND" else str(mode.name).lower()


def _time_backend(cls: Any, path: str) -> None:
    name = cls.__name__

    def add(what: str, forward_batch: Any, dt: float) -> None:
        key = f"{what} {_kind(forward_batch, name)} {forward_batch.batch_size}"
        row = _TOTALS.setdefault(key, [0, 0.0])
        row[0] += 1
        row[1] += dt

    metadata = cls.init_forward_metadata

    def timed_metadata(self: Any, forward_batch: Any) -> Any:
        t = time.perf_counter()
        out = metadata(self, forward_batch)
        add("metadata", forward_batch, time.perf_counter() - t)
        with open(path, "w") as f:
            json.dump(_TOTALS, f)
        return out

    cls.init_forward_metadata = timed_metadata
    if name in _DRAFT_STEPS:  # (its steps' layers are timed in their own backend class)
        return

    def timing(orig: Any) -> Any:
        def timed_layer(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                        *args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = orig(self, q, k, v, layer, forward_batch, *args, **kw)
            add("attention", forward_batch, time.perf_counter() - t)
            return out

        return timed_layer

    for method in ("forward_decode", "forward_extend"):
        setattr(cls, method, timing(getattr(cls, method)))


def _describe(value: Any) -> Any:
    """A JSON-able summary: a tensor's shape and dtype, with its values when it is small."""
    import torch

    if isinstance(value, torch.Tensor):
        out: dict[str, Any] = {"shape": list(value.shape), "dtype": str(value.dtype)[6:]}
        if value.numel() <= 64:
            out["values"] = value.tolist()
        return out
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        return [_describe(v) for v in value]
    return type(value).__name__


#: the ForwardBatch fields an attention backend reads
_BATCH_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "seq_lens_sum",
                 "out_cache_loc", "extend_seq_lens", "extend_prefix_lens", "extend_start_loc",
                 "extend_num_tokens", "encoder_lens")


def _probe(module: ModuleType, path: str) -> None:
    seen: dict[tuple[Any, ...], int] = {}

    def record(backend: Any, fb: Any) -> None:
        draft = getattr(backend, "_attnpool_probe_draft", None)
        key = (type(backend).__name__, draft, fb.forward_mode.name, fb.batch_size)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 4:
            return
        row: dict[str, Any] = {"backend": key[0], "model": {True: "draft", False: "target"}.get(
            draft, "?"), "mode": key[2], "bs": key[3]}
        row.update({f: _describe(getattr(fb, f, None)) for f in _BATCH_FIELDS})
        spec = fb.spec_info
        if spec is not None:
            row["spec_info"] = {"type": type(spec).__name__, **{
                k: _describe(v) for k, v in sorted(vars(spec).items())
                if not k.startswith("_")}}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")

    for name in ("IntelAMXAttnBackend", "IntelAMXMultiStepDraftBackend"):
        cls = getattr(module, name)
        init, meta = cls.__init__, cls.init_forward_metadata

        def probed_init(self: Any, model_runner: Any, *a: Any, _init: Any = init,
                        **kw: Any) -> None:
            _init(self, model_runner, *a, **kw)
            self._attnpool_probe_draft = bool(getattr(model_runner, "is_draft_worker", False))

        def probed_meta(self: Any, fb: Any, _meta: Any = meta) -> Any:
            record(self, fb)
            return _meta(self, fb)

        cls.__init__ = probed_init
        cls.init_forward_metadata = probed_meta

    # per layer-0 attention call: the query rows and the metadata the kernels get
    def probed(method: str) -> Any:
        orig = getattr(module.IntelAMXAttnBackend, method)

        def probed_forward(self: Any, q: Any, k: Any, v: Any, layer: Any, fb: Any, *a: Any,
                           **kw: Any) -> Any:
            draft = getattr(self, "_attnpool_probe_draft", None)
            key = (method, draft, fb.forward_mode.name, fb.batch_size)
            if layer.layer_id == 0 and seen.setdefault(key, 0) < 4:
                seen[key] += 1
                row = {"call": method, "model": {True: "draft", False: "target"}.get(
                    draft, "?"), "mode": key[2], "bs": key[3], "q": list(q.shape),
                    "positions": _describe(fb.positions),
                    "out_cache_loc": _describe(fb.out_cache_loc),
                    "extend_metadata": _describe(self.extend_metadata),
                    "draft_decode_metadata": _describe(
                        None if self.draft_decode_metadata is None else
                        self.draft_decode_metadata[1:])}
                with open(path, "a") as f:
                    f.write(json.dumps(row) + "\n")
            return orig(self, q, k, v, layer, fb, *a, **kw)

        return probed_forward

    for method in ("forward_extend", "forward_decode"):
        setattr(module.IntelAMXAttnBackend, method, probed(method))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of :data:`_AFTER` it lets the real finder load it,
    then runs that module's hooks on it."""

    def find_spec(self, name: str, target: Any = None, target2: Any = None) -> Any:
        if name not in _AFTER:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        hooks = _AFTER[name]

        class Hooked(importlib.abc.Loader):
            def create_module(self, s: Any) -> ModuleType | None:
                return loader.create_module(s)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                for hook in hooks:
                    hook(module)

        spec.loader = Hooked()
        return spec


#: module name -> what runs on the module once it is imported
_AFTER: dict[str, list[Callable[[ModuleType], None]]] = {}

if os.environ.get("ATTNPOOL_SGLANG_TIMES"):
    for _name, _classes in _TIMED.items():
        for _cls in _classes:
            _AFTER.setdefault(_name, []).append(
                lambda m, c=_cls: _time_backend(getattr(m, c), os.environ["ATTNPOOL_SGLANG_TIMES"]))

if os.environ.get("ATTNPOOL_SGLANG_AMX") == "1":
    _AFTER.setdefault("sglang.srt.runtime_context", []).append(
        lambda m: m.override_platform(has_amx=True).install())

if os.environ.get("ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE"):
    _AFTER.setdefault("attnpool.integrations.sglang.step", []).append(
        lambda m: _corrupt_spec(m, os.environ["ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE"]))

if os.environ.get("ATTNPOOL_SGLANG_SPEC_PROBE"):
    _AFTER.setdefault("sglang.srt.layers.attention.intel_amx_backend", []).append(
        lambda m: _probe(m, os.environ["ATTNPOOL_SGLANG_SPEC_PROBE"]))

if os.environ.get("ATTNPOOL_SGLANG_MLLAMA_MASK") == "1":
    import mllama_mask

    _AFTER.setdefault("sglang.srt.models.mllama", []).append(mllama_mask.fix)

if os.environ.get("ATTNPOOL_SGLANG_NO_PIN") == "1":
    import no_pin

    for _name in no_pin.MODULES:
        _AFTER.setdefault(_name, []).append(no_pin.unpin_module)

if _AFTER:
    import importlib.util

    sys.meta_path.insert(0, _AfterImport())

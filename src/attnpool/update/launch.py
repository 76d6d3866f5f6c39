"""One fused kernel launch, assembled by argument name once and replayed with new inputs.

A fused wrapper (:mod:`.triton.paged`, :mod:`.triton.tree`, :mod:`.triton.draft`, ...) checks a part's
buffers and inputs and names every argument of its kernel; :class:`Launch` puts them in the
kernel's own parameter order (read from the jit function's ``arg_names`` on the first assembly of
each kernel, then cached), so no wrapper spells a position. A phase keeps the launch per batch
shape (:mod:`.launch_cache`) and replays it with each update's values: only the inputs the wrapper
declared replayable change, read from the phase's value record by name (:func:`record_paths`).

Launch recorders: ``attnpool kernels`` (:mod:`attnpool.tools.kernels`) enumerates every kernel
specialization the pools can launch, to compile each for a GPU target. It registers a
:class:`LaunchRecorder` for the duration of its enumeration (:func:`recording`); every launch
assembled meanwhile, and every KV store launch (:mod:`attnpool.kv.store_kernels`), is shown to it
and skipped when it says so. Read once per *assembled* launch, never per replay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache, partial
from typing import Any, NamedTuple, Protocol

from torch import Tensor

from .buffers import PagedBuffers


class LaunchRecorder(Protocol):
    """Shown every launch assembled while registered: the kernel, its grid, its arguments in
    parameter order and its launch options (``num_warps``...). True skips the launch (the
    recorder wants the arguments, not the bytes)."""

    def __call__(self, kernel: Any, grid: tuple[int, ...], args: tuple[object, ...],
                 options: dict[str, Any], /) -> bool: ...


_recorder: LaunchRecorder | None = None


def launch_recorder() -> LaunchRecorder | None:
    """The registered recorder (:func:`recording`), else None."""
    return _recorder


@contextmanager
def recording(recorder: LaunchRecorder | None) -> Iterator[LaunchRecorder | None]:
    """Register ``recorder`` while the block runs (None: none); the previous one comes back
    after, so registrations nest."""
    global _recorder
    previous, _recorder = _recorder, recorder
    try:
        yield recorder
    finally:
        _recorder = previous


def record_launch(kernel: Any, grid: tuple[int, ...], args: tuple[object, ...],
                  options: dict[str, Any]) -> bool:
    """Show a launch to the registered recorder; True when it asks to skip the launch."""
    return _recorder is not None and _recorder(kernel, grid, args, options)


@cache
def _positions(names: tuple[str, ...]) -> dict[str, int]:
    """Parameter name -> position, per kernel signature (computed once)."""
    return {name: i for i, name in enumerate(names)}


def _skip(*args: object, **kw: object) -> None:
    """A launch the recorder asked not to run."""


def _untaken(values: tuple[Any, ...]) -> None:
    """A launch's replay before :meth:`Launch.take` said where each input is."""
    raise TypeError("Launch.replay needs take() first: it says where each input is")


class RecordPaths(NamedTuple):
    """Where a replay reads each input in a phase's value record: ``(target, field)`` pairs,
    ``from_inputs`` in the record's first field (the phase's checked shared inputs,
    ``attnpool.phases.inputs_pass.Inputs``), ``from_record`` in the record itself."""

    from_inputs: tuple[tuple[Any, int], ...]
    from_record: tuple[tuple[Any, int], ...]


def record_paths(values: tuple[Any, ...], wanted: Iterable[tuple[Any, str]],
                 alias: Mapping[str, str]) -> RecordPaths:
    """Resolve replayable inputs by name in a phase's value record ``values`` (a NamedTuple
    whose first field is a NamedTuple of shared inputs). ``wanted``: ``(target, input name)``
    pairs, the target being where the replay puts it (an argument position, a keyword);
    ``alias``: input name -> its name in the record where the two differ. A name found nowhere
    is a wiring error, raised when the launch is assembled, never a wrong byte."""
    own: tuple[str, ...] = type(values)._fields  # type: ignore[attr-defined]
    shared: tuple[str, ...] = type(values[0])._fields
    from_inputs, from_record = [], []
    for target, name in wanted:
        field = alias.get(name, name)
        if field in own:
            from_record.append((target, own.index(field)))
        elif field in shared:
            from_inputs.append((target, shared.index(field)))
        else:
            raise TypeError(f"{type(values).__name__} has no field {field!r} for input {name!r}")
    return RecordPaths(tuple(from_inputs), tuple(from_record))


def replayable(**given: tuple[str, object]) -> dict[str, str]:
    """``parameter -> input name`` of the replayable inputs that were given (``(name, value)``
    per kernel parameter; absent optional inputs stay the dummies the launch was built with)."""
    return {param: name for param, (name, value) in given.items() if value is not None}


class Launch:
    """One kernel launch with every argument resolved, replayable with new inputs.

    ``args`` names every parameter of ``kernel`` (constexprs included: they go positionally,
    since expanding a dozen keywords at every launch costs about as much as the rest of the
    replay); ``options`` are launch options (``num_warps``, ``maxnreg``). ``inputs`` maps the
    kernel parameters a replay may change to the wrapper's input names (the real row count
    ``n`` and the caller's tensors that were given); :meth:`take` then says where each one is
    in the phase's value record.
    """

    __slots__ = ("args", "fn", "from_inputs", "from_record", "inputs", "live", "options",
                 "replay", "replayed")

    def __init__(self, kernel: Any, grid: tuple[int, ...], args: Mapping[str, object],
                 options: dict[str, Any], inputs: Mapping[str, str]) -> None:
        names = tuple(kernel.arg_names)
        if args.keys() != set(names):
            raise TypeError(f"{getattr(kernel, '__name__', kernel)} takes {sorted(names)}; "
                            f"missing {sorted(set(names) - args.keys())}, unknown "
                            f"{sorted(args.keys() - set(names))}")
        at = _positions(names)
        self.args = tuple(args[name] for name in names)
        self.options = options
        #: replayable input name -> argument position (a name may feed several positions)
        self.inputs: dict[str, list[int]] = {}
        for param, name in inputs.items():
            self.inputs.setdefault(name, []).append(at[param])
        #: (argument position, field) of each replayed input: see :func:`record_paths`
        self.from_inputs: tuple[tuple[Any, int], ...] = ()
        self.from_record: tuple[tuple[Any, int], ...] = ()
        #: the argument list a replay fills in place (see :meth:`__call__`), and the positions
        #: it fills
        self.live = list(self.args)
        self.replayed: tuple[int, ...] = ()
        self.fn: Callable[..., object] = (
            _skip if record_launch(kernel, grid, self.args, options) else kernel[grid])
        #: the per-update call once :meth:`take` has run (see :func:`replay_function`)
        self.replay: Callable[[tuple[Any, ...]], None] = _untaken

    def take(self, values: tuple[Any, ...], **alias: str) -> Launch:
        """Read the replayed inputs from value records shaped like ``values`` (``alias``:
        input -> its name there, e.g. ``seq_lens="encoder_lens"``). After this the launch must
        be called with values (the built-in inputs are released)."""
        self.from_inputs, self.from_record = record_paths(
            values, [(pos, name) for name, ps in self.inputs.items() for pos in ps], alias)
        # Every replay supplies these: drop the binding call's tensors, so a cached launch never
        # keeps a caller's (possibly large, since replaced) table alive.
        self.replayed = tuple(p for p, _ in self.from_inputs + self.from_record)
        a = list(self.args)
        for p in self.replayed:
            a[p] = None
        self.args = tuple(a)
        self.live = a
        self.replay = replay_function(a, self.fn, self.options, self.from_inputs,
                                      self.from_record)
        return self

    def __call__(self, values: tuple[Any, ...] | None = None) -> None:
        """Launch, with the inputs of :meth:`take` read from ``values`` (None: as built). A
        phase calls :attr:`replay` directly (one frame less)."""
        if values is None:
            self.fn(*self.args, **self.options)
        else:
            self.replay(values)

    def bound(self, values: tuple[Any, ...]) -> Callable[[], object]:
        """The launch with ``values`` fixed: a no-argument callable (a bound update's replay)."""
        a = list(self.args)
        for p, i in self.from_inputs:
            a[p] = values[0][i]
        for p, i in self.from_record:
            a[p] = values[i]
        return partial(self.fn, *a, **self.options)


def replay_function(live: list[object], fn: Callable[..., object], options: dict[str, Any],
                    from_inputs: tuple[tuple[Any, int], ...],
                    from_record: tuple[tuple[Any, int], ...]
                    ) -> Callable[[tuple[Any, ...]], None]:
    """The hot path of every fused update, as one function written for this launch: it stores
    each replayed input into ``live`` (the launch's argument list, kept for the purpose: a
    fresh copy of ~75 arguments per launch costs more than the stores), launches, and clears
    the stored inputs again, so a cached launch keeps no caller's tensor alive.

    The positions are written into its source as integer literals, which is why it is
    generated (as ``dataclasses`` and ``namedtuple`` generate theirs): a loop over ``(position,
    field)`` pairs costs about a third of a small torch op more per launch, a figure of the
    host-cost budget (``attnpool bench --host``). Only integers are interpolated; ``live``,
    ``fn`` and ``options`` are bound as globals of the function."""
    lines = ["def replay(values):"]
    if from_inputs:
        lines.append("    inputs = values[0]")
    lines += [f"    live[{int(p)}] = inputs[{int(i)}]" for p, i in from_inputs]
    lines += [f"    live[{int(p)}] = values[{int(i)}]" for p, i in from_record]
    stored = [int(p) for p, _ in from_inputs + from_record]
    if stored:
        lines += ["    try:", "        fn(*live, **options)", "    finally:",
                  "        " + " = ".join(f"live[{p}]" for p in stored) + " = None"]
    else:
        lines.append("    fn(*live, **options)")
    scope: dict[str, Any] = {"live": live, "fn": fn, "options": options}
    exec(compile("\n".join(lines), f"<attnpool replay of {len(stored)} inputs>", "exec"),
         scope)
    replay: Callable[[tuple[Any, ...]], None] = scope["replay"]
    return replay


def pointer_or(t: Tensor | None, dummy: Tensor) -> Tensor:
    """An optional pointer argument: the tensor, else a dummy the kernel never reads (its flag
    is off)."""
    return dummy if t is None else t


def part_pointers(b: PagedBuffers, dummy: Tensor, prefix: str = "") -> dict[str, Tensor]:
    """The pointer arguments of a part's buffers (absent layouts: the dummy)."""
    return {f"{prefix}cache_ptr": b.cache_seqlens, f"{prefix}cuk_ptr": b.cu_seqlens_k,
            f"{prefix}pt_ptr": pointer_or(b.page_table, dummy),
            f"{prefix}indptr_ptr": pointer_or(b.kv_indptr, dummy),
            f"{prefix}indices_ptr": pointer_or(b.kv_indices, dummy),
            f"{prefix}last_ptr": pointer_or(b.kv_last_page_len, dummy)}

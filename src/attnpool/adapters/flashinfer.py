"""FlashInfer adapter: CUDA-graph wrappers on the pool's FLASHINFER buffers, planned from views.

FlashInfer's wrappers in CUDA-graph mode (``use_cuda_graph=True``) keep the CSR buffers they were
constructed with (``kv_indptr [bs+1]``, ``kv_indices``, ``kv_last_page_len [bs]``, and for prefill
``qo_indptr [bs+1]``) and their batch size is fixed for life. A graph captured with a wrapper bakes
those addresses, so :class:`GraphWrappers` builds **one wrapper per (part, captured bs)** directly
on the view's tensors: slices of the same arena buffers, never copies. Before each replay the
phase's ``update_`` refills those slices and :meth:`GraphWrappers.plan` re-plans the wrapper from
the same view (FlashInfer's plan reads the CSR on the host: it syncs, and must run outside the
graph). Plan copies its arguments into the wrapper's buffers; since the arguments *are* those
buffers (same data, same offset) the copies are no-ops and nothing in the pool is rewritten.

Which wrapper: rows with one query each (``max_seqlen_q == 1``: decode, tree expand rows, encoder
cross, local decode) use ``BatchDecodeWithPagedKVCacheWrapper``; every other part (verify, tree
prefix passes with N or K queries, draft extend, local verify) uses
``BatchPrefillWithPagedKVCacheWrapper`` with ``qo_indptr = cu_seqlens_q`` and ``causal =
view.causal``.

Query rows: a decode wrapper computes exactly ``bs`` rows (its ``run`` reads a ``q`` of ``2 * bs``
rows or more as several queries per row and refuses it); a prefill wrapper's ``run`` requires
``q.shape[0] == qo_indptr[-1]`` of its latest plan. :func:`run` therefore passes ``q[:rows]``
(``rows`` = ``bs``, or the planned ``cu_seqlens_q[bs]``) and returns ``q.shape[0]`` rows, those
past ``rows`` holding 0 and ``lse = -inf`` like positions no row covers in the SDPA adapter. So
``q`` may be the padded query buffer of a captured batch, as with the other adapters.

CUDA graphs and row counts: in CUDA-graph mode a prefill wrapper takes its *first* plan's
``qo_indptr[-1]`` as the most rows any later plan may have (a larger one raises), and the graph
captured with it computes whatever count each later plan has, up to that. The pool's capture
states give every prefill part its largest count (``bs * N`` queries for verify, draft extend and
local verify, ``bs * K`` for a draft tree's prefix pass), so plan the capture view first.
Plans with fewer rows are fine: the rows past the planned count are not computed on replay.

The float workspace must be zeroed before its first use (FlashInfer's documented requirement; a
``torch.empty`` buffer holds garbage): :class:`GraphWrappers` zeroes it once at construction.

K and V of different head sizes (``D != Dv``, ``KVCacheConfig(head_dim_v=)``): the prefill
wrapper's ``plan`` takes ``head_dim_qk`` and ``head_dim_vo`` (FlashInfer picks a backend that has
the pair), so :func:`plan` passes ``head_dim_vo`` from its ``head_dim_v``. The decode wrapper's
``plan`` takes one ``head_dim`` (its kernels, and its tensor-core path, use it for both), so a
decode part of such a cache is refused with :class:`attnpool.LayoutError` and planned on a prefill
wrapper instead: ``make_wrapper(kind=WrapperKind.PREFILL)``, or ``GraphWrappers(prefill_only=
True)`` (decode views carry ``cu_seqlens_q = arange(bs + 1)``, which the prefill wrapper takes as
its ``qo_indptr``). The ``cute-dsl`` backend requires equal sizes and is refused for them too.

Outputs follow the adapters' convention (``out [total_q, H, Dv]``, natural-log ``lse [total_q,
H]``): FlashInfer returns a base-2 log-sum-exp, which is multiplied by ``ln 2`` here.

fp8 KV caches (``float8_e4m3fn`` or ``float8_e5m2``, queries in the model dtype): plan with
``kv_dtype=`` the cache's dtype (the wrapper checks the cache against it at run) and pass the
cache's scales to :func:`run` as ``k_scale`` / ``v_scale`` *Python floats*, which is what
FlashInfer's ``run`` takes: it multiplies ``k_scale`` into the softmax scale on the host and the
output by ``v_scale`` after the kernel, so a captured graph bakes both values. Device scales are
therefore read to the host once, at model load (:func:`attnpool.adapters.fp8.host_scales`, one
sync per layer), never in the step loop; changing a scale later means capturing again. FlashInfer
has no per-head form of these arguments: per-head scales are refused (the SDPA and FA3 adapters
read them).

Wrapper classes are imported lazily from ``flashinfer``; ``decode_cls`` / ``prefill_cls`` inject
others (tests use fakes that enforce FlashInfer's checks on CPU).
"""

from __future__ import annotations

import enum
import math
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, LayoutError
from ..views import PagedView
from .fp8 import float_scales
from .merge import Attn, run_passes
from .sdpa.checks import check_qkv, softmax_scale_of
from .sdpa.gather import cache_as_pages
from .variants import check_sinks, check_softcap, sink_argument

#: FlashInfer backends whose ``run`` applies ``sinks`` (the others drop the argument)
SINK_BACKENDS = ("trtllm-gen", "cute-dsl")


class WrapperKind(enum.Enum):
    """FlashInfer wrapper family for a part."""

    DECODE = "BatchDecodeWithPagedKVCacheWrapper"
    PREFILL = "BatchPrefillWithPagedKVCacheWrapper"


def wrapper_kind(view: PagedView) -> WrapperKind:
    """DECODE for one query per row (``max_seqlen_q == 1``), else PREFILL."""
    return WrapperKind.DECODE if view.max_seqlen_q == 1 else WrapperKind.PREFILL


def csr_lists(view: object, reader: str = "FlashInfer") -> tuple[Tensor, Tensor, Tensor]:
    """A paged part's CSR page lists ``(kv_indptr, kv_indices, kv_last_page_len)``: what every
    FlashInfer wrapper's ``plan`` reads. Refused (``reader`` names the wrapper in the message)
    for anything but a :class:`~attnpool.PagedView`, or one of a pool built without them
    (``Layout.FLASH_ATTN``)."""
    if not isinstance(view, PagedView):
        raise InputError(f"expected a PagedView part, got {type(view).__name__}")
    if view.kv_indptr is None or view.kv_indices is None or view.kv_last_page_len is None:
        raise LayoutError(f"{reader} reads CSR page lists: expected a view with kv_indptr, "
                          "kv_indices and kv_last_page_len (Layout.FLASHINFER), got one without")
    return view.kv_indptr, view.kv_indices, view.kv_last_page_len


def _cls(kind: WrapperKind, given: type[Any] | None) -> type[Any]:
    if given is not None:
        return given
    import flashinfer  # lazy: importing attnpool never imports flashinfer

    return getattr(flashinfer, kind.value)  # type: ignore[no-any-return]


def make_wrapper(
    view: PagedView,
    workspace: Tensor,
    *,
    kind: WrapperKind | None = None,
    kv_layout: str = "NHD",
    use_tensor_cores: bool = False,
    wrapper_cls: type[Any] | None = None,
    backend: str | None = None,
    graph: bool = True,
) -> Any:
    """A CUDA-graph FlashInfer wrapper whose buffers are ``view``'s CSR tensors (``graph``),
    or an eager one, whose batch size and row count are free (each ``plan`` takes the view's
    tensors as they are, without copying them on a device that holds them).

    Args:
        view: a part from ``pool.<phase>.view(bs)`` (call before capture).
        workspace: FlashInfer's float workspace (uint8, typically 128 MiB), shared by wrappers
            that never run concurrently.
        kind: wrapper family (default :func:`wrapper_kind`).
        kv_layout: ``"NHD"`` for a cache ``[num_pages, P, H_kv, D]`` (the adapters' layout).
        use_tensor_cores: decode wrappers only.
        wrapper_cls: the class to build (default: from ``flashinfer``).
        backend: FlashInfer's ``backend=`` (default: FlashInfer's own); models with attention
            sinks need one of :data:`SINK_BACKENDS`.
        graph: build a CUDA-graph wrapper (False: an eager one, for steps no graph replays).
    """
    indptr, indices, last = csr_lists(view)
    kind = kind or wrapper_kind(view)
    cls = _cls(kind, wrapper_cls)
    extra: dict[str, Any] = {} if backend is None else {"backend": backend}
    if not graph:
        if kind is WrapperKind.DECODE:
            return cls(workspace, kv_layout, use_tensor_cores=use_tensor_cores, **extra)
        return cls(workspace, kv_layout, **extra)
    if kind is WrapperKind.DECODE:
        return cls(workspace, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                   paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                   paged_kv_last_page_len_buffer=last, **extra)
    return cls(workspace, kv_layout, use_cuda_graph=True, qo_indptr_buf=view.cu_seqlens_q,
               paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices,
               paged_kv_last_page_len_buf=last, **extra)


def planned_rows(view: PagedView, kind: WrapperKind | None = None) -> int:
    """Query rows a wrapper planned on ``view`` computes: ``bs`` (decode), else
    ``cu_seqlens_q[bs]``, read on the host (one device sync; :func:`plan` syncs anyway)."""
    if (kind or wrapper_kind(view)) is WrapperKind.DECODE:
        return view.bs
    return int(view.cu_seqlens_q[view.bs])


def plan(wrapper: Any, view: PagedView, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
         q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None, sm_scale: float | None = None,
         kind: WrapperKind | None = None, rows: int | None = None, softcap: float = 0.0,
         head_dim_v: int | None = None) -> int:
    """Plan ``wrapper`` (built by :func:`make_wrapper` on this view's buffers) for the batch the
    view now holds; return the query rows it will compute (``rows`` if given, else
    :func:`planned_rows`). Host-side and syncing: call after ``update_``, before replay.

    ``kv_dtype``: the cache's dtype when it differs from ``q_dtype`` (an fp8 cache), default
    ``q_dtype``. ``window_left`` is the view's (-1, or ``W - 1`` for a sliding-window part):
    FlashInfer fixes it at plan time (``run`` may only repeat it), so a window part has its own
    wrapper and plan (:class:`GraphWrappers` keys wrappers by the part's buffers). ``softcap``
    (0: off) is FlashInfer's ``logits_soft_cap``, also fixed at plan time. ``head_dim_v``: V's
    head size when it differs from ``head_dim`` (passed as the prefill plan's ``head_dim_vo``;
    ``None`` or ``head_dim``: not passed). A decode wrapper, and the ``cute-dsl`` backend, take
    equal sizes only: :class:`LayoutError` (see the module docstring)."""
    indptr, indices, last = csr_lists(view)
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise InputError(f"num_qo_heads must be a multiple of num_kv_heads ({num_kv_heads}), "
                         f"got {num_qo_heads}")
    kind = kind or wrapper_kind(view)
    split = head_dim_v is not None and head_dim_v != head_dim
    if split:
        _check_split(wrapper, kind, head_dim, head_dim_v)
    rows = planned_rows(view, kind) if rows is None else rows
    common: dict[str, Any] = {
        "q_data_type": q_dtype, "kv_data_type": kv_dtype or q_dtype,
        "sm_scale": softmax_scale_of(sm_scale, head_dim), "window_left": view.window_left,
    }
    cap = check_softcap(softcap)
    if cap:
        common["logits_soft_cap"] = cap
    if kind is WrapperKind.DECODE:
        wrapper.plan(indptr, indices, last, num_qo_heads, num_kv_heads, head_dim,
                     view.page_size, **common)
    else:
        if split:
            common["head_dim_vo"] = head_dim_v
        wrapper.plan(view.cu_seqlens_q, indptr, indices, last, num_qo_heads, num_kv_heads,
                     head_dim, view.page_size, causal=view.causal, **common)
    return rows


def _check_split(wrapper: Any, kind: WrapperKind, d: int, dv: object) -> None:
    """K and V of different head sizes: only a prefill wrapper off the ``cute-dsl`` backend."""
    if not isinstance(dv, int) or isinstance(dv, bool) or dv < 1:
        raise InputError(f"head_dim_v must be an int >= 1 or None, got {dv!r}")
    if kind is WrapperKind.DECODE:
        raise LayoutError(f"FlashInfer's decode wrapper takes one head_dim; K and V head sizes "
                          f"differ (D={d}, Dv={dv}): plan this part on a prefill wrapper, whose "
                          "plan takes head_dim_vo (make_wrapper(kind=WrapperKind.PREFILL), or "
                          "GraphWrappers(prefill_only=True))")
    if getattr(wrapper, "_backend", None) == "cute-dsl":
        raise LayoutError(f"FlashInfer's cute-dsl backend requires head_dim_vo == head_dim_qk, "
                          f"got D={d}, Dv={dv}: build the wrappers with another backend")


def run(wrapper: Any, view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor, *,
        rows: int | None = None, k_scale: float | None = None, v_scale: float | None = None,
        sinks: Tensor | None = None) -> Attn:
    """Run a planned wrapper: ``(out [q.shape[0], H, Dv], natural-log lse [q.shape[0], H])``.

    The wrapper gets ``q[:rows]``, exactly the rows it computes (see the module docstring); rows
    past them come back as 0 and ``-inf``, inside a captured graph too: a prefill wrapper writes
    into outputs filled with those first (a replay whose plan has fewer rows than the capture's
    leaves the rest as filled, never unwritten memory). The cache is read as pages of
    ``view.page_size`` tokens (token-slot expand parts read it as ``[tokens, 1, H_kv, D]``, no
    copy).

    Args:
        rows: what :func:`plan` returned for this wrapper (default :func:`planned_rows`, which
            syncs for a prefill part: pass it inside a graph capture).
        k_scale, v_scale: an fp8 cache's per-tensor scales as Python floats (both or neither;
            :func:`attnpool.adapters.fp8.host_scales` reads device scales once), passed to the
            wrapper's ``run``; omitted for a model-dtype cache or a raw fp8 read.
        sinks: float32 ``[H]`` sink logits, passed as ``run(sinks=)``. FlashInfer applies them on
            its :data:`SINK_BACKENDS` only (the others drop the argument), so any other wrapper
            is refused with :class:`LayoutError` rather than computing without them.

    Raises:
        InputError: ``q`` has fewer than ``rows`` rows; scales for a model-dtype cache, only one
            of them, or one that is not a finite Python float > 0 (a tensor included).
    """
    h, _, _ = check_qkv(q, k_cache, v_cache)
    sc: dict[str, Any] = dict(float_scales(k_cache, k_scale, v_scale))
    rows = planned_rows(view) if rows is None else rows
    if q.shape[0] < rows:
        raise InputError(f"q must have at least the {rows} query rows the wrapper was planned "
                         f"for, got {q.shape[0]}")
    kv = (cache_as_pages(k_cache, view.page_size), cache_as_pages(v_cache, view.page_size))
    if sinks is not None:
        backend = getattr(wrapper, "_backend", None)
        if backend not in SINK_BACKENDS or sink_argument(wrapper.run) != "sinks":
            raise LayoutError(f"this FlashInfer wrapper ({type(wrapper).__name__}, backend="
                              f"{backend!r}) cannot apply attention sinks: build the wrappers with "
                              f"backend in {SINK_BACKENDS} (GraphWrappers(backend=...)), or use "
                              "the sdpa adapter")
        sc["sinks"] = check_sinks(sinks, h, q.device)
    if rows == q.shape[0] and wrapper_kind(view) is WrapperKind.DECODE:
        # one query per row, bs of them (on either wrapper kind): every row is written
        out, lse = wrapper.run(q, kv, return_lse=True, **sc)
        return Attn(out, lse * math.log(2.0))
    # A prefill wrapper computes the rows of its latest plan, and a graph captured with it keeps
    # the capture's row count: the rows past a later, smaller plan are not written on replay.
    # Handing FlashInfer outputs that already hold 0 / -inf (filled in the same stream, so inside
    # a graph on every replay) keeps every row defined, and the base change below never reads an
    # unwritten element (compute-sanitizer initcheck reports such reads).
    out = q.new_zeros((q.shape[0], h, v_cache.shape[-1]))  # ok: memset, the 0 rows' contract
    lse = torch.full((q.shape[0], h), float("-inf"), dtype=torch.float32, device=q.device)
    got, got_lse = wrapper.run(q[:rows], kv, out=out[:rows], lse=lse[:rows], return_lse=True,
                               **sc)
    # FlashInfer may hand back new tensors instead (its v_scale for an fp8 output is applied
    # out of place): what it returns is the result
    if got.data_ptr() != out.data_ptr():
        out[:rows].copy_(got)
    if got_lse.data_ptr() != lse.data_ptr():
        lse[:rows].copy_(got_lse)
    return Attn(out, lse.mul_(math.log(2.0)))


class GraphWrappers:
    """One FlashInfer CUDA-graph wrapper per (pool part, captured batch size).

    ``wrapper(view)`` before capture creates (or returns) the wrapper for ``view``'s part and ``bs``;
    ``plan(view, ...)`` before each replay plans it; ``run(view, q, k, v)`` inside the graph calls
    it. Parts are told apart by the address of their ``kv_indptr`` buffer, so a tree verify's
    prefix and expand passes get separate wrappers, as do different batch sizes, while every
    wrapper sits on slices of the same arena buffers.

    The number of query rows each wrapper computes is remembered at every :meth:`plan` (a host
    int), so :meth:`run` slices ``q`` without a device read, as a graph capture requires. A plan
    with more rows than the wrapper's first plan is refused (FlashInfer refuses it too, less
    clearly): plan the capture view first.

    Args:
        workspace: FlashInfer float workspace shared by all wrappers (they run one at a time).
        decode_cls, prefill_cls: wrapper classes to use instead of FlashInfer's.
        use_tensor_cores: passed to decode wrappers.
        zero_workspace: zero ``workspace`` now, before any wrapper uses it (FlashInfer requires a
            zeroed workspace at first use); pass False only for one that is already zero.
        prefill_only: build a prefill wrapper for every part, decode parts included: what a cache
            whose K and V head sizes differ needs (the decode wrapper takes one head size).
        graph: CUDA-graph wrappers, one per part and batch size (the default). False: eager
            wrappers, one per part and wrapper kind whatever the batch size, with no row
            maximum: for the steps an engine runs outside graphs (a wrapper per size would
            allocate FlashInfer's int workspace and pinned host buffer once per size).
    """

    def __init__(self, workspace: Tensor, *, decode_cls: type[Any] | None = None,
                 prefill_cls: type[Any] | None = None, use_tensor_cores: bool = False,
                 zero_workspace: bool = True, backend: str | None = None,
                 prefill_only: bool = False, graph: bool = True) -> None:
        if zero_workspace:
            workspace.zero_()
        self.workspace = workspace
        self._cls = {WrapperKind.DECODE: decode_cls, WrapperKind.PREFILL: prefill_cls}
        self.use_tensor_cores = use_tensor_cores
        self.backend = backend
        self.prefill_only = prefill_only
        self.graph = graph
        self._dims: dict[tuple[int, int, WrapperKind], tuple[int, int]] = {}
        self._by_key: dict[tuple[int, int, WrapperKind], Any] = {}
        self._rows: dict[tuple[int, int, WrapperKind], int] = {}
        self._max_rows: dict[tuple[int, int, WrapperKind], int] = {}

    def _key(self, view: PagedView) -> tuple[int, int, WrapperKind]:
        indptr, _, _ = csr_lists(view)
        return (indptr.data_ptr(), view.bs if self.graph else -1,
                WrapperKind.PREFILL if self.prefill_only else wrapper_kind(view))

    def wrapper(self, view: PagedView) -> Any:
        """The wrapper of ``view``'s part and batch size, created on first use."""
        key = self._key(view)
        w = self._by_key.get(key)
        if w is None:
            kind = key[2]
            w = make_wrapper(view, self.workspace, kind=kind, wrapper_cls=self._cls[kind],
                             use_tensor_cores=self.use_tensor_cores, backend=self.backend,
                             graph=self.graph)
            self._by_key[key] = w
        return w

    def __len__(self) -> int:
        return len(self._by_key)

    def plan(self, view: PagedView, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
             sm_scale: float | None = None, softcap: float = 0.0,
             head_dim_v: int | None = None) -> Any:
        """Plan the wrapper of ``view`` (created by :meth:`wrapper` before capture) for the batch
        ``view`` now holds; returns it. ``head_dim_v``: see :func:`plan`; :meth:`run` then checks
        the caches' head sizes against the planned ones (a kernel planned for other sizes would
        read and write rows of the wrong width).

        Raises:
            LayoutError: the batch has more query rows than the wrapper's first plan.
        """
        w = self._existing(view)
        key = self._key(view)
        rows = planned_rows(view, key[2])
        first = self._max_rows.setdefault(key, rows)
        if rows > first and self.graph:
            raise LayoutError(
                f"this batch has {rows} query rows, more than the {first} of the wrapper's first "
                f"plan (bs={view.bs}); a CUDA-graph prefill wrapper keeps its first plan's row "
                "count as its maximum: plan the capture view (pool.<phase>.view(bs)) first")
        self._rows[key] = plan(w, view, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
                               sm_scale=sm_scale, kind=key[2], rows=rows, softcap=softcap,
                               head_dim_v=head_dim_v)
        self._dims[key] = (head_dim, head_dim if head_dim_v is None else head_dim_v)
        return w

    def run(self, view: PagedView, q: Tensor, k_cache: Tensor, v_cache: Tensor, *,
            k_scale: float | None = None, v_scale: float | None = None,
            sinks: Tensor | None = None) -> Attn:
        """Run the planned wrapper of ``view`` on ``q[:planned rows]`` (safe inside a graph:
        creates no wrapper and reads nothing from the device on the host). ``k_scale`` /
        ``v_scale``: an fp8 cache's scales as floats (see :func:`run`)."""
        w = self._existing(view)
        key = self._key(view)
        rows = self._rows.get(key)
        if rows is None:
            raise LayoutError(f"the wrapper for this part at bs={view.bs} was never planned; "
                              "call plan(view, ...) before run")
        want = self._dims[key]
        got = tuple(c.shape[-1] if isinstance(c, Tensor) and c.dim() else None
                    for c in (k_cache, v_cache))
        if got != want and None not in got:  # (not tensors: run's own check names them)
            raise InputError(f"k_cache / v_cache head sizes {got} differ from the (head_dim, "
                             f"head_dim_v) {want} this wrapper was planned for")
        return run(w, view, q, k_cache, v_cache, rows=rows, k_scale=k_scale, v_scale=v_scale,
                   sinks=sinks)

    def attention(self, view: object, q: Tensor, k_cache: Tensor, v_cache: Tensor, *,
                  k_scale: float | None = None, v_scale: float | None = None,
                  sinks: Tensor | None = None) -> Attn:
        """:meth:`run` for a :class:`PagedView`, or both passes of a tree
        :class:`attnpool.VerifyView` / :class:`attnpool.DraftStepView` merged by log-sum-exp
        (each part planned beforehand); the scales apply to every pass."""
        def one(part: PagedView, first: bool, s: Tensor | None) -> Attn:
            return self.run(part, q, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale, sinks=s)

        return run_passes(view, one, check_sinks(sinks, q.shape[1], q.device))

    def _existing(self, view: PagedView) -> Any:
        # Never create a wrapper here: construction allocates FlashInfer's int workspace and
        # pinned host memory, which must not happen inside a graph capture.
        w = self._by_key.get(self._key(view))
        if w is None:
            raise LayoutError(f"no wrapper was created for this part at bs={view.bs}; call "
                              "wrapper(view) on the capture view before capturing")
        return w

"""FlashInfer's ``BatchMLAPagedAttentionWrapper`` over the pool's CSR buffers, in graph mode.

The wrapper computes absorbed MLA (:mod:`attnpool.adapters.mla`) from four CSR buffers it keeps
for life in CUDA-graph mode (``use_cuda_graph=True``): ``qo_indptr [bs+1]``, ``kv_indptr
[bs+1]``, ``kv_indices`` and ``kv_len_arr [bs]`` (each row's KV length), all int32. Like
:mod:`attnpool.adapters.flashinfer`, :class:`MLAGraphWrappers` builds one wrapper per (part,
captured ``bs``) on the view's own tensors: ``qo_indptr = cu_seqlens_q``, ``kv_indptr`` and
``kv_indices`` of the part (``Layout.FLASHINFER``), never copies. ``plan`` (host-side, syncing:
FlashInfer copies the indptrs to the host) passes the same tensors back, so its copies into the
reserved buffers are copies of a buffer onto itself.

``kv_len_arr`` is not a pool buffer: the pool's FlashInfer fields are FlashInfer's paged ones
(``kv_last_page_len``), and its ``cache_seqlens`` give padded rows ``pad_seq_len`` while their CSR
rows own no pages, which a kernel reading ``kv_len_arr`` would take as keys on pages the row
does not have. Each wrapper therefore owns a ``[bs]`` int32 buffer (allocated with the wrapper,
before capture), and :meth:`MLAGraphWrappers.plan` writes the lengths the CSR rows describe into
it, ``(pages - 1) * P + kv_last_page_len`` (0 for a row without pages), on the device.

Calls use FlashInfer's keyword names that every release with this wrapper takes: ``plan(
qo_indptr=, kv_indptr=, kv_indices=, kv_len_arr=, num_heads=, head_dim_ckv=, head_dim_kpe=,
page_size=, causal=, sm_scale=, q_data_type=, kv_data_type=)`` and ``run(q_nope=, q_pe=,
ckv_cache=, kpe_cache=, out=, lse=, return_lse=True)`` (0.7 calls these forms deprecated, in
favour of its ``metadata=`` / ``query=`` objects, and still takes them). ``q_nope`` is
FlashInfer's name for the absorbed latent query ``[T, H, L]``; ``ckv_cache`` / ``kpe_cache`` are
the latent cache's two column ranges ``[num_pages, P, L]`` and ``[num_pages, P, R]``, strided
views of ``KVCachePool.kv_cache(layer)`` (FlashInfer reads their strides), never copies.

Outputs: ``out [T, H, L]`` and the natural-log ``lse [T, H]`` (FlashInfer returns base 2: times
``ln 2`` here). The wrapper computes the rows of ``cu_seqlens_q[:bs+1]``; ``run`` hands it
``q[:rows]`` and outputs filled with 0 / ``-inf`` first, so rows past them read as no keys.
Sliding windows, softcapping and sinks are not MLA wrapper arguments: a window part is refused.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import Tensor

from ...errors import InputError, LayoutError
from ...kv.mla_shape import MLAShape
from ...views import PagedView
from ..flashinfer import csr_lists
from ..merge import Attn, run_passes
from ..sdpa.gather import cache_as_pages
from .sdpa import check_shape, latent_kv, split_q


def _csr(view: object) -> tuple[Tensor, Tensor, Tensor]:
    """The part's CSR lists (:func:`.flashinfer.csr_lists`); a window is refused too."""
    lists = csr_lists(view, "FlashInfer's MLA wrapper")
    view = cast(PagedView, view)  # (csr_lists refused anything else)
    if view.window_left >= 0:
        raise LayoutError(f"FlashInfer's MLA wrapper has no sliding window; this part has "
                          f"window_left={view.window_left}")
    return lists


def kv_lens_(view: PagedView, out: Tensor) -> Tensor:
    """Write each CSR row's KV length into ``out [bs]`` int32 (device ops, no host read):
    ``(pages - 1) * page_size + kv_last_page_len``, 0 for a row that owns no pages."""
    indptr, _, last = _csr(view)
    pages = indptr[1: view.bs + 1] - indptr[: view.bs]
    lens = torch.where(pages > 0, (pages - 1) * view.page_size + last[: view.bs], 0)
    return out.copy_(lens)


def _cls(given: type[Any] | None) -> type[Any]:
    if given is not None:
        return given
    import flashinfer  # lazy: importing attnpool never imports flashinfer

    return flashinfer.mla.BatchMLAPagedAttentionWrapper  # type: ignore[no-any-return]


class MLAGraphWrappers:
    """One ``BatchMLAPagedAttentionWrapper`` per (pool part, captured batch size).

    ``wrapper(view)`` before capture, ``plan(view, ...)`` before each replay (outside the graph),
    ``run(view, q, kv_cache)`` / ``attention(view, q, kv_cache)`` inside. Parts are told apart by
    their ``kv_indptr`` buffer's address, so a tree's prefix and expand passes get separate
    wrappers.

    Args:
        workspace: FlashInfer's float workspace (uint8, typically 128 MiB), shared by the
            wrappers (they run one at a time).
        shape: the layers' :class:`MLAShape` (heads, latent and rope widths, scale).
        wrapper_cls: the class to build (default ``flashinfer.mla.BatchMLAPagedAttentionWrapper``;
            tests pass a fake).
        backend: FlashInfer's ``backend=`` (``"auto"``, ``"fa2"``, ``"fa3"``).
    """

    def __init__(self, workspace: Tensor, shape: MLAShape, *,
                 wrapper_cls: type[Any] | None = None, backend: str = "auto") -> None:
        self.workspace = workspace
        self.shape = check_shape(shape)
        self._cls = wrapper_cls
        self.backend = backend
        self._by_key: dict[tuple[int, int], tuple[Any, Tensor]] = {}
        self._rows: dict[tuple[int, int], int] = {}

    def _key(self, view: PagedView) -> tuple[int, int]:
        indptr, _, _ = _csr(view)
        return indptr.data_ptr(), view.bs

    def __len__(self) -> int:
        return len(self._by_key)

    def wrapper(self, view: PagedView) -> Any:
        """The wrapper of ``view``'s part and batch size, created on first use (before capture:
        construction allocates)."""
        key = self._key(view)
        got = self._by_key.get(key)
        if got is None:
            indptr, indices, _ = _csr(view)
            # once per wrapper (its graph-mode kv_len_arr buffer), refilled at every plan
            kv_len = torch.zeros(view.bs, dtype=torch.int32, device=indptr.device)  # ok: once
            w = _cls(self._cls)(self.workspace, use_cuda_graph=True,
                                qo_indptr=view.cu_seqlens_q[: view.bs + 1],
                                kv_indptr=indptr[: view.bs + 1], kv_indices=indices,
                                kv_len_arr=kv_len, backend=self.backend)
            got = self._by_key[key] = (w, kv_len)
        return got[0]

    def plan(self, view: PagedView, *, q_dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
             sm_scale: float | None = None) -> Any:
        """Plan the wrapper of ``view`` (made by :meth:`wrapper`) for the batch the view holds
        now; ``sm_scale`` defaults to ``shape.softmax_scale`` (the unabsorbed head's)."""
        key = self._key(view)
        got = self._by_key.get(key)
        if got is None:
            raise LayoutError(f"no wrapper was created for this part at bs={view.bs}; call "
                              "wrapper(view) on the capture view before capturing")
        w, kv_len = got
        indptr, indices, _ = _csr(view)
        kv_lens_(view, kv_len)
        s = self.shape
        qo = view.cu_seqlens_q[: view.bs + 1]
        w.plan(qo_indptr=qo, kv_indptr=indptr[: view.bs + 1], kv_indices=indices,
               kv_len_arr=kv_len, num_heads=s.num_heads, head_dim_ckv=s.kv_lora_rank,
               head_dim_kpe=s.qk_rope_head_dim, page_size=view.page_size, causal=view.causal,
               sm_scale=s.softmax_scale if sm_scale is None else float(sm_scale),
               q_data_type=q_dtype, kv_data_type=kv_dtype or q_dtype)
        self._rows[key] = view.bs if view.max_seqlen_q == 1 else int(qo[view.bs])
        return w

    def run(self, view: PagedView, q: Tensor, kv_cache: Tensor, *,
            q_pe: Tensor | None = None) -> Attn:
        """Run the planned wrapper of ``view``: ``(out [q.shape[0], H, L], lse [q.shape[0], H])``
        (``q`` packed ``[T, H, L + R]``, or ``[T, H, L]`` with ``q_pe``: see
        :mod:`attnpool.adapters.mla`). Creates nothing and reads nothing back: graph-safe."""
        key = self._key(view)
        rows = self._rows.get(key)
        if rows is None:
            raise LayoutError(f"the MLA wrapper for this part at bs={view.bs} was never "
                              "planned; call plan(view, ...) before run")
        s = self.shape
        lat = s.kv_lora_rank
        q_nope, q_rope = split_q(q, s, q_pe)
        if q_nope.shape[0] < rows:
            raise InputError(f"q must have at least the {rows} query rows the wrapper was "
                             f"planned for, got {q_nope.shape[0]}")
        kv, _ = latent_kv(kv_cache, s)
        pages = cache_as_pages(kv, view.page_size)[:, :, 0]  # [pages, P, L + R], a view
        out = q_nope.new_zeros((q_nope.shape[0], s.num_heads, lat))
        lse = torch.full((q_nope.shape[0], s.num_heads), float("-inf"), dtype=torch.float32,
                         device=q_nope.device)
        w = self._by_key[key][0]
        got, got_lse = w.run(q_nope=q_nope[:rows], q_pe=q_rope[:rows],
                             ckv_cache=pages[..., :lat], kpe_cache=pages[..., lat:],
                             out=out[:rows], lse=lse[:rows], return_lse=True)
        if got.data_ptr() != out.data_ptr():
            out[:rows].copy_(got)
        if got_lse.data_ptr() != lse.data_ptr():
            lse[:rows].copy_(got_lse)
        return Attn(out, lse.mul_(math.log(2.0)))

    def attention(self, view: object, q: Tensor, kv_cache: Tensor, *,
                  q_pe: Tensor | None = None) -> Attn:
        """:meth:`run` for a :class:`PagedView`, or both passes of a tree verify / draft step
        view merged by log-sum-exp (each part planned beforehand)."""
        def one(part: PagedView, first: bool, sinks: Tensor | None) -> Attn:
            return self.run(part, q, kv_cache, q_pe=q_pe)

        return run_passes(view, one)

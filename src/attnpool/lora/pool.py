"""Per-batch LoRA metadata in one ``torch.empty``, refilled in place with one copy per step.

Multi-LoRA kernels (segmented / grouped GEMMs) read, per forward: which adapter slot each request
uses, where each request's tokens start, every slot's rank and scaling, and an order of the tokens
grouped by adapter. Engines build these as fresh tensors every step (a host allocation and a
host-to-device copy each) and, under CUDA graphs, copy them again into static buffers. Here they
live in one preallocated region, laid out back to back:

============== ============================ ===================================================
buffer         shape, dtype                 meaning (``n`` real requests of ``bs`` captured)
============== ============================ ===================================================
seg_lens       ``[max_bs] int32``           tokens of request ``i``; **0** for ``i >= n``
seg_indptr     ``[max_bs + 1] int32``       ``[0, cumsum(seg_lens)]``; repeats the total after n
weight_indices ``[max_bs] int32``           adapter slot of request ``i``; **0** for ``i >= n``
lora_ranks     ``[max_loras] int32``        rank of each slot (0: empty slot, no contribution)
scalings       ``[max_loras] float32``      scaling of each slot (0.0 for empty slots)
permutation    ``[max_tokens] int64``       token order grouped by adapter slot (stable) for the
                                            real tokens, then the identity for the rest
============== ============================ ===================================================

Each update rewrites the **whole** region on the host (a numpy image: the pool's own bytes on the
CPU, a pinned staging buffer on CUDA) and, on CUDA, sends it with **one** non-blocking
host-to-device copy. Because the tail is neutral (zero-length segments on a valid slot, identity
permutation), every captured size is valid after any update, and a graph captured while one adapter
was loaded stays correct replayed with many: kernels bound their work by ``seg_indptr`` and
``lora_ranks`` (tensors), and the host ints a graph freezes are static bounds (``max_len``,
``max_rank``). Staging is double-buffered with an event per image, so the host never overwrites
bytes a pending copy still reads and never waits for the device otherwise.

An engine whose kernels read metadata of its own layout (vLLM's punica wrapper:
:mod:`attnpool.integrations.vllm.lora`) names it in ``LoRAConfig.extra_buffers``: those buffers
are carved from the same ``torch.empty``, after everything above, and the pool never writes them
(the engine's adapter refills them in place; :meth:`LoRABatchPool.typed_extras` types a host image
of the same layout). Without extras the layout is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ..arena import sentinel
from ..check import ReadRegionError
from ..config import align
from ..errors import CapacityError, InputError, LayoutError, PoolError
from ..inputs import check_count
from .config import _FIELDS, LoRABatchView, LoRAConfig


def _host(name: str, v: object, integer: bool) -> np.ndarray:
    """Host values as a 1-D numpy array; device tensors are refused (reading them would sync)."""
    if isinstance(v, Tensor):
        if v.device.type != "cpu":
            raise InputError(f"{name} must be host values (list or CPU tensor), got {v.device}")
        a = v.detach().numpy()
    else:
        try:
            a = np.asarray(v)
        except (TypeError, ValueError) as e:
            raise InputError(f"{name} must be a sequence of numbers, got {type(v).__name__}") from e
    if a.ndim != 1:
        raise InputError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and a.dtype.kind not in ("iu" if integer else "iuf"):  # (bool is kind "b")
        raise InputError(f"{name} must hold {'ints' if integer else 'numbers'}, got dtype {a.dtype}")
    return a


def _in_range(name: str, a: np.ndarray, lo: int, hi: int) -> None:
    if a.size and (a.min() < lo or a.max() > hi):
        i = int(np.argmax((a < lo) | (a > hi)))
        raise CapacityError(f"{name}[{i}] must be in [{lo}, {hi}], got {a[i]}")


class LoRABatchPool:
    """LoRA metadata buffers (and optional output buffers) in one ``torch.empty``.

    Args:
        cfg: :class:`LoRAConfig`.
        poison: fill the region with sentinels (int max, NaN) so :meth:`check` catches anything
            a view or update failed to write.
        staging: build each step's image in a separate host buffer and send it with one copy.
            Default: on for CUDA (pinned memory), off on the CPU, where the image is written
            straight into the pool's bytes (no copy at all).
    """

    def __init__(self, cfg: LoRAConfig, poison: bool = False, staging: bool | None = None) -> None:
        if not isinstance(cfg, LoRAConfig):
            raise PoolError(f"LoRABatchPool expects a LoRAConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        dev = cfg.torch_device
        lens = cfg.lengths()
        offsets, at = [], 0
        for _, dt, k in _FIELDS:
            offsets.append(at)
            at += align(lens[k] * dt.itemsize)
        self.meta_nbytes = at
        out_at = {}
        for d in cfg.output_dims:
            out_at[d] = at
            at += align(cfg.max_tokens * d * cfg.output_dtype.itemsize)
        extras_at = at
        self._extra_offsets: dict[str, int] = {}
        for name, dt, n in cfg.extra_buffers:
            self._extra_offsets[name] = at - extras_at
            at += align(n * dt.itemsize)
        #: Bytes of the extra buffers (0 without them), the tail of :attr:`storage`.
        self.extras_nbytes = at - extras_at
        self.nbytes = at
        # The one device allocation: metadata first (the region each update copies), then outputs.
        self.storage = torch.empty(at, dtype=torch.uint8, device=dev)
        self._meta = self.storage[: self.meta_nbytes]
        self.buffers: dict[str, Tensor] = self._typed(self._meta, offsets)
        self._outputs = {d: self.storage[o : o + cfg.max_tokens * d * cfg.output_dtype.itemsize]
                         .view(cfg.output_dtype).view(cfg.max_tokens, d) for d, o in out_at.items()}
        #: The extra buffers' bytes (one region) and the buffers, views of it by name.
        self.extras_region = self.storage[extras_at:]
        self.extras: dict[str, Tensor] = self.typed_extras(self.extras_region)
        self.staging = dev.type != "cpu" if staging is None else bool(staging)
        if self.staging:
            pin = dev.type == "cuda"
            host = torch.empty(2 * self.meta_nbytes, dtype=torch.uint8, pin_memory=pin)
            self._images = [host[i * self.meta_nbytes : (i + 1) * self.meta_nbytes]
                            for i in range(2)]
        else:
            self._images = [self._meta]
        self._host = [self._typed(img, offsets) for img in self._images]
        self._np = [{k: t.numpy() for k, t in typed.items()} for typed in self._host]
        self._host_views: dict[tuple[int, int], LoRABatchView] = {}
        self._last = 0
        self._events: list[torch.cuda.Event | None] = [None] * len(self._images)
        self._turn = 0
        self._ranks = np.zeros(cfg.max_loras_per_batch, dtype=np.int32)
        self._scalings = np.zeros(cfg.max_loras_per_batch, dtype=np.float32)
        self._iota = np.arange(cfg.max_tokens, dtype=np.int64)
        self._views: dict[int, LoRABatchView] = {}
        self._valid = False
        if poison:
            self.poison_()

    def _typed(self, region: Tensor, offsets: list[int]) -> dict[str, Tensor]:
        lens = self.cfg.lengths()
        return {name: region[o : o + lens[k] * dt.itemsize].view(dt)
                for (name, dt, k), o in zip(_FIELDS, offsets, strict=True)}

    def typed_extras(self, region: Tensor) -> dict[str, Tensor]:
        """The extra buffers' layout over ``region`` (``uint8 [extras_nbytes]``, any device: the
        pool's own :attr:`extras_region` or a host image an engine fills and copies in one go)."""
        if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() != self.extras_nbytes:
            raise InputError(f"typed_extras expects uint8 [{self.extras_nbytes}], got "
                             f"{region.dtype} {list(region.shape)}")
        return {name: region[self._extra_offsets[name] : self._extra_offsets[name]
                             + n * dt.itemsize].view(dt)
                for name, dt, n in self.cfg.extra_buffers}

    # ---- views ---------------------------------------------------------------------------------
    def _check_bs(self, bs: object) -> int:
        return check_count(bs, self.cfg.max_bs, "max_bs")

    def _view(self, bs: int) -> LoRABatchView:
        v = self._views.get(bs)
        if v is None:
            b, t = self.buffers, self.cfg.tokens(bs)
            v = LoRABatchView(bs, b["seg_lens"][:bs], b["seg_indptr"][: bs + 1],
                              b["weight_indices"][:bs], b["lora_ranks"], b["scalings"],
                              b["permutation"][:t], t, self.cfg.max_tokens_per_req,
                              self.cfg.max_lora_rank)
            self._views[bs] = v
        return v

    def view(self, bs: int) -> LoRABatchView:
        """The view for capture. If nothing valid was written yet (or since :meth:`poison_`), the
        neutral state is written first: no segment has tokens, all on slot 0."""
        self._check_bs(bs)
        if not self._valid:
            self._write(np.zeros(0, np.int64), np.zeros(0, np.int64))
        return self._view(bs)

    def host_view(self, bs: int) -> LoRABatchView:
        """The last update's metadata on the host, shaped like :meth:`view` (``bs`` requests):
        the image that update wrote (pinned, on CUDA) or, without staging, the pool's own
        view. For kernels that walk segments in Python (SGLang's ``torch_native`` LoRA ops):
        reading these costs no device sync. Valid until the update after next rewrites the
        image (two images alternate)."""
        self._check_bs(bs)
        if not self._valid:
            self.view(bs)
        if not self.staging:
            return self._view(bs)
        v = self._host_views.get((self._last, bs))
        if v is None:
            b, t = self._host[self._last], self.cfg.tokens(bs)
            v = LoRABatchView(bs, b["seg_lens"][:bs], b["seg_indptr"][: bs + 1],
                              b["weight_indices"][:bs], b["lora_ranks"], b["scalings"],
                              b["permutation"][:t], t, self.cfg.max_tokens_per_req,
                              self.cfg.max_lora_rank)
            self._host_views[(self._last, bs)] = v
        return v

    def output(self, bs: int, out_dim: int) -> Tensor:
        """The reusable output buffer ``[bs * max_tokens_per_req, out_dim]`` (uninitialised: the
        LoRA kernel writes it; rows of padded tokens hold whatever it writes there)."""
        self._check_bs(bs)
        if out_dim not in self._outputs:
            raise LayoutError(f"no output buffer of width {out_dim}; configured: "
                              f"{list(self._outputs)}")
        return self._outputs[out_dim][: self.cfg.tokens(bs)]

    # ---- update --------------------------------------------------------------------------------
    def update_(
        self,
        bs: int,
        weight_indices: Sequence[int] | Tensor | np.ndarray,
        seg_lens: Sequence[int] | Tensor | np.ndarray | None = None,
        lora_ranks: Sequence[int] | Tensor | np.ndarray | None = None,
        scalings: Sequence[float] | Tensor | np.ndarray | None = None,
    ) -> LoRABatchView:
        """Refill the metadata for ``n = len(weight_indices) <= bs`` real requests.

        ``seg_lens`` (default: ``max_tokens_per_req`` each) are tokens per request in
        ``[0, max_tokens_per_req]``. ``lora_ranks`` / ``scalings`` (at most ``max_loras_per_batch``
        values, the rest become 0) replace the slot table when given and persist; pass them when
        adapters are (re)loaded. Every value is checked on the host before anything is written.
        """
        c = self.cfg
        self._check_bs(bs)
        w = _host("weight_indices", weight_indices, integer=True)
        n = w.shape[0]
        if n > bs:
            raise CapacityError(f"weight_indices has {n} requests, more than bs={bs}")
        _in_range("weight_indices", w, 0, c.max_loras_per_batch - 1)
        if seg_lens is None:
            lens = np.full(n, c.max_tokens_per_req, dtype=np.int64)
        else:
            lens = _host("seg_lens", seg_lens, integer=True)
            if lens.shape[0] != n:
                raise InputError(f"seg_lens must have n={n} values (one per request), "
                                 f"got {lens.shape[0]}")
            _in_range("seg_lens", lens, 0, c.max_tokens_per_req)
        total = int(lens.sum())
        if total > c.max_tokens:
            raise CapacityError(f"seg_lens sum to {total} tokens, more than the pool's "
                                f"max_tokens={c.max_tokens}")
        ranks = scal = None
        if lora_ranks is not None:
            ranks = _host("lora_ranks", lora_ranks, integer=True)
            self._slots_len("lora_ranks", ranks)
            _in_range("lora_ranks", ranks, 0, c.max_lora_rank)
        if scalings is not None:
            scal = _host("scalings", scalings, integer=False)
            self._slots_len("scalings", scal)
            if not np.isfinite(scal).all():
                raise InputError(f"scalings must be finite, got {scal.tolist()}")
        # Validated: from here on, writes only.
        if ranks is not None:
            self._ranks[:] = 0
            self._ranks[: ranks.shape[0]] = ranks
        if scal is not None:
            self._scalings[:] = 0
            self._scalings[: scal.shape[0]] = scal
        self._write(w, lens)
        return self._view(bs)

    def _slots_len(self, name: str, a: np.ndarray) -> None:
        if a.shape[0] > self.cfg.max_loras_per_batch:
            raise CapacityError(f"{name} has {a.shape[0]} slots, more than max_loras_per_batch="
                                f"{self.cfg.max_loras_per_batch}")

    def _write(self, w: np.ndarray, lens: np.ndarray) -> None:
        """Write the whole image (real rows, neutral tail) and send it with at most one copy."""
        k = self._turn
        ev = self._events[k]
        if ev is not None:
            ev.synchronize()  # the copy that last read this image (two updates ago) is done
        img = self._np[k]
        n = w.shape[0]
        seg, ind, wi, perm = img["seg_lens"], img["seg_indptr"], img["weight_indices"], \
            img["permutation"]
        seg[:n] = lens
        seg[n:] = 0
        ind[0] = 0
        np.cumsum(seg, out=ind[1:])
        wi[:n] = w
        wi[n:] = 0
        img["lora_ranks"][:] = self._ranks
        img["scalings"][:] = self._scalings
        total = int(ind[n])
        if total:
            perm[:total] = np.argsort(np.repeat(w, lens), kind="stable")
        perm[total:] = self._iota[total:]
        if self.staging:
            self._meta.copy_(self._images[k], non_blocking=True)
            if self._meta.device.type == "cuda":
                ev = self._events[k] or torch.cuda.Event()  # type: ignore[no-untyped-call]
                ev.record()
                self._events[k] = ev
            self._turn = (k + 1) % len(self._images)
        self._last = k
        self._valid = True

    # ---- poison / check ------------------------------------------------------------------------
    def poison_(self) -> None:
        """Fill every buffer with its sentinel; the next view or update rewrites the metadata."""
        for t in (*self.buffers.values(), *self._outputs.values(), *self.extras.values()):
            t.fill_(sentinel(t.dtype))
        self._valid = False

    def check(self, v: LoRABatchView) -> None:
        """Raise :class:`ReadRegionError` unless ``v`` holds consistent, in-range metadata (syncs)."""
        c = self.cfg
        seg = v.seg_lens.cpu().tolist()
        ind = v.seg_indptr.cpu().tolist()
        wi = v.weight_indices.cpu().tolist()
        ranks = v.lora_ranks.cpu().tolist()
        scal = v.scalings.cpu()
        perm = v.permutation.cpu().tolist()

        def fail(what: str) -> None:
            raise ReadRegionError(f"LoRABatchView(bs={v.bs}): {what}")

        if ind[0] != 0:
            fail(f"seg_indptr[0] is {ind[0]}, expected 0")
        for i in range(v.bs):
            if not 0 <= seg[i] <= c.max_tokens_per_req or ind[i + 1] - ind[i] != seg[i]:
                fail(f"segment {i}: seg_lens {seg[i]}, indptr step {ind[i + 1] - ind[i]}")
            if not 0 <= wi[i] < c.max_loras_per_batch:
                fail(f"weight_indices[{i}] is {wi[i]}, expected in [0, {c.max_loras_per_batch})")
        if any(not 0 <= r <= c.max_lora_rank for r in ranks):
            fail(f"lora_ranks {ranks} not in [0, {c.max_lora_rank}]")
        if not bool(torch.isfinite(scal).all()):
            fail(f"scalings {scal.tolist()} not finite")
        if sorted(perm) != list(range(v.num_tokens)):
            fail("permutation is not a permutation of its tokens")


def lora_reference(x: Tensor, lora_a: Tensor, lora_b: Tensor, v: LoRABatchView,
                   out: Tensor | None = None) -> Tensor:
    """Segmented LoRA in plain torch, driven only by the view's tensors (no host sync).

    ``x [T, in]`` (``T <= v.num_tokens``), ``lora_a [max_loras, max_rank, in]``, ``lora_b
    [max_loras, out_dim, max_rank]``. Token ``t`` of segment ``i`` gets ``s * B[:, :r] @ A[:r] @
    x[t]`` with ``w = weight_indices[i]``, ``r = lora_ranks[w]``, ``s = scalings[w]``; tokens past
    ``seg_indptr[bs]`` get 0. Rank columns past a slot's rank (of both A and B) are masked with
    ``where``, never multiplied by zero, so garbage (even NaN) there cannot leak in. Writes
    ``out [T, out_dim]`` when given.
    """
    t_ = torch.arange(x.shape[0], device=x.device, dtype=v.seg_indptr.dtype)
    seg = torch.searchsorted(v.seg_indptr[1:], t_, right=True)
    real = seg < v.bs
    w = v.weight_indices[seg.clamp(max=v.bs - 1)].long()
    cols = torch.arange(lora_a.shape[1], device=x.device)
    keep = (cols[None, :] < v.lora_ranks[w][:, None]) & real[:, None]
    h = torch.bmm(lora_a[w], x[:, :, None]).squeeze(-1)
    zero = torch.zeros((), dtype=h.dtype, device=h.device)  # ok: 0-d constant of the reference
    h = torch.where(keep, h, zero)
    b = torch.where(keep[:, None, :], lora_b[w], zero)
    y = torch.bmm(b, h[:, :, None]).squeeze(-1) * v.scalings[w][:, None].to(h.dtype)
    y = torch.where(real[:, None], y, zero)
    if out is None:
        return y
    out.copy_(y)
    return out

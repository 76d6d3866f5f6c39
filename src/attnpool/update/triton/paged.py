"""The fused paged part: :func:`paged_launch`, one launch for every paged part of every phase.

Decode, verify chain, draft extend and extend (with their query parts), encoder cross and decoder
rows (``token_offset``), all chain draft steps of a round (``steps``) and a draft tree's prefix
pass (``full_pages``) are this one kernel, with a part's sliding-window twin written by the same
launch (``window``). :mod:`attnpool.update.triton` is the path's public module; the rules of
its docstring hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config import ceil_div, is_int
from ...errors import CapacityError, InputError, LayoutError
from ...inputs import check_table
from ..buffers import PagedBuffers, window_width
from ..launch import Launch, part_pointers, pointer_or, replayable
from ..parts import PagedPart
from . import checks
from .loaders import paged_kernels
from .tuning import BLOCK_T, INT32_MAX, MAX_BLOCK_P, MAXNREG, pow2, scan_block, warps


def paged_launch(b: PagedBuffers, part: PagedPart) -> Launch:
    """Check one paged part's update and assemble its launch: what :class:`PagedPart` says
    (every field documented there), in one kernel of ``bs`` programs (``2 * bs`` with a window
    part).

    Same bytes in every read region as the reference path's ``paged_part_`` (``lengths_`` +
    ``paged_`` over ``gather_pages``: page ``p`` of row ``i`` is ``req_to_token[r_i, off_i +
    p*P] // P``). Columns past a row's live pages are not written (outside the read region);
    ``width`` is the reference path's hint only: each program loops over its own row's pages.
    """
    bs, num_real, page_size, pad_seq_len = part.bs, part.num_real, part.page_size, part.pad_seq_len
    keep, q_lens, cu_seqlens_q, steps = part.keep, part.q_lens, part.cu_seqlens_q, part.steps
    token_offset, positions, out_slots = part.token_offset, part.positions, part.out_slots
    q_total, max_len, window = part.q_total, part.max_len, part.window
    dev = b.cache_seqlens.device
    checks.need(is_int(bs) and bs >= 1, CapacityError, f"bs must be an int >= 1, got {bs}")
    if not isinstance(part.seq_lens, Tensor):
        raise InputError(f"seq_lens must be a torch.Tensor, got {type(part.seq_lens).__name__}")
    rows = bs if num_real is not None else part.seq_lens.shape[0]
    checks.need(page_size >= 1, InputError, f"page_size must be >= 1, got {page_size}")
    checks.need(pad_seq_len >= 0, InputError, f"pad_seq_len must be >= 0, got {pad_seq_len}")
    seq_lens = checks.vec("seq_lens", part.seq_lens, rows, dev)
    n = seq_lens.shape[0]
    checks.real_count(num_real, n, bs, dev)
    req_pool_indices = checks.vec("req_pool_indices", part.req_pool_indices, rows, dev)
    table = checks.table(part.req_to_token, dev)
    tok_cols, tp, block_table = checks.block(table, part.block_size)
    if token_offset is not None:
        checks.vec("token_offset", token_offset, rows, dev)
    pad_pages = ceil_div(pad_seq_len, page_size)
    checks.need(is_int(steps) and steps >= 1, InputError, f"steps must be an int >= 1, got {steps}")
    has_pt, has_fi = checks.layouts(b, bs, dev, pad_pages, steps if steps > 1 else 0)
    checks.need(steps == 1 or not has_fi, LayoutError,
            f"steps > 1 (got {steps}) share one page table; a CSR layout cannot be given")
    checks.need(steps == 1 or keep is None, InputError, "keep cannot be combined with steps > 1")
    if keep is not None:
        checks.vec("keep", keep, bs, dev,
               (torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64))
    if (q_lens is None) != (cu_seqlens_q is None):
        raise InputError("q_lens and cu_seqlens_q must be given together")
    if q_lens is not None and cu_seqlens_q is not None:
        checks.vec("q_lens", q_lens, rows, dev)
        checks.buf("cu_seqlens_q", cu_seqlens_q, bs + 1, dev)
    tokens = positions is not None or out_slots is not None
    checks.need(q_total is None or (q_lens is not None and isinstance(q_total, int) and q_total >= 0),
            InputError, f"q_total needs q_lens and must be an int >= 0, got {q_total}")
    checks.need(not tokens or q_total is not None, InputError,
            "positions / out_slots need q_total (the extend query part)")
    if positions is not None:
        checks.buf("positions", positions, 0, dev)
    if out_slots is not None:
        checks.vec("out_slots", out_slots,
               out_slots.shape[0] if isinstance(out_slots, Tensor) else 0, dev)
    pos_cap = positions.shape[0] if positions is not None else 0
    slot_cap = out_slots.shape[0] if out_slots is not None else 0
    # most page columns a row may write: the table's width (a CSR-only part: a whole token row)
    if b.page_table is not None:
        width, pt_stride = b.page_table.shape[1], b.page_table.stride(0)
    else:
        width, pt_stride = ceil_div(tok_cols, page_size), 0
    if max_len is None:
        max_len = width * page_size
    dummy = b.cache_seqlens
    win_args, w_tokens = _window_args(part, table=table, dev=dev, has_layouts=(has_pt, has_fi),
                                      pad_pages=pad_pages, tokens=tokens, dummy=dummy)
    args = {
        "seq_ptr": seq_lens, "rpi_ptr": req_pool_indices, "tok_ptr": table,
        "off_ptr": pointer_or(token_offset, dummy), "nreal_ptr": pointer_or(num_real, dummy),
        "keep_ptr": pointer_or(keep, dummy), "qlen_ptr": pointer_or(q_lens, dummy),
        **part_pointers(b, dummy), "cuq_ptr": pointer_or(cu_seqlens_q, dummy),
        "pos_ptr": pointer_or(positions, dummy), "slot_ptr": pointer_or(out_slots, dummy),
        "n": n, "bs": bs, "extra": part.extra, "pad_len": pad_seq_len, "pad_page": part.pad_page,
        "pad_pages": pad_pages, "pad_q": part.pad_q, "steps": steps,
        "len_sstride": b.cache_seqlens.stride(0) if steps > 1 else 0,
        "cu_sstride": b.cu_seqlens_k.stride(0) if steps > 1 else 0,
        "max_len": max(max_len - (steps - 1), 0),
        "max_q": INT32_MAX if part.max_q is None else part.max_q,
        "P": page_size, "tok_rows": table.shape[0], "tok_cols": tok_cols,
        "tok_stride": table.stride(0), "pt_stride": pt_stride, "cap_pages": width,
        "indices_cap": b.kv_indices.shape[0] if b.kv_indices is not None else 0,
        "q_total": q_total or 0, "pos_cap": pos_cap, "slot_cap": slot_cap,
        "tail_end": max(pos_cap, slot_cap), "TP": tp, **win_args,
        "HAS_OFF": token_offset is not None, "DEVICE_N": num_real is not None,
        "HAS_PT": has_pt, "HAS_FI": has_fi, "INCR": keep is not None,
        "HAS_Q": q_lens is not None, "FULL_PAGES": part.full_pages,
        "Q_FIXED": q_total is not None,
        "TOKENS": tokens, "BLOCK_TABLE": block_table, "WINDOW": window is not None,
        "W_TOKENS": w_tokens, "BLOCK": scan_block(bs),
        "BLOCK_P": min(MAX_BLOCK_P, pow2(width)), "BLOCK_T": BLOCK_T,
    }
    inputs = replayable(
        n=("n", n), seq_ptr=("seq_lens", seq_lens), rpi_ptr=("req_pool_indices", req_pool_indices),
        tok_ptr=("req_to_token", table), off_ptr=("token_offset", token_offset),
        nreal_ptr=("num_real", num_real), keep_ptr=("keep", keep), qlen_ptr=("q_lens", q_lens),
        slot_ptr=("out_slots", out_slots),
        w_slot_ptr=("window_out_slots", part.window_out_slots),
        # (the window part reads its own table, else the part's)
        w_tok_ptr=("window_table" if part.window_table is not None else "req_to_token",
                   window if part.window_table is None else part.window_table))
    grid = (2 * bs,) if window is not None else (bs,)
    return Launch(paged_kernels().paged_kernel, grid, args,
                  {"num_warps": warps(bs), "maxnreg": MAXNREG}, inputs)


def _window_args(part: PagedPart, *, table: Tensor, dev: torch.device,
                 has_layouts: tuple[bool, bool], pad_pages: int, tokens: bool, dummy: Tensor,
                 ) -> tuple[dict[str, object], bool]:
    """The paged kernel's ``w_*`` arguments for the part's window part ``w`` (None: no window
    part, and every window field must be None too), and ``W_TOKENS``.

    The window table defaults to the part's own table; a separate one (an engine's
    sliding-window KV group) must be of the same kind and dtype (the kernel reads both through
    one code path) and wide enough for any row: positions up to the part's ``max_len``.
    """
    w, window_size, window_out_slots = part.window, part.window_size, part.window_out_slots
    block_size, steps, page_size, bs = part.block_size, part.steps, part.page_size, part.bs
    if w is None:
        if window_size is not None or part.window_table is not None or (
                window_out_slots is not None):
            raise LayoutError("window_size, window_table and window_out_slots need a window part "
                              "(window buffers), got no window part")
        return {"w_tok_ptr": dummy, "w_slot_ptr": dummy,
                **part_pointers(PagedBuffers(dummy, dummy, None, None, None, None), dummy, "w_"),
                "win": 0, "win_q": 1, "win_max_len": 0, "w_tok_rows": 1, "w_tok_cols": 1,
                "w_tok_stride": 0, "w_pt_stride": 0, "w_cap_pages": 0, "w_indices_cap": 0,
                "w_slot_cap": 0, "w_len_sstride": 0, "w_cu_sstride": 0}, False
    checks.need(is_int(window_size) and window_size >= 1, InputError,
            f"window_size must be an int >= 1, got {window_size!r}")
    window_table = table if part.window_table is None else check_table(
        "window_table", part.window_table, dev)
    if window_table.dtype != table.dtype:
        raise InputError(f"the window table must have the request table's dtype {table.dtype}, "
                         f"got {window_table.dtype}")
    w_cols, _, _ = checks.block(window_table, block_size)  # (columns are clamped into it, as ever)
    lay = checks.layouts(w, bs, dev, pad_pages, steps if steps > 1 else 0)
    if lay != has_layouts:
        raise LayoutError(f"the window part must keep the part's layouts (page table, CSR) = "
                          f"{has_layouts}, got {lay}")
    window_slot_cap = 0
    if window_out_slots is not None:
        checks.need(tokens, InputError, "window_out_slots needs the part's token buffers (extend)")
        checks.need(isinstance(window_out_slots, Tensor), InputError,
                f"window_out_slots must be a torch.Tensor, got "
                f"{type(window_out_slots).__name__}")
        window_slot_cap = window_out_slots.shape[0]
        checks.vec("window_out_slots", window_out_slots, window_slot_cap, dev)
    cap = window_width(w)
    return {
        "w_tok_ptr": window_table, "w_slot_ptr": pointer_or(window_out_slots, dummy),
        **part_pointers(w, dummy, "w_"), "win": window_size, "win_q": max(part.extra, 1),
        "win_max_len": max(cap * page_size - (steps - 1), 0),
        "w_tok_rows": window_table.shape[0], "w_tok_cols": w_cols,
        "w_tok_stride": window_table.stride(0),
        "w_pt_stride": w.page_table.stride(0) if w.page_table is not None else 0,
        "w_cap_pages": cap,
        "w_indices_cap": w.kv_indices.shape[0] if w.kv_indices is not None else 0,
        "w_slot_cap": window_slot_cap,
        "w_len_sstride": w.cache_seqlens.stride(0) if steps > 1 else 0,
        "w_cu_sstride": w.cu_seqlens_k.stride(0) if steps > 1 else 0,
    }, window_out_slots is not None

"""Pure-torch versions of the sgl_kernel CPU ops that SGLang's speculative decoding calls on a
CPU (``sglang/kernels/ops/speculative/{cache_locs,eagle,spec_tree}.py``,
``kernels/ops/kvcache/cache_move.py`` and the intel_amx draft backend). Each is written from
the semantics of the Triton kernel beside its call site; loops over requests stay in Python
(the tests' batches are a few requests of a few tokens).

The spec tests' negative control makes :func:`build_draft_decode_metadata_cpu` hand the draft
model's decode steps a wrong history, so that the draft's proposals (and the accept counts)
change while the target's verification keeps the tokens right. The corruption:
``ATTNPOOL_SGLANG_CORRUPT_DRAFT``, or the text of the file that
``ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE`` names while that file exists (read at every call, so a
running engine can be switched): ``self``: every row's first draft slot (the step-0 query's
own K/V) names the newest committed token's slot instead; ``prefix``: the newest committed
slot names the one before it.
"""

from __future__ import annotations

import ctypes
import os

import torch

#: the verify-mask layouts of ``spec_tree.TreeMaskMode``
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``out_cache_loc`` (packed by request, in order) gets
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``."""
    del pool_len
    at = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(),
                       strict=True):
        out_cache_loc[at:at + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)
        at += e - s


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor,
                                           req_to_token: torch.Tensor, seq_lens: torch.Tensor,
                                           out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_cols: int) -> None:
    """Request ``i``'s ``topk * num_cols`` slots after its ``seq_lens[i]`` committed tokens
    go to ``out_cache_loc[i * topk * num_cols:][:topk * num_cols]``."""
    del pool_len
    width = topk * num_cols
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[r, s:s + width].to(
            out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                          bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """``bonus_tokens[i]``: request ``i``'s last accepted token (its row of
    ``accept_tokens`` is ``accept_stride`` wide, ``accept_lens[i]`` of them used)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """The slots ``out_cache_loc[j]`` of the accepted ``j`` (``accept_index`` entries other
    than -1, in order), packed at the front of ``accept_out_cache_loc``."""
    idx = accept_index.reshape(-1)
    idx = idx[idx != -1].long()
    accept_out_cache_loc[:idx.numel()] = out_cache_loc[idx].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """In every buffer (``data_ptrs[b]``, rows of ``strides[b]`` bytes), row ``tgt_loc[j]``
    becomes what row ``src_loc[j]`` held: all rows are read before any is written."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for _, s in pairs]
        for (t, _), row in zip(pairs, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def _parent_position(selected: list[int], parents: list[int], cur: int, topk: int
                     ) -> int | None:
    """The tree index of node ``cur + 1``'s parent (0: the root, the bonus token), or None
    where the parent is not among the selected nodes. ``selected[k]`` is node ``k + 1``'s
    index into the draft's flattened candidates; ``parents`` (this request's
    ``parent_list``) names each candidate group's source."""
    group = selected[cur] // topk
    if group == 0:
        return 0
    want = parents[group]
    for k, s in enumerate(selected):
        if s == want:
            return k + 1
    return None


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrieve_index: torch.Tensor,
                                    retrieve_next_token: torch.Tensor,
                                    retrieve_next_sibling: torch.Tensor, topk: int, depth: int,
                                    draft_token_num: int, tree_mask_mode: int) -> None:
    """The verify tree of each request's ``draft_token_num`` nodes (node 0 the bonus token,
    node ``k + 1`` the draft candidate ``selected_index[b, k]``): positions (prefix length +
    depth), the retrieve links (first child, next sibling; -1 where none; the caller fills
    them with -1) and the visibility mask (a node sees the root, its ancestors and itself).
    ``tree_mask_mode`` QLEN_ONLY: one ``n x n`` block per request; FULL_MASK: per request
    ``n`` rows of ``seq_len + n`` (prefix columns left as the caller filled them)."""
    n = draft_token_num
    mode = int(tree_mask_mode)
    if mode not in (FULL_MASK, QLEN_ONLY):
        raise NotImplementedError(f"tree_mask_mode {mode}")
    seq_lens = verified_seq_len.tolist()
    prefix = 0
    for b, seq_len in enumerate(seq_lens):
        selected = selected_index[b].tolist()
        parents = parent_list[b].tolist() if parent_list.dim() > 1 else parent_list.tolist()
        retrieve_index[b, 0] = b * n
        positions[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            retrieve_index[b, i] = b * n + i
            p = _parent_position(selected, parents, i - 1, topk)
            if p is not None:
                first = int(retrieve_next_token[b, p])
                retrieve_next_token[b, p] = i
                if first != -1:
                    retrieve_next_sibling[b, i] = first
        for x in range(n):
            if mode == QLEN_ONLY:
                row0 = n * n * b + n * x
            else:
                row0 = n * n * b + prefix * n + (seq_len + n) * x + seq_len
            tree_mask[row0] = True
            tree_mask[row0 + 1:row0 + n] = False
            if x == 0:
                continue
            cur, d = x - 1, 0
            for _ in range(depth):
                d += 1
                tree_mask[row0 + 1 + cur] = True
                p = _parent_position(selected, parents, cur, topk)
                if p is None or p == 0:
                    break
                cur = p - 1
            positions[b * n + x] = seq_len + d
        prefix += seq_len


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor,
                           accept_token_num: torch.Tensor, candidates: torch.Tensor,
                           retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor
                           ) -> None:
    """Greedy walk down each request's tree: at every level the first child (in sibling
    order) whose token equals the target's prediction at the last accepted node is accepted.
    ``accept_index[b]`` lists the accepted nodes (global indices, the root first),
    ``accept_token_num[b]`` counts the accepted drafts, and ``predicts`` (flat, per global
    node) gets the target's token at each accepted node."""
    steps = accept_index.shape[1]
    target = target_predict.reshape(-1).tolist()
    cands, index = candidates.tolist(), retrive_index.tolist()
    first, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    for b in range(len(cands)):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = first[b][cur]
            want = target[last]
            while cur != -1 and cands[b][cur] != want:
                cur = sibling[b][cur]
            if cur == -1:
                break
            predicts[last] = want
            accepted += 1
            last = index[b][cur]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def _corruption() -> str | None:
    """The negative control's corruption of the draft's decode table (module doc), if any."""
    flag = os.environ.get("ATTNPOOL_SGLANG_CORRUPT_DRAFT_FILE")
    if flag and os.path.exists(flag):
        with open(flag) as f:
            return f.read().strip()
    return os.environ.get("ATTNPOOL_SGLANG_CORRUPT_DRAFT")


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor,
                                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                                    topk: int, num_steps: int, pool_len: int) -> torch.Tensor:
    """The token table of the draft model's decode steps: row ``i * topk + j`` (request
    ``i``'s branch ``j``) holds the request's ``seq_lens[i]`` committed slots, then the
    branch's own ``num_steps`` draft slots (``req_to_token`` from
    ``seq_lens[i] + j * num_steps``, the layout of the draft's ``out_cache_loc``)."""
    bs = seq_lens.shape[0]
    table = torch.zeros((bs * topk, pool_len), dtype=req_to_token.dtype,
                        device=req_to_token.device)
    corrupt = _corruption()
    for i, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        for j in range(topk):
            row = table[i * topk + j]
            row[:s] = req_to_token[r, :s]
            row[s:s + num_steps] = req_to_token[r, s + j * num_steps:s + (j + 1) * num_steps]
            if corrupt == "prefix" and s > 1:
                row[s - 1] = row[s - 2]
            elif corrupt == "self" and s > 0:
                row[s] = row[s - 1]
    return table

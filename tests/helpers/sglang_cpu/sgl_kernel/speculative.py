"""``sgl_kernel.speculative``: the one op SGLang's NGRAM worker imports from it on a CPU."""

from __future__ import annotations

import torch


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrieve_index: torch.Tensor,
                                       retrieve_next_token: torch.Tensor,
                                       retrieve_next_sibling: torch.Tensor, batch_size: int,
                                       draft_token_num: int) -> None:
    """The verify metadata of NGRAM's trees from their masks (``tree_mask[b, i, j]``, flat:
    node ``j`` is visible to node ``i``; its strict ancestors are the visible ``j < i``): per
    node its position (prefix length + number of ancestors), its global index, its first
    child (the smallest node it is the parent of) and its next sibling (the next node with
    the same parent; -1 for the root and where none). The parent is the nearest ancestor;
    the first child is the smallest node that has this one among its ancestors."""
    n = draft_token_num
    if batch_size == 0:
        return
    mask = tree_mask[:batch_size * n * n].reshape(batch_size, n, n).bool()
    lower = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril(-1)
    anc = mask & lower  # anc[b, i, j]: j a strict ancestor of i
    depth = anc.sum(-1)
    positions[:batch_size * n] = (depth + verified_seq_len[:batch_size, None].to(depth.dtype)
                                  ).reshape(-1).to(positions.dtype)
    retrieve_index[:batch_size] = (torch.arange(batch_size * n, device=mask.device)
                                   .reshape(batch_size, n).to(retrieve_index.dtype))
    cols = torch.arange(n, device=mask.device)
    parent = torch.where(anc, cols, -1).amax(-1)  # (b, n): nearest ancestor, or -1
    for b in range(batch_size):
        par = parent[b].tolist()
        below = anc[b].tolist()
        first_child = [next((k for k in range(t + 1, n) if below[k][t]), -1) for t in range(n)]
        next_sibling = [-1] * n
        for t in range(n):
            if par[t] < 0:
                continue
            for k in range(t + 1, n):
                if par[k] == par[t]:
                    next_sibling[t] = k
                    break
        retrieve_next_token[b] = torch.tensor(first_child, dtype=retrieve_next_token.dtype)
        retrieve_next_sibling[b] = torch.tensor(next_sibling, dtype=retrieve_next_sibling.dtype)

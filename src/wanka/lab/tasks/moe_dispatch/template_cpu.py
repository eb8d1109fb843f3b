"""MoE dispatch -> per-expert scaling -> combine on CPU, one point of the lab's variant
space (the search rewrites CONFIG).

- sort: how token copies are grouped by expert: a stable argsort (the reference), an
  unstable one (any order within an expert is fine: combine undoes it), or a counting
  sort built from bincount + cumsum.
- combine: "copy_einsum" puts rows back in slot order then sums with the weights (the
  reference); "index_add" adds weighted rows straight into the output by token id;
  "unsort" gathers rows back through the inverse permutation.
- scale: "gather" multiplies each grouped row by its expert's row of expert_scale;
  "segments" loops over experts on contiguous slices.
"""

import torch

CONFIG = {"sort": "stable", "combine": "copy_einsum", "scale": "gather"}


def _order(flat, n_experts):
    if CONFIG["sort"] == "stable":
        return torch.argsort(flat, stable=True)
    if CONFIG["sort"] == "unstable":
        return torch.argsort(flat)
    counts = torch.bincount(flat, minlength=n_experts)
    start = torch.cumsum(counts, 0) - counts
    onehot = torch.nn.functional.one_hot(flat, n_experts)
    within = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    pos = start[flat] + within  # destination of each copy: stable by construction
    order = torch.empty_like(pos)
    order[pos] = torch.arange(flat.numel())
    return order


def kernel(x, expert_idx, weights, expert_scale):
    """x [N, D], expert_idx [N, k], weights [N, k], expert_scale [E, D] -> [N, D]."""
    N, k = expert_idx.shape
    E = expert_scale.shape[0]
    flat = expert_idx.reshape(-1)
    order = _order(flat, E)
    token = torch.div(order, k, rounding_mode="floor")
    grouped = x.index_select(0, token)
    experts = flat[order]
    if CONFIG["scale"] == "segments":
        counts = torch.bincount(flat, minlength=E).tolist()
        parts, s = [], 0
        for e, c in enumerate(counts):
            if c:
                parts.append(grouped[s : s + c] * expert_scale[e])
            s += c
        y = torch.cat(parts)
    else:
        y = grouped * expert_scale.index_select(0, experts)
    w = weights.reshape(-1)[order].to(y.dtype)
    if CONFIG["combine"] == "index_add":
        return torch.zeros(N, x.shape[1], dtype=y.dtype).index_add(0, token, y * w[:, None])
    if CONFIG["combine"] == "unsort":
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel())
        back = y.index_select(0, inv).view(N, k, -1)
        return torch.einsum("nkd,nk->nd", back, weights.to(y.dtype))
    out = torch.zeros(N * k, y.shape[-1], dtype=y.dtype).index_copy(0, order, y).view(N, k, -1)
    return torch.einsum("nkd,nk->nd", out, weights.to(y.dtype))

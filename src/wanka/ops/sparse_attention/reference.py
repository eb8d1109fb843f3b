"""DSA core attention over the top-k selected keys, MQA form: the gather base implementation.

It materialises the gathered [B, L, K, D] keys and values, which is what the fast backends
(a separate issue) must avoid; it is the definition of correct.

Index contract (every backend): indices [B, L, K] int64, -1 = empty slot, anywhere in a row.
Each valid slot is one term of the softmax: a key selected in two slots of one query counts
twice (per-slot semantics; the indexer's top-k never repeats a key, other callers may).
Empty slots contribute nothing: they read a zero row appended to K and V, never a real row,
and their scores are replaced by -inf, so a non-finite value in one document cannot reach
another document's queries (forward or backward).

Queries may be a suffix of the keys (context parallelism; `wanka.ops.registry` docstring):
q and indices have Lq <= Lk tokens, k / v have Lk, and indices are key positions in
[0, Lk). Nothing here depends on where the queries sit: the indices say what each sees.
"""

from __future__ import annotations

import torch

from wanka.ops.common import upcast
from wanka.ops.registry import register


def gather_selected(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [B, Lk, D], indices [B, Lq, K] (-1 = empty) -> [B, Lq, K, D]; empty slots read zeros.

    x gets a zero row Lk appended, which the empty slots gather: the same one gather as
    reading row 0, but no value of x reaches them (where / multiplication by a zero weight
    would not do: inf * 0 is NaN)."""
    B, Lq, K = indices.shape
    Lk, D = x.shape[1], x.shape[-1]
    padded = torch.cat([x, x.new_zeros(B, 1, D)], dim=1)
    flat = indices.masked_fill(indices < 0, Lk).reshape(B, Lq * K)
    return torch.gather(padded, 1, flat[..., None].expand(B, Lq * K, D)).view(B, Lq, K, D)


@register("sparse_attention", "reference")
def sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Lq, H, D]; k, v [B, Lk, D]; indices [B, Lq, K] int64 key positions in [0, Lk)
    (-1 = empty slot) -> [B, Lq, H, D]. Lq <= Lk (a query suffix under context parallelism).

    Callers guarantee every valid index is a key the query may see and that each row has at
    least one valid slot (the indexer always finds the query itself visible). Duplicate
    indices are allowed and count once per slot (see the module docstring).
    """
    k_sel, v_sel = gather_selected(k, indices), gather_selected(v, indices)
    scores = torch.einsum("blhd,blkd->blhk", q, k_sel) * scale
    scores = scores.masked_fill((indices < 0)[:, :, None], float("-inf"))
    probs = torch.softmax(upcast(scores), dim=-1).to(v.dtype)
    return torch.einsum("blhk,blkd->blhd", probs, v_sel)

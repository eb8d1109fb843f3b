"""Lightning indexer on Ascend NPUs via torch_npu's fused LightningIndexer.

Calls `torch_npu.npu_lightning_indexer` (forward, `return_value=True` for the scores) and
`torch_npu.npu_lightning_indexer_grad` (backward: dq, dk, dw from the upstream gradient of
the selected scores). Their documented limits (torch_npu API reference
`torch_npu-npu_lightning_indexer.md`, CANN `aclnnLightningIndexerGrad.md`), and what wanka
does with each:

* index heads N1 = 64 and head dim D = 128 only, one key head (N2 = 1); float16 / bfloat16,
  query, key and weights of one dtype; sparse_count (top-k) in [1, 2048].
* layout TND with per-sequence cumulative lengths is how packed documents are expressed:
  every document of every batch row becomes one sequence (T = B * L tokens, q [T, 64, 128],
  k [T, 1, 128], w [T, 64], actual_seq_lengths_query = actual_seq_lengths_key = cumulative
  document ends, int32) and `sparse_mode=3` (causal) masks the future inside each.
  The returned indices [T, 1, k] are read as positions inside the query's own sequence
  (document), as in the op's TND use with SparseFlashAttention; wanka adds the document start
  to get row positions, and treats any slot outside [0, position in document] as empty (-1,
  score -inf). Slots are then sorted by descending score (valid first) to match wanka's
  contract; the backward maps the gradient back to the op's slot order.
* the grad op is documented for top-k = 2048 with every key sequence at least top-k long
  (GRAD_TOPK); a backward outside that falls back.

Not guaranteed to match the reference bit for bit: the fused op computes in 16-bit and its
tie rule among equal scores is not documented (wanka's reference keeps the most recent key).
Queries as a suffix of the keys (Lq < Lk, context parallelism; `wanka.ops.registry`
docstring) are not mapped to the TND layout (the op's rightDownCausal mode with separate
query / key lengths might fit, but that is untested): such calls count as outside the limits.

`unsupported` is also this backend's registry `supports` check, so `registry.call` skips it
for anything outside the limits (a forced npu backend raises). Called directly, anything
outside the limits runs `reference.lightning_indexer`, with one log line per reason.
The layout conversion is tested on CPU against a stand-in torch_npu
(tests/unit/test_ops_npu.py); the fused path itself has not run on Ascend hardware here.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from wanka.ops.dense_attention.cpu import check_doc_ids
from wanka.ops.lightning_indexer import reference
from wanka.ops.lightning_indexer.cpu import _doc_starts
from wanka.ops.npu_common import fallback_once, has_torch_npu, load_torch_npu
from wanka.ops.registry import query_suffix_unsupported, register

OP = "lightning_indexer"
HEADS = 64  # index heads N1
HEAD_DIM = 128  # index head dim D
DTYPES = (torch.float16, torch.bfloat16)
MAX_TOPK = 2048  # sparse_count range [1, 2048]
GRAD_TOPK = 2048  # top-k the grad op is documented for (and every sequence >= it)
SPARSE_MODE = 3  # rightDownCausal: causal inside each TND sequence


def unsupported(q, k, w, doc_ids, topk: int, needs_grad: bool) -> str | None:
    """Why the fused op cannot take these inputs (None: it can)."""
    B, L, Hi, Di = q.shape
    why = query_suffix_unsupported(q, k)
    if why is not None:
        return why
    if q.dtype not in DTYPES or k.dtype != q.dtype or w.dtype != q.dtype:
        return (
            f"dtype {q.dtype}/{k.dtype}/{w.dtype}: the fused op takes float16/bfloat16, one dtype"
        )
    if Hi != HEADS or Di != HEAD_DIM:
        return f"{Hi} index heads x dim {Di}: the fused op takes {HEADS} x {HEAD_DIM}"
    if not 1 <= topk <= MAX_TOPK:
        return f"top-k {topk}: the fused op takes 1..{MAX_TOPK}"
    if needs_grad:
        if topk != GRAD_TOPK:
            return f"backward with top-k {topk}: the grad op is documented for {GRAD_TOPK}"
        if int(_segments(doc_ids)[1].min()) < GRAD_TOPK:
            return f"backward with a document shorter than top-k {GRAD_TOPK}"
    return None


def _segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents of all rows as TND sequences -> (cumulative ends [n] int32, lengths [n])."""
    B, L = doc_ids.shape
    first = torch.ones(B, L, dtype=torch.bool, device=doc_ids.device)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    starts = first.reshape(-1).nonzero().view(-1)
    ends = torch.cat([starts[1:], starts.new_tensor([B * L])])
    return ends.to(torch.int32), ends - starts


def to_tnd(q, k, w, doc_ids):
    """wanka layout -> the fused op's TND inputs (query, key, weights, cumulative lengths)."""
    B, L, Hi, Di = q.shape
    cu, _ = _segments(doc_ids)
    query = q.reshape(B * L, Hi, Di).contiguous()
    key = k.reshape(B * L, 1, Di).contiguous()
    weights = w.reshape(B * L, Hi).contiguous()
    return query, key, weights, cu


def from_tnd(raw_idx, raw_val, doc_ids, topk):
    """The op's [T, 1, k] per-document indices and scores -> wanka's [B, L, k] row indices
    (-1 empty) and scores (-inf empty), sorted by descending score; plus the slot order
    used (to map gradients back)."""
    B, L = doc_ids.shape
    starts = _doc_starts(doc_ids)  # [B, L] row position of each token's document start
    rel_pos = (torch.arange(L, device=doc_ids.device) - starts)[..., None]  # [B, L, 1]
    rel = raw_idx.reshape(B, L, topk).long()
    valid = (rel >= 0) & (rel <= rel_pos)
    val = raw_val.reshape(B, L, topk).masked_fill(~valid, float("-inf"))
    order = torch.sort(val, dim=-1, descending=True, stable=True).indices
    idx = torch.where(valid, rel + starts[..., None], torch.full_like(rel, -1))
    return idx.gather(-1, order), val.gather(-1, order), order


def supports(q, k, w, doc_ids, topk: int, *_args, **_kwargs) -> str | None:
    """The registry's per-call check: `unsupported` with the call's own gradient need."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, w))
    return unsupported(q, k, w, doc_ids, int(topk), needs_grad)


class _FusedIndexer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, doc_ids, topk):
        npu = load_torch_npu()
        query, key, weights, cu = to_tnd(q, k, w, doc_ids)
        raw_idx, raw_val = npu.npu_lightning_indexer(
            query, key, weights,
            actual_seq_lengths_query=cu, actual_seq_lengths_key=cu, block_table=None,
            layout_query="TND", layout_key="TND", sparse_count=topk,
            sparse_mode=SPARSE_MODE, return_value=True,
        )  # fmt: skip
        idx, val, order = from_tnd(raw_idx, raw_val, doc_ids, topk)
        ctx.save_for_backward(query, key, weights, cu, raw_idx, order, idx)
        ctx.shapes = (q.shape, k.shape, w.shape)
        ctx.mark_non_differentiable(idx)
        return idx, val

    @staticmethod
    @once_differentiable
    def backward(ctx, _g_idx, g_val):
        npu = load_torch_npu()
        query, key, weights, cu, raw_idx, order, idx = ctx.saved_tensors
        g = g_val.masked_fill(idx < 0, 0.0).to(query.dtype)
        dy = torch.zeros_like(g).scatter_(-1, order, g)  # back to the op's slot order
        dq, dk, dw = npu.npu_lightning_indexer_grad(
            query, key, dy.reshape(raw_idx.shape), raw_idx, weights,
            actual_seq_lengths_query=cu, actual_seq_lengths_key=cu,
            layout="TND", sparse_mode=SPARSE_MODE,
        )  # fmt: skip
        q_shape, k_shape, w_shape = ctx.shapes
        needs = ctx.needs_input_grad
        return (
            dq.reshape(q_shape) if needs[0] else None,
            dk.reshape(k_shape) if needs[1] else None,
            dw.reshape(w_shape) if needs[2] else None,
            None,
            None,
        )


@register(OP, "npu", device_types=("npu",), priority=20, available=has_torch_npu, supports=supports)
def lightning_indexer(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, doc_ids: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `reference.lightning_indexer`: q [B, L, Hi, Di], k [B, L, Di],
    w [B, L, Hi], doc_ids [B, L] (rows non-decreasing) -> (indices [B, L, topk] int64, -1 in
    empty slots; scores [B, L, topk], -inf in empty slots; differentiable w.r.t. q, k, w)."""
    check_doc_ids(doc_ids)
    why = "torch_npu does not import" if not has_torch_npu() else None
    why = why or supports(q, k, w, doc_ids, topk)
    if why is not None:
        fallback_once(OP, why)
        return reference.lightning_indexer(q, k, w, doc_ids, topk)
    return _FusedIndexer.apply(q, k, w, doc_ids, int(topk))

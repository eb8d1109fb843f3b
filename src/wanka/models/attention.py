"""Attention with DSA fine-grained sparse attention (MQA form) and the lightning indexer.

Each query attends only to the top-k keys the indexer picks; one KV head is shared by all
query heads. Layers without an indexer reuse the indices of the last layer that has one
(cross-layer index sharing). Sequences no longer than k use dense attention.

Training phases:
  dense_warmup: attention is dense; the indexer learns KL(dense attention || indexer) over all
                visible keys; nothing else learns.
  sparse:       attention is sparse; the indexer learns KL over the selected set from a
                detached input; the model learns from the LM loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.layers import Linear, apply_rope, rope_table


@dataclass
class AttnAux:
    """What one attention layer hands to the next and to the loss."""

    indices: torch.Tensor | None  # top-k indices to share with following layers
    kl_sum: torch.Tensor | None  # indexer KL summed over query tokens (None: no indexer)
    kl_count: int = 0
    keys: tuple[torch.Tensor, torch.Tensor] | None = None  # this pass's (k, v) [B, L, D]


@dataclass
class DraftKeys:
    """What a recursive MTP draft step attends to besides its own key (EAGLE-3's training-time
    test, `ops extra_key_attention`): the first pass's k, v [B, L, D] (query t reads those at
    <= t of its document, or its selection) and the keys the earlier draft steps wrote for
    the same query, each [B, L, D]."""

    k: torch.Tensor
    v: torch.Tensor
    extra_k: tuple[torch.Tensor, ...] = ()
    extra_v: tuple[torch.Tensor, ...] = ()

    def then(self, keys: tuple[torch.Tensor, torch.Tensor]) -> DraftKeys:
        """The next step's view: this step's own (k, v) joins the extra keys."""
        return DraftKeys(self.k, self.v, (*self.extra_k, keys[0]), (*self.extra_v, keys[1]))


class Indexer(nn.Module):
    """Lightning indexer: a few small ReLU heads and one shared key head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_index_heads, cfg.index_head_dim
        self.wq = Linear(cfg.dim, cfg.n_index_heads * cfg.index_head_dim, bias=False)
        self.wk = Linear(cfg.dim, cfg.index_head_dim, bias=False)
        self.wk_norm = nn.LayerNorm(cfg.index_head_dim)
        self.ww = Linear(cfg.dim, cfg.n_index_heads, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, positions: torch.Tensor):
        B, L, _ = x.shape
        q = apply_rope(self.wq(x).view(B, L, self.n_heads, self.head_dim), rope, positions)
        k = apply_rope(self.wk_norm(self.wk(x)), rope, positions)
        w = self.ww(x) * self.n_heads**-0.5
        return q, k, w


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, has_indexer: bool) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.n_heads, cfg.head_dim, cfg.index_topk
        self.scale = cfg.head_dim**-0.5
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv = Linear(cfg.dim, 2 * cfg.head_dim, bias=False)  # the single MQA KV head
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.indexer = Indexer(cfg) if has_indexer else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        doc_ids: torch.Tensor,
        ropes: dict[str, torch.Tensor],
        shared_indices,
        phase: str,
        layout=None,
        draft: DraftKeys | None = None,
    ) -> tuple[torch.Tensor, AttnAux]:
        """layout: None, or a CPLayout (distributed/context_parallel.py) when this rank holds
        only some pieces of the sequences: then keys come from the whole CP group and
        `shared_indices` is one index tensor per layout segment.
        draft: a recursive MTP draft step (no indexer, whole rows): query t attends to the
        first pass's keys and its own extra keys, `_draft_core`."""
        B, L, _ = x.shape
        q, k, v, qi, ki, wi = self._project(x, positions, ropes)
        if draft is not None:
            if layout is not None or self.indexer is not None:
                raise ValueError("a recursive draft step runs an MTP block (no indexer) on whole "
                                 "rows (no context-parallel layout)")  # fmt: skip
            out = self._draft_core(q, k, v, doc_ids, shared_indices, phase, draft)
            return self._output(out), AttnAux(None, None, 0, (k, v))
        if layout is None:
            out, indices, kl_sum = self._core(q, k, v, qi, ki, wi, doc_ids, shared_indices,
                                              phase, sparse=L > self.topk)  # fmt: skip
        else:
            out, indices, kl_sum = self._core_cp(q, k, v, qi, ki, wi, doc_ids, shared_indices,
                                                 phase, layout)  # fmt: skip
        aux = AttnAux(indices, kl_sum, B * L if kl_sum is not None else 0, (k, v))
        return self._output(out), aux

    def _draft_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    doc_ids: torch.Tensor, shared: torch.Tensor | None, phase: str,
                    draft: DraftKeys) -> torch.Tensor:  # fmt: skip
        """Recursive draft step s (s >= 2) at slot t + s - 1, all t at once, as the decoder runs
        it (infer/generate.py, `_draft`): the MTP cache holds the first pass's keys up to t,
        then the earlier steps' keys and this one's (the E = s - 1 extra keys). Sparse as the
        first pass is: the main model's selection at t plus the extra keys, nothing cut (so a
        query that still sees every key of its document, n_t <= k, attends to all of them,
        as the decoder's dense step does)."""
        extra_k = torch.stack([*draft.extra_k, k], dim=2)
        extra_v = torch.stack([*draft.extra_v, v], dim=2)
        sparse = shared is not None and phase == "sparse" and q.shape[1] > self.topk
        indices = shared if sparse else None
        return ops.call("extra_key_attention", q, draft.k, draft.v, doc_ids, indices, extra_k,
                        extra_v, self.scale)  # fmt: skip

    def _sparse(self, q, k, v, indices) -> torch.Tensor:
        """Core attention over the selected keys (MLA: its latent form)."""
        return ops.call("sparse_attention", q, k, v, indices, self.scale)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """[B, L, H, D] per-head attention output -> [B, L, dim]."""
        return self.wo(out.reshape(*out.shape[:2], -1))

    def _project(self, x: torch.Tensor, positions: torch.Tensor, ropes: dict[str, torch.Tensor]):
        """-> q [B, L, H, D], k, v [B, L, D] (RoPE on q, k) and the indexer's (q, k, w) or Nones."""
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, self.head_dim)
        k, v = self.wkv(x).split(self.head_dim, dim=-1)
        q = apply_rope(q, ropes["attn"], positions)
        k = apply_rope(k, ropes["attn"], positions)
        qi = ki = wi = None
        if self.indexer is not None:
            # The indexer never sends gradient into the model: its input is detached.
            qi, ki, wi = self.indexer(x.detach(), ropes["index"], positions)
        return q, k, v, qi, ki, wi

    def decode(self, x, positions, ropes, cache, start: int, docs: torch.Tensor, shared_indices,
               q_from: int = 0):  # fmt: skip
        """Inference over a KV cache: the Lq new tokens x sit at cache slots [start, start + Lq);
        their keys are written there and the queries read slots [0, start + Lq) (`docs` holds
        those slots' document ids; pad slots are a document of their own). Sparse once the
        cache holds more than k slots, as training is for rows longer than k. `q_from` > 0:
        only the new tokens from q_from on query (the others' keys are still written; shared
        indices are per new token, all Lq of them).
        -> (out [B, Lq - q_from, dim], top-k indices or the shared ones / None while dense)."""
        q, k, v, qi, ki, wi = self._project(x, positions, ropes)
        if q_from:
            q = q[:, q_from:]
            qi, wi = (qi[:, q_from:], wi[:, q_from:]) if qi is not None else (qi, wi)
            if shared_indices is not None:
                shared_indices = shared_indices[:, q_from:]
        shared_kv = v is k  # MLA: one latent tensor is key and value; cache it once
        keys, values, index_keys = cache.write(start, k, None if shared_kv else v, ki)
        values = keys if shared_kv else values
        indices = shared_indices
        # A layer without an indexer and no indices to share (an MTP draft step past k while
        # the main model was still dense) attends densely.
        if keys.shape[1] > self.topk and (self.indexer is not None or indices is not None):
            if self.indexer is not None:
                indices, _ = ops.call("lightning_indexer", qi, index_keys, wi, docs, self.topk)
            out = self._sparse(q, keys, values, indices)
        else:
            out = ops.call("dense_attention", q, keys, values, docs, self.scale)
        return self._output(out), indices

    def _core_cp(self, q, k, v, qi, ki, wi, doc_ids, shared, phase, layout):
        """Each segment's queries against its keys (local, or its document's gathered prefix)."""
        # One collective for K, V and the indexer keys: its backward (a reduce-scatter) then has
        # one place in every rank's autograd graph, whatever each rank's segments look like.
        # MLA passes one tensor as key and value (K = V): gathered once.
        if phase != "sparse":
            # Dense warm-up trains the indexers only (its loss reads q and k detached): K and V
            # gathered with grad would send the tie's zeros below into every parameter on the
            # ranks that gather only, and FSDP's reduce-scatter of those grads would then
            # differ in size between CP groups that gather and groups that do not.
            k, v = (k.detach(), None) if v is k else (k.detach(), v.detach())
            v = k if v is None else v
        parts = [k] + ([] if v is k else [v]) + ([ki] if ki is not None else [])
        gathered = layout.gather(torch.cat(parts, dim=-1)).split([t.shape[-1] for t in parts], -1)
        kg = gathered[0]
        vg = kg if v is k else gathered[1]
        kig = gathered[-1] if ki is not None else None
        outs, indices, kl_sum = [], [], None
        for n, seg in enumerate(layout.segments):
            a, b = seg.q0, seg.q1
            if seg.keys is None:
                ks, vs, docs = k[:, a:b], v[:, a:b], doc_ids[:, a:b]
                kis = ki[:, a:b] if ki is not None else None
            else:
                ks, vs, docs = kg[:, seg.keys], vg[:, seg.keys], seg.key_docs
                kis = kig[:, seg.keys] if kig is not None else None
            qis, wis = (qi[:, a:b], wi[:, a:b]) if qi is not None else (None, None)
            out, idx, kl = self._core(q[:, a:b], ks, vs, qis, kis, wis, docs,
                                      shared[n] if shared is not None else None, phase,
                                      sparse=layout.sparse)  # fmt: skip
            outs.append(out)
            indices.append(idx)
            if kl is not None:
                kl_sum = kl if kl_sum is None else kl_sum + kl
        out = torch.cat(outs, dim=1)
        if layout.needs_gather:
            # Every rank must reach the gather's backward (a collective), even one whose
            # segments read no remote key: tie the gathered buffer at zero cost into both
            # things a loss may use (the output, and in dense warm-up only the indexer's KL).
            tie = 0.0 * sum(t.sum() for t in gathered)
            out = out + tie
            kl_sum = kl_sum + tie if kl_sum is not None else None
        return out, (indices if self.indexer is not None else shared), kl_sum

    def _core(self, q, k, v, qi, ki, wi, doc_ids, indices, phase, sparse: bool):
        """Attention of queries q (a suffix of the keys' positions) -> (out, indices, KL sum)."""
        kl_sum = None
        if self.indexer is not None:
            if sparse and phase == "sparse":
                indices, sel_scores = ops.call("lightning_indexer", qi, ki, wi, doc_ids, self.topk)
                target = ops.call("attention_probs", q.detach(), k.detach(), doc_ids, self.scale,
                                  indices=indices)  # fmt: skip
                kl_sum = _kl(target, sel_scores)
            else:
                # Dense warm-up (or a sequence no longer than k): learn the full distribution
                # (the op computes it over blocks of queries: no [L, L] matrix).
                kl_sum = ops.call("indexer_kl", q.detach(), k.detach(), qi, ki, wi, doc_ids,
                                  self.scale)  # fmt: skip

        if sparse and phase == "sparse":
            if indices is None:
                raise RuntimeError(
                    "sparse attention layer has neither an indexer nor shared indices"
                )
            out = self._sparse(q, k, v, indices)
        else:
            out = ops.call("dense_attention", q, k, v, doc_ids, self.scale)
        return out, indices, kl_sum


def _kl(target: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """sum over queries of KL(target || softmax(scores)); -inf scores are empty/invisible keys."""
    hidden = torch.isinf(scores)
    logq = F.log_softmax(scores.float(), dim=-1).masked_fill(hidden, 0.0)
    p = target.masked_fill(hidden, 0.0)
    return (torch.xlogy(p, p) - p * logq).sum()


def make_ropes(cfg: ModelConfig, device=None) -> dict[str, torch.Tensor]:
    """RoPE tables: attention (MLA: its decoupled RoPE dims, which MLA's indexer uses too) and
    the MQA indexer's."""
    attn_dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
    return {
        "attn": rope_table(attn_dim, cfg.max_seq_len, cfg.rope_theta, device),
        "index": rope_table(cfg.index_head_dim, cfg.max_seq_len, cfg.rope_theta, device),
    }

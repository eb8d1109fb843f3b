"""Decoder-only MoE transformer with DSA sparse attention and multi-token prediction.

Single-device code: parallelism is applied from outside (distributed/parallelize.py).
Build on the meta device, `to_empty`, then `init_weights(seed)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.attention import Attention, DraftKeys, make_ropes
from wanka.models.layers import FeedForward, Linear, RMSNorm
from wanka.models.mla import MLAttention
from wanka.models.moe import MoE, MoELosses


@dataclass
class LossParts:
    """Sums and counts, so the trainer can normalise by global token counts across ranks."""

    lm_sum: torch.Tensor
    lm_count: torch.Tensor
    mtp_sum: torch.Tensor
    mtp_count: torch.Tensor
    kl_sum: torch.Tensor
    kl_count: int
    balance: torch.Tensor  # batch-wise balance loss, mean over MoE layers
    seq_balance: torch.Tensor  # sequence-wise balance loss (mean over rows), mean over MoE layers
    logits: torch.Tensor | None = None  # [B, L, V] of the main head, when asked for
    # mtp_self with draft_steps > 1: (KL sum, count) of each recursive draft step 2, 3, ...
    draft_kl: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, has_indexer: bool, is_moe: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = (MLAttention if cfg.attention == "mla" else Attention)(cfg, has_indexer)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoE(cfg) if is_moe else None
        self.ffn = None if is_moe else FeedForward(cfg.dim, cfg.dense_hidden)

    def forward(self, x, positions, doc_ids, ropes, shared_indices, phase, layout=None,
                draft: DraftKeys | None = None):  # fmt: skip
        h, aux = self.attention(
            self.attention_norm(x), positions, doc_ids, ropes, shared_indices, phase, layout, draft
        )
        x = x + h
        moe_losses: MoELosses | None = None
        if self.moe is not None:
            f, moe_losses = self.moe(self.ffn_norm(x))
        else:
            f = self.ffn(self.ffn_norm(x))
        return x + f, aux, moe_losses

    def decode(self, x, positions, ropes, cache, start, docs, shared_indices, q_from: int = 0):
        """Inference over this block's KV cache (Attention.decode) -> (x, indices), for the new
        tokens from q_from on (the earlier ones only write their keys)."""
        h, indices = self.attention.decode(self.attention_norm(x), positions, ropes, cache, start,
                                           docs, shared_indices, q_from)  # fmt: skip
        x = x[:, q_from:] + h
        f = self.moe(self.ffn_norm(x))[0] if self.moe is not None else self.ffn(self.ffn_norm(x))
        return x + f, indices


class MTPModule(nn.Module):
    """One multi-token-prediction depth (DeepSeek-V3 style): combine the previous depth's
    hidden state with the embedding of the next token, run one block, share the head. The block
    attends sparsely with the main model's last top-k indices (no indexer of its own)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = Block(cfg, has_indexer=False, is_moe=False)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    cfg, has_indexer=i % cfg.index_share_every == 0, is_moe=i >= cfg.n_dense_layers
                )
                for i in range(cfg.n_layers)
            }
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.mtp_depth))
        for name, t in make_ropes(cfg, device="meta").items():
            self.register_buffer(f"rope_{name}", t, persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init from `seed`, independent of how the model will be sharded."""
        gen = torch.Generator().manual_seed(seed)
        std, out_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf in ("weight", "bias"):
                p.fill_(1.0 if leaf == "weight" else 0.0)
            else:
                s = out_std if name.endswith(("wo.weight", "w2.weight", ".w2")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)
        for name, b in self.named_buffers():
            if name.startswith("rope_"):
                b.copy_(make_ropes(self.cfg, device=b.device)[name.removeprefix("rope_")])
            else:
                b.zero_()

    def moe_layers(self) -> list[MoE]:
        return [blk.moe for blk in self.layers.values() if blk.moe is not None]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(h)
        return ops.call("linear", h, self.tok_embeddings.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        doc_ids: torch.Tensor,
        labels: torch.Tensor,
        phase: str = "sparse",
        layout=None,
        return_logits: bool = False,
        mtp_self: bool = False,
        draft_steps: int = 1,
    ) -> LossParts:
        """layout: None, or a CPLayout when the rows are split over a context-parallel group
        (it also carries the tokens and labels MTP looks ahead to, held by other ranks).
        return_logits: also return the main head's logits and skip MTP (post-training scores
        every vocabulary entry; through forward so that FSDP's hooks gather the weights).
        mtp_self: MTP depth d at t learns the main model's own (detached) next-token
        distribution at t + d, KL(main || MTP), instead of the label there: the drafts that
        speculative decoding keeps are the ones the main model would have chosen
        (`wanka draft`). Needs the whole rows on this rank (no layout).
        draft_steps > 1 (with mtp_self): depth 1 is also trained as the decoder reuses it for
        drafts 2 .. draft_steps, on its own output (`_recursive_drafts`); their KLs come back
        in LossParts.draft_kl, mtp_sum / mtp_count stay the first draft's."""
        if mtp_self and (layout is not None or return_logits):
            raise ValueError("mtp_self needs the main logits of whole rows: no context "
                             "parallel layout, no return_logits")  # fmt: skip
        if draft_steps > 1 and not (mtp_self and self.mtp):
            raise ValueError("draft_steps > 1 trains the recursive drafts of MTP depth 1 against "
                             "the main model: needs mtp_self and an MTP module")  # fmt: skip
        ropes = {"attn": self.rope_attn, "index": self.rope_index}
        h = self.tok_embeddings(tokens)
        indices, kl_sum, kl_count, moe_losses = None, h.new_zeros(()), 0, []
        for blk in self.layers.values():
            h, aux, losses = blk(h, positions, doc_ids, ropes, indices, phase, layout)
            indices = aux.indices if aux.indices is not None else indices
            if aux.kl_sum is not None:
                kl_sum, kl_count = kl_sum + aux.kl_sum, kl_count + aux.kl_count
            if losses is not None:
                moe_losses.append(losses)
        logits = self._logits(self.norm(h))
        if return_logits or mtp_self:  # the caller scores the logits itself / MTP's target
            lm_sum, lm_count = logits.new_zeros(()), labels.new_zeros(())
        else:
            lm_sum, lm_count = _ce(logits, labels)

        mtp_sum, mtp_count = h.new_zeros(()), h.new_zeros((), dtype=torch.long)
        draft_kl = ()
        for d, mtp in enumerate(self.mtp if not return_logits else (), start=1):
            # depth d at position t predicts token t+d+1: shift tokens/labels left by d.
            ahead = _shift(tokens, d, 0) if layout is None else layout.mtp_tokens[d - 1]
            nxt = self.tok_embeddings(ahead)
            h = mtp.proj(torch.cat([mtp.hidden_norm(h), mtp.embed_norm(nxt)], dim=-1))
            h, aux, _ = mtp.block(h, positions, doc_ids, ropes, indices, phase, layout)
            target = mtp_labels(labels, doc_ids, d) if layout is None else layout.mtp_labels[d - 1]
            if mtp_self:
                s, c = _kl_to_main(self._logits(mtp.norm(h)), logits, target != -100, d)
            else:
                s, c = _ce(self._logits(mtp.norm(h)), target)
            mtp_sum, mtp_count = mtp_sum + s, mtp_count + c
            if d == 1 and draft_steps > 1:
                draft_kl = self._recursive_drafts(mtp, h, aux.keys, tokens, positions, doc_ids,
                                                  ropes, indices, phase, logits, labels,
                                                  draft_steps)  # fmt: skip

        if moe_losses:
            balance, seq_balance = (torch.stack(t).mean() for t in zip(*moe_losses))
        else:
            balance = seq_balance = h.new_zeros(())
        return LossParts(lm_sum, lm_count, mtp_sum, mtp_count, kl_sum, kl_count, balance,
                         seq_balance, logits if return_logits else None, draft_kl)  # fmt: skip

    def _recursive_drafts(self, mtp: MTPModule, h: torch.Tensor,
                          keys: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor,
                          positions: torch.Tensor, doc_ids: torch.Tensor,
                          ropes: dict[str, torch.Tensor], indices: torch.Tensor | None,
                          phase: str, main_logits: torch.Tensor, labels: torch.Tensor,
                          steps: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:  # fmt: skip
        """EAGLE-3's training-time test. The decoder drafts 2 .. N by running depth 1 again on
        its own output: step s at position t + s - 1 reads the previous step's hidden state
        there and the token drafted before it, and attends to the MTP cache (the first pass's
        keys up to t, the earlier steps' keys, its own). Pre-training and the first pass only
        ever feed it the main model's hidden state. Here every t runs those steps at once with
        the text's own tokens as the drafts (the text is the main model's), each against the
        main model's distribution s tokens ahead -> ((KL sum, count) per step 2 .. steps).
        As in EAGLE-3, the steps' losses backpropagate through the chain into the first pass
        (its hidden state and keys): the module learns to be a good input to itself. A row
        shorter than s gives step s nothing to score (count 0, still on the graph)."""
        draft, out = DraftKeys(*keys), []
        for s in range(2, steps + 1):
            nxt = self.tok_embeddings(_shift(tokens, s, 0))
            x = mtp.proj(torch.cat([mtp.hidden_norm(h), mtp.embed_norm(nxt)], dim=-1))
            # Positions past the table only occur where no target is valid (masked below).
            pos = (positions + s - 1).clamp(max=self.cfg.max_seq_len - 1)
            h, aux, _ = mtp.block(x, pos, doc_ids, ropes, indices, phase, None, draft)
            draft = draft.then(aux.keys)
            valid = mtp_labels(labels, doc_ids, s) != -100
            out.append(_kl_to_main(self._logits(mtp.norm(h)), main_logits, valid, s))
        return tuple(out)

    # Inference (wanka/infer): the same math over a KV cache. `cache` has one LayerCache per
    # main layer then one per MTP depth; the new tokens sit at slots [start, start + Lq).

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache, start: int,
               docs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """tokens, positions [B, Lq]; docs [B, start + Lq] -> (logits [B, Lq, V], final hidden
        state before the norm [B, Lq, D] (what MTP reads), the last top-k indices or None)."""
        ropes = {"attn": self.rope_attn, "index": self.rope_index}
        h, indices = self.tok_embeddings(tokens), None
        for i, blk in enumerate(self.layers.values()):
            h, indices = blk.decode(h, positions, ropes, cache.layers[i], start, docs, indices)
        return self._logits(self.norm(h)), h, indices

    def mtp_decode(self, depth: int, hidden: torch.Tensor, next_tokens: torch.Tensor,
                   positions: torch.Tensor, cache, start: int, docs: torch.Tensor,
                   indices: torch.Tensor | None,
                   q_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """MTP depth `depth` (1-based) at the slots of `hidden`: the previous depth's (or the
        main model's) hidden state there and the embedding of the token after each slot
        -> (logits of the token after that one, this depth's hidden state), for the slots from
        q_from on; the earlier slots only write their keys to the cache (a draft needs the
        output at each row's last slot, the cache needs every slot's keys)."""
        mtp = self.mtp[depth - 1]
        ropes = {"attn": self.rope_attn, "index": self.rope_index}
        nxt = self.tok_embeddings(next_tokens)
        h = mtp.proj(torch.cat([mtp.hidden_norm(hidden), mtp.embed_norm(nxt)], dim=-1))
        layer_cache = cache.layers[len(self.layers) + depth - 1]
        h, _ = mtp.block.decode(h, positions, ropes, layer_cache, start, docs, indices, q_from)
        return self._logits(mtp.norm(h)), h


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = labels.reshape(-1)
    s = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=-100, reduction="sum"
    )
    return s, (flat != -100).sum()


def _kl_to_main(mtp_logits: torch.Tensor, main_logits: torch.Tensor, valid: torch.Tensor,
                d: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sum over valid t of KL(main at t + d || MTP at t), fp32, the main side detached."""
    target = main_logits.detach()[:, d:][valid[:, : max(valid.shape[1] - d, 0)]]
    pred = mtp_logits[valid]
    logp_main = F.log_softmax(target.float(), dim=-1)
    logp_mtp = F.log_softmax(pred.float(), dim=-1)
    s = (logp_main.exp() * (logp_main - logp_mtp)).sum()
    return s, valid.sum()


def _shift(x: torch.Tensor, d: int, fill: int) -> torch.Tensor:
    """x moved left by d along dim 1, `fill` entering on the right (all of it when d >= L)."""
    return F.pad(x[:, d:], (0, min(d, x.shape[1])), value=fill)


def mtp_labels(labels: torch.Tensor, doc_ids: torch.Tensor, d: int) -> torch.Tensor:
    """Target of depth d at t is labels[t+d], valid only inside the same document."""
    lab = _shift(labels, d, -100)
    same_doc = _shift(doc_ids, d, -1) == doc_ids
    return torch.where(same_doc, lab, torch.full_like(lab, -100))

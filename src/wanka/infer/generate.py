"""Batched decoding over a KV cache, plain or with MTP speculation.

Plain: one main-model forward per token. Speculative (`speculate = N`): the depth-1 MTP module
drafts N tokens, reused recursively as vLLM does (its own output hidden state stands in for
the main model's; deeper trained MTP modules are not used yet), one main forward verifies the
pending token and
the N drafts at once, each row keeps its leading accepted drafts plus one token from the
target (sampling.accept_drafts), and the cache drops the rest. Greedy output is the same as
plain greedy decoding; sampled output follows the same distribution.

The MTP entry of slot s combines the main model's hidden state at s with the embedding of
the token after s, so MTP entries are written after the verify forward that yields them.
Rows are right-aligned in the cache (infer/cache.py); a row that keeps fewer drafts than the
longest is moved right.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from wanka.infer.cache import PAD_DOC, KVCache
from wanka.infer.sampling import Sampling, accept_drafts, draw, probabilities
from wanka.models.transformer import Transformer


@dataclass
class DecodeStats:
    forwards: int = 0  # main-model forwards after the prompt's
    tokens: int = 0  # tokens emitted (all rows, max_new_tokens cap applied)
    rounds: int = 0  # speculative rounds, summed over the rows still generating
    # Per draft position, summed over rows: drafts verified and drafts the target agreed with
    # (the drafter's quality, whether or not max_new_tokens or an EOS cut them off after).
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    kept: int = 0  # tokens the rounds added to the output (after the max_new_tokens / EOS cut)

    @property
    def acceptance_rate(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)]

    @property
    def mean_acceptance_length(self) -> float:
        """Output tokens per verify round: the kept drafts + the target's own token, counting
        only those within max_new_tokens (and up to an EOS), so at most 1 + speculate and at
        most the tokens produced (1 = no draft kept, or no round)."""
        return mean_acceptance_length([self]) or 1.0


class NonFiniteLogits(RuntimeError):
    """The model's logits hold NaN or Inf: so do its weights (a diverged or damaged run). A
    RuntimeError, as torch's sampling error was, for the post-training jobs; the commands that
    load a checkpoint the user names turn it into their one-line bad-input error."""


def mean_acceptance_length(stats: list[DecodeStats]) -> float | None:
    """DecodeStats.mean_acceptance_length over several generators (None: no round ran)."""
    rounds = sum(s.rounds for s in stats)
    return sum(s.kept for s in stats) / rounds if rounds else None


class Generator:
    def __init__(self, model: Transformer, sampling: Sampling | None = None, speculate: int = 0,
                 seed: int = 0, eos: int | None = None, vocab: int | None = None) -> None:  # fmt: skip
        """vocab: how many token ids the tokenizer decodes, when fewer than the model's
        (vocab_size rounded up past the tokenizer's, as training allows): ids beyond it are
        never chosen (they decode to nothing, or not at all)."""
        if speculate and not len(model.mtp):
            raise ValueError("speculation needs the model's MTP module: this model has "
                             "mtp_depth = 0; decode without --speculate")  # fmt: skip
        self.model, self.speculate, self.eos = model, speculate, eos
        self.vocab = vocab if vocab is not None and vocab < model.cfg.vocab_size else None
        self.sampling = sampling or Sampling()
        self.gen = torch.Generator(device=model.tok_embeddings.weight.device).manual_seed(seed)
        self.device = model.tok_embeddings.weight.device
        self.stats = DecodeStats(drafted=[0] * speculate, accepted=[0] * speculate)

    @torch.no_grad()  # not inference_mode: CPU ops write outputs from worker threads
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[list[int]]:  # fmt: skip
        """Completions of each prompt (token ids), at most max_new_tokens each, ending at the
        first EOS (included). on_tokens(row, ids) streams each row's new tokens as they come."""
        self.check(prompts, max_new_tokens)
        self.out: list[list[int]] = [[] for _ in prompts]
        self.done = [False] * len(prompts)
        self.max_new, self.on_tokens = max_new_tokens, on_tokens
        run = self._speculative if self.speculate else self._plain
        run(prompts)
        return self.out

    def check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """One line for prompts this model cannot complete (before anything is decoded)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be 1 or more (got {max_new_tokens})")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        V = self.model.cfg.vocab_size
        if any(not 0 <= t < V for p in prompts for t in p):
            raise ValueError(
                f"a prompt holds a token id outside this model's vocabulary (0..{V - 1})"
            )
        longest = max(map(len, prompts))
        limit = self.model.cfg.max_seq_len
        if longest + max_new_tokens + self.speculate > limit:
            spec = f" + speculate ({self.speculate})" if self.speculate else ""
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}){spec} "
                             f"exceeds the model's max_seq_len {limit}: shorten one of them")  # fmt: skip

    # -- the two loops ---------------------------------------------------------------------

    def _plain(self, prompts: list[list[int]]) -> None:
        cache, pos, logits, _, _ = self._prefill(prompts, n_mtp=0)
        nxt = draw(self._probs(logits[:, -1], "the prompt"), self.gen)
        self._emit(nxt[:, None], torch.zeros_like(nxt))
        length = max(map(len, prompts))
        while not all(self.done):
            logits, _, _ = self._forward(cache, length, nxt[:, None], pos[:, None])
            length, pos = length + 1, pos + 1
            step = f"decode step {self.stats.forwards + 1}"
            nxt = draw(self._probs(logits[:, -1], step), self.gen)
            self._emit(nxt[:, None], torch.zeros_like(nxt))
            self.stats.forwards += 1

    def _speculative(self, prompts: list[list[int]]) -> None:
        N, B = self.speculate, len(prompts)
        cache, pos, logits, hidden, indices = self._prefill(prompts, n_mtp=1)
        length = max(map(len, prompts))
        nxt = draw(self._probs(logits[:, -1], "the prompt"), self.gen)
        self._emit(nxt[:, None], torch.zeros_like(nxt))
        # MTP entries of the prompt's slots (the token after each; `nxt` after the last).
        after = torch.cat([self._tokens[:, 1:], nxt[:, None]], dim=1)
        last = torch.full((B,), length - 1, device=self.device)
        draft = self._mtp_entries(cache, 0, hidden, after, self._prompt_positions, indices, last)
        while not all(self.done):
            drafts, draft_probs = self._draft(cache, length, pos, draft)
            # Verify: the pending token and the drafts in one forward.
            verify = torch.cat([nxt[:, None], drafts], dim=1)
            vpos = pos[:, None] + torch.arange(N + 1, device=self.device)
            logits, hidden, indices = self._forward(cache, length, verify, vpos)
            self.stats.forwards += 1
            target = self._probs(logits, f"decode step {self.stats.forwards}")
            accepted, nxt = accept_drafts(target, draft_probs, drafts, self.gen)
            # A finished row keeps nothing: it must not grow the cache, move other rows or run
            # past the RoPE table while slower rows go on.
            finished = torch.tensor(self.done, device=self.device)
            accepted = torch.where(finished, 0, accepted)
            self._count(accepted)
            self._emit(drafts, accepted, nxt)
            # MTP entries of the kept slots (the token after each: the next kept draft, then
            # nxt), written before the cache drops the rejected tail and re-aligns the rows.
            keep = int(accepted.max()) + 1
            j = torch.arange(keep, device=self.device)[None]
            after = torch.where(j < accepted[:, None], torch.cat([drafts, nxt[:, None]], 1)[:, :keep],
                                nxt[:, None])  # fmt: skip
            draft = self._mtp_entries(cache, length, hidden[:, :keep], after, vpos[:, :keep],
                                      indices[:, :keep] if indices is not None else None,
                                      length + accepted)  # fmt: skip
            shifts = keep - 1 - accepted
            cache.keep(length + keep, shifts.tolist())
            logits_d, h, base = draft
            if base is not None:  # selected slots move with their rows
                base = torch.where(base >= 0, base + shifts[:, None, None], base)
            draft = (logits_d, h, base)
            # Rows done now stop too: a last round may keep drafts past max_new_tokens (or an
            # EOS), and moving by all of them would put the verify forwards the row still runs
            # (ignored) past the RoPE table while slower rows go on.
            done = torch.tensor(self.done, device=self.device)
            pos = pos + torch.where(done, 0, accepted + 1)
            length += keep

    def _mtp_entries(self, cache, start, hidden, after, positions, indices, last):
        """Write the MTP cache entries of slots [start, start + m) -> the MTP output at each
        row's slot `last` (its first draft's logits [B, 1, V], hidden state [B, 1, D]) and the
        main model's selection there (or None while dense)."""
        docs = cache.docs[:, : start + hidden.shape[1]]  # set by the main forward (pads too)
        rows, sel = torch.arange(hidden.shape[0], device=self.device), last - start
        # Only slots from the earliest row's last one on need an output (at batch 1: one slot,
        # a whole prompt's or a round's kept drafts); the others only write their keys.
        q_from = int(sel.min())
        logits, h = self.model.mtp_decode(1, hidden, after, positions, cache, start, docs, indices,
                                          q_from)  # fmt: skip
        base = indices[rows, sel][:, None] if indices is not None else None
        return logits[rows, sel - q_from][:, None], h[rows, sel - q_from][:, None], base

    def _draft(self, cache, length, pos, draft):
        """N draft tokens [B, N] and the distributions they were drawn from [B, N, V]: the
        first from the MTP output at the last kept slot, then recursive MTP steps at the
        slots ahead (their entries stand in for the main model's until it has verified them)."""
        d_logits, h, base = draft
        drafts, probs = [], []
        for j in range(self.speculate):
            where = f"draft {j + 1} of decode step {self.stats.forwards + 1}"
            q = self._probs(d_logits[:, -1], where, "MTP module's")
            drafts.append(draw(q, self.gen))
            probs.append(q)
            if j + 1 == self.speculate:
                break
            slot, step_idx = length + j, None
            if base is not None:  # the last main selection plus the slots ahead, all of them
                ahead = torch.arange(length, slot + 1, device=self.device).expand(len(pos), 1, -1)
                step_idx = torch.cat([ahead, base], -1)
            docs = cache.set_docs(slot, self._live(drafts[-1][:, None]))
            d_logits, h = self.model.mtp_decode(1, h, drafts[-1][:, None], (pos + j)[:, None],
                                                cache, slot, docs, step_idx)  # fmt: skip
        return torch.stack(drafts, 1), torch.stack(probs, 1)

    # -- pieces ----------------------------------------------------------------------------

    def _prefill(self, prompts: list[list[int]], n_mtp: int):
        B, P = len(prompts), max(map(len, prompts))
        tokens = torch.zeros(B, P, dtype=torch.long, device=self.device)
        docs = torch.full((B, P), PAD_DOC, dtype=torch.long, device=self.device)
        positions = torch.zeros(B, P, dtype=torch.long, device=self.device)
        for b, p in enumerate(prompts):
            n = len(p)
            tokens[b, P - n :] = torch.tensor(p, device=self.device)
            docs[b, P - n :] = 0
            positions[b, P - n :] = torch.arange(n, device=self.device)
        self._tokens, self._prompt_positions = tokens, positions
        cap = 1 << (P + self.max_new + 2 * self.speculate).bit_length()
        cache = KVCache(len(self.model.layers) + n_mtp, B, self.device, capacity=cap)
        logits, hidden, indices = self.model.decode(tokens, positions, cache, 0,
                                                    cache.set_docs(0, docs))  # fmt: skip
        pos = torch.tensor([len(p) for p in prompts], device=self.device)
        return cache, pos, logits, hidden, indices

    def _probs(self, logits: torch.Tensor, where: str, whose: str = "model's") -> torch.Tensor:
        """The distribution to draw from, after a check that the logits are numbers: NaN or
        Inf would make sampling fail in torch and greedy decoding emit token 0."""
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(f"the {whose} logits are not finite at {where}: its weights "
                                  "hold NaN/Inf (check the checkpoint)")  # fmt: skip
        if self.vocab is not None:
            logits = logits.clone()
            logits[..., self.vocab :] = float("-inf")
        return probabilities(logits, self.sampling)

    def _forward(self, cache: KVCache, start: int, tokens: torch.Tensor, positions: torch.Tensor):
        docs = cache.set_docs(start, self._live(tokens))
        return self.model.decode(tokens, positions, cache, start, docs)

    def _live(self, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(like.shape[:2], dtype=torch.long, device=self.device)

    def _count(self, accepted: torch.Tensor) -> None:
        for b, a in enumerate(accepted.tolist()):
            if self.done[b]:
                continue
            self.stats.rounds += 1
            for j in range(self.speculate):
                self.stats.drafted[j] += 1
                self.stats.accepted[j] += int(j < a)

    def _emit(self, drafts: torch.Tensor, accepted: torch.Tensor,
              nxt: torch.Tensor | None = None) -> None:  # fmt: skip
        """Append row b's first accepted[b] drafts, then nxt[b]; without nxt (plain decoding)
        the new token is the drafts' first column."""
        for b, (row, a) in enumerate(zip(drafts.tolist(), accepted.tolist())):
            if self.done[b]:
                continue
            new = row[:a] + ([int(nxt[b])] if nxt is not None else row[:1])
            room = self.max_new - len(self.out[b])
            new = new[:room]
            if self.eos is not None and self.eos in new:
                new = new[: new.index(self.eos) + 1]
                self.done[b] = True
            self.out[b].extend(new)
            self.stats.tokens += len(new)
            if nxt is not None:  # a speculative round's output, as cut
                self.stats.kept += len(new)
            if len(self.out[b]) >= self.max_new:
                self.done[b] = True
            if new and self.on_tokens is not None:
                self.on_tokens(b, new)


def distinct_4grams(outputs: list[list[int]]) -> float | None:
    """Mean share of distinct 4-grams per completion: near 0 for text stuck in a loop (which
    any drafter predicts), so acceptance figures can be read against it; None when no
    completion has 4 tokens."""
    shares = []
    for o in outputs:
        grams = [tuple(o[i : i + 4]) for i in range(len(o) - 3)]
        if grams:
            shares.append(len(set(grams)) / len(grams))
    return round(sum(shares) / len(shares), 4) if shares else None

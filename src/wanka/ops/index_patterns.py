"""Top-k index patterns for testing and benchmarking the sparse-attention backends.

Both generators return what the lightning indexer hands to `sparse_attention`: int64
[B, L, K], -1 = empty slot, each query's valid indices distinct, visible (causal, same
document) and always including the query itself. They are vectorised over chunks of queries
(no Python loop per token), so L = 32k is practical.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMS = 1 << 23  # rand elements drawn per chunk of queries


def _distinct_sample(eligible: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Per row of eligible [C, S] (bool), n distinct eligible column numbers drawn uniformly
    (random keys + top-k); fewer when fewer are eligible: the rest are -1. -> [C, n]."""
    C, S = eligible.shape
    if n <= 0:
        return torch.full((C, 0), -1, dtype=torch.long)
    r = torch.rand(C, S, generator=gen).masked_fill_(~eligible, -1.0)
    if n > S:
        r = torch.cat([r, torch.full((C, n - S), -1.0)], dim=1)
    vals, cols = r.topk(n, dim=1)
    return cols.masked_fill_(vals < 0, -1)


def _chunk(L: int, K: int) -> int:
    return max(1, min(L, _CHUNK_ELEMS // max(L, K)))


def random_indices(
    B: int, L: int, K: int, doc_ids: torch.Tensor | None = None, seed: int = 0
) -> torch.Tensor:
    """Uniform random selection: each query t keeps itself plus K - 1 keys drawn uniformly
    without replacement among its other visible keys (s < t in the same document, by doc_ids
    [B, L]; one document when None). When at most K keys are visible it keeps all of them and
    pads with -1. Models an indexer with no structure at all: the worst case for locality
    (chunks of queries share few keys), the case where gather-based kernels must hold up."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, L, K), -1, dtype=torch.long)
    C = _chunk(L, K)
    for b in range(B):
        doc = None if doc_ids is None else doc_ids[b]
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            S = t1  # keys beyond the chunk's last query are never visible
            t = torch.arange(t0, t1)[:, None]
            s = torch.arange(S)[None, :]
            elig = s < t
            if doc is not None:
                elig &= doc[None, :S] == doc[t0:t1, None]
            picks = _distinct_sample(elig, K - 1, gen)
            out[b, t0:t1, 0] = t[:, 0]
            out[b, t0:t1, 1:] = picks
    return out


def realistic_indices(
    B: int,
    L: int,
    K: int,
    window: int | None = None,
    n_heavy: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """A structured selection shaped like what a trained indexer picks (one document per row):

    - local window: the `window` most recent keys t - window + 1 .. t (default 3K/4), which
      includes the query itself: attention mass concentrates on the recent past;
    - heavy hitters: `n_heavy` key positions (default K/8) shared by every query of the
      sequence: positions 0..3 (attention sinks) plus positions drawn once per sequence
      (globally important tokens), each used by every query that can see it;
    - a few random ones: the remaining slots (about K/8) filled with distinct keys drawn
      uniformly among the other visible keys (the indexer's long-range, query-specific picks).

    A query that sees at most K keys (t < K) selects all of them (padding with -1), as top-k
    does. Consecutive queries share most of their keys, the locality that block/union
    kernels exploit; the random part keeps it from being a pure sliding window.
    """
    window = (3 * K) // 4 if window is None else window
    n_heavy = K // 8 if n_heavy is None else n_heavy
    if not 1 <= window <= K or not 0 <= n_heavy <= K - window:
        raise ValueError(f"need 1 <= window <= K and 0 <= n_heavy <= K - window; got "
                         f"window={window}, n_heavy={n_heavy}, K={K}")  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, L, K), -1, dtype=torch.long)
    C = _chunk(L, K)
    n_sink = min(4, n_heavy, L)
    for b in range(B):
        extra = torch.randperm(max(L - n_sink, 0), generator=gen)[: n_heavy - n_sink] + n_sink
        heavy = torch.cat([torch.arange(n_sink), extra]).sort().values  # [n_heavy]
        is_heavy = torch.zeros(L, dtype=torch.bool)
        is_heavy[heavy] = True
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            t = torch.arange(t0, t1)[:, None]  # [C, 1]
            win = t - torch.arange(window)[None, :]  # [C, window]
            win = win.masked_fill(win < 0, -1)
            w_start = t - window + 1  # keys below it are outside the window
            hv = heavy[None, :].expand(t1 - t0, -1)
            hv = hv.masked_fill(hv >= w_start, -1)  # invisible, or already in the window
            n_rand = K - (win >= 0).sum(1, keepdim=True) - (hv >= 0).sum(1, keepdim=True)
            s = torch.arange(t1)[None, :]
            elig = (s < w_start) & ~is_heavy[None, :t1]
            picks = _distinct_sample(elig, int(n_rand.max().clamp(min=0)), gen)
            picks = picks.masked_fill(torch.arange(picks.shape[1])[None, :] >= n_rand, -1)
            rows = torch.cat([win, hv, picks], dim=1).sort(dim=1, descending=True).values
            rows = rows[:, :K]
            if rows.shape[1] < K:
                rows = torch.cat([rows, rows.new_full((rows.shape[0], K - rows.shape[1]), -1)], 1)
            out[b, t0:t1] = rows
    return out

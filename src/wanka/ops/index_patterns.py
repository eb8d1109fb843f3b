"""Top-k index patterns for testing and benchmarking the sparse-attention backends.

Every generator returns what the lightning indexer hands to `sparse_attention`: int64
[B, L, K], -1 = empty slot, each query's valid indices distinct, visible (causal, same
document by `doc_ids` [B, L], one document per row when None) and always including the
query itself. A query that sees at most K keys selects all of them, as top-k does. They are
vectorised over chunks of queries (no Python loop per token), so L = 32k is practical.

- `random_indices`: uniform (no structure, the worst case for locality);
- `realistic_indices`: local window + shared heavy hitters + a few random keys;
- `block_sparse_indices`: local window + scattered aligned blocks of 64 keys;
- `packed_doc_ids`: document ids of several packed documents, for any of them.
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


def packed_doc_ids(B: int, L: int, n_docs: int, seed: int = 0) -> torch.Tensor:
    """[B, L] int64 ids of `n_docs` packed documents per row (0, 1, ...), lengths drawn at
    random (cuts at distinct uniform positions: lengths from 1 token up, mean L / n_docs)."""
    if not 1 <= n_docs <= L:
        raise ValueError(f"need 1 <= n_docs <= L; got n_docs={n_docs}, L={L}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        cuts = torch.randperm(L - 1, generator=gen)[: n_docs - 1] + 1
        ids[b, cuts] = 1
    return ids.cumsum(1)


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


def _doc_rank(doc: torch.Tensor) -> torch.Tensor:
    """doc [L] ids -> [L]: how many earlier positions share the position's document."""
    L = doc.shape[0]
    order = torch.sort(doc, stable=True).indices  # grouped by document, positions ascending
    sd = doc[order]
    first = torch.ones(L, dtype=torch.bool)
    first[1:] = sd[1:] != sd[:-1]
    start = torch.where(first, torch.arange(L), 0).cummax(0).values
    rank = torch.empty(L, dtype=torch.long)
    rank[order] = torch.arange(L) - start
    return rank


def _same_doc(doc: torch.Tensor | None, t0: int, t1: int, S: int) -> torch.Tensor | None:
    """[t1 - t0, S] bool: key s (< S) is in query t's document; None for one document."""
    return None if doc is None else doc[None, :S] == doc[t0:t1, None]


def realistic_indices(
    B: int,
    L: int,
    K: int,
    window: int | None = None,
    n_heavy: int | None = None,
    seed: int = 0,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """A structured selection shaped like what a trained indexer picks:

    - local window: the `window` most recent positions t - window + 1 .. t (default 3K/4)
      that lie in the query's document, the query itself included: attention mass
      concentrates on the recent past;
    - heavy hitters: each document's first min(4, n_heavy) positions (attention sinks) plus
      n_heavy - 4 positions drawn once per sequence (globally important tokens), each used
      by every query of its document that can see it (`n_heavy` defaults to K/8; a query
      never has more than n_heavy of them);
    - a few random ones: the remaining slots (about K/8) filled with distinct keys drawn
      uniformly among the query's other visible keys (the indexer's long-range,
      query-specific picks).

    `doc_ids` [B, L] packs several documents into one row (None: one document; the same
    result as all-zero ids). A query that sees at most K keys (early in its document)
    selects all of them (padding with -1), as top-k does. Consecutive queries share most of
    their keys, the locality that block/union kernels exploit; the random part keeps it
    from being a pure sliding window.
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
        doc = None if doc_ids is None else doc_ids[b]
        extra = torch.randperm(max(L - n_sink, 0), generator=gen)[: n_heavy - n_sink] + n_sink
        is_heavy = torch.zeros(L, dtype=torch.bool)
        is_heavy[extra] = True
        if doc is None:
            is_heavy[:n_sink] = True
        else:
            is_heavy |= _doc_rank(doc) < n_sink
        heavy = is_heavy.nonzero().view(-1)  # ascending
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            t = torch.arange(t0, t1)[:, None]  # [C, 1]
            same = _same_doc(doc, t0, t1, t1)  # [C, t1] or None
            win = t - torch.arange(window)[None, :]  # [C, window]
            gone = win < 0
            if same is not None:
                gone |= ~same.gather(1, win.clamp(min=0))
            win = win.masked_fill(gone, -1)
            w_start = t - window + 1  # keys below it are outside the window
            hv = heavy[None, :].expand(t1 - t0, -1)
            gone = hv >= w_start  # invisible, or already in the window
            if same is not None:
                gone |= ~same.gather(1, hv.clamp(max=t1 - 1))
            hv = hv.masked_fill(gone, -1)
            n_rand = K - (win >= 0).sum(1, keepdim=True) - (hv >= 0).sum(1, keepdim=True)
            s = torch.arange(t1)[None, :]
            elig = (s < w_start) & ~is_heavy[None, :t1]
            if same is not None:
                elig &= same
            picks = _distinct_sample(elig, int(n_rand.max().clamp(min=0)), gen)
            picks = picks.masked_fill(torch.arange(picks.shape[1])[None, :] >= n_rand, -1)
            out[b, t0:t1] = _rows_of(torch.cat([win, hv, picks], dim=1), K)
    return out


def _rows_of(cand: torch.Tensor, K: int) -> torch.Tensor:
    """[C, n] candidates (-1 = none, at most K valid per row) -> [C, K], descending."""
    rows = cand.sort(dim=1, descending=True).values[:, :K]
    if rows.shape[1] < K:
        rows = torch.cat([rows, rows.new_full((rows.shape[0], K - rows.shape[1]), -1)], 1)
    return rows


def block_sparse_indices(
    B: int,
    L: int,
    K: int,
    window: int | None = None,
    block: int = 64,
    seed: int = 0,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block-sparse selection (as block-selection indexers and block-sparse kernels use): a
    local window of the `window` most recent positions in the query's document (default
    K/4), plus (K - window) // block scattered key blocks: aligned positions
    [j * block, (j + 1) * block), the blocks drawn at random once per aligned block of
    `block` queries (so those queries share them: query x key tiles) among the blocks
    holding a visible key below the window; only a block's visible keys are taken. Slots
    not filled (blocks cut by a document start or the window) stay -1. A query that sees at
    most K keys selects all of them. `doc_ids` [B, L] as in `realistic_indices`."""
    window = K // 4 if window is None else window
    if not 1 <= window <= K or block < 1:
        raise ValueError(f"need 1 <= window <= K and block >= 1; got window={window}, "
                         f"block={block}, K={K}")  # fmt: skip
    n_blocks = (K - window) // block
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((B, L, K), -1, dtype=torch.long)
    C = _chunk(L, K)
    nkb = -(-L // block)
    offs = torch.arange(block)
    for b in range(B):
        doc = None if doc_ids is None else doc_ids[b]
        draw = torch.rand(nkb, nkb, generator=gen)  # [query block, key block] priorities
        for t0 in range(0, L, C):
            t1 = min(L, t0 + C)
            c = t1 - t0
            t = torch.arange(t0, t1)[:, None]
            s = torch.arange(t1)[None, :]
            same = _same_doc(doc, t0, t1, t1)
            vis = s <= t if same is None else (s <= t) & same  # [C, t1]
            few = vis.sum(1) <= K  # sees at most K keys: all of them
            win = t - torch.arange(window)[None, :]
            gone = win < 0
            if same is not None:
                gone |= ~same.gather(1, win.clamp(min=0))
            win = win.masked_fill(gone, -1)
            cand = [win]
            if n_blocks > 0:
                below = vis & (s < t - window + 1)  # visible, below the window
                pad = nkb * block - t1
                has = torch.nn.functional.pad(below, (0, pad)).view(c, nkb, block).any(-1)
                pri = draw[torch.div(t[:, 0], block, rounding_mode="floor")]
                pri = pri.masked_fill(~has, -1.0)
                take = min(n_blocks, nkb)
                val, blk = pri.topk(take, dim=1)  # [C, take]
                keys = (blk[:, :, None] * block + offs).view(c, -1)  # [C, take * block]
                ok = (val >= 0).repeat_interleave(block, dim=1) & (keys < t1)
                ok &= below.gather(1, keys.clamp(max=t1 - 1))
                cand.append(keys.masked_fill(~ok, -1))
            rows = _rows_of(torch.cat(cand, dim=1), K)
            if bool(few.any()):
                allv = torch.where(vis, s, -1)
                rows[few] = _rows_of(allv[few], K)
            out[b, t0:t1] = rows
    return out

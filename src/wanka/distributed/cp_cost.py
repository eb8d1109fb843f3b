"""Cost model of one document piece for context-parallel load balancing.

A piece is tokens [start, end) of one document. Its training cost is modelled as

    linear * tokens + sparse * sum_p min(p + 1, topk) + dense * sum_p (p + 1)

over its in-document positions p (causal attention: the query at p sees p + 1 keys):

- ``linear``: per-token work that does not depend on position (projections, MoE, norms, loss);
- ``sparse``: DSA core attention, which reads at most ``topk`` keys per query;
- ``dense``: work over the whole causal prefix. The lightning indexer's scan is (p + 1)
  per query on indexer layers even when attention is sparse, and dense attention (the
  warm-up stage) is too. Both prefix terms are kept and ``fit`` decides their weights from
  measurements, rather than us guessing how much of the indexer cost hides behind the rest.

``profile`` (optional, fitted): a per-token cost by position in the document, in bins of
``profile_bin`` tokens (the last bin's value holds past the end), added to the three terms. A
kernel's real cost need not follow min(p + 1, topk) and p + 1: the CPU sparse-attention kernel
goes dense over the columns most of a chunk's queries select, so its cost per token climbs
from the first position to about 1.5 x topk and is flat after (measured at topk 2048, 8k
tokens: 0.85, 1.06, 1.57, 3.02, then 2.8-2.9 ms per token per 1024 positions). Fitted as a
non-decreasing step function (``fit_profile``), what a longer prefix never makes cheaper.

``gather`` is not a piece's cost but a step's: seconds per token of a rank's gathered K/V
buffer (the all-gather forward and reduce-scatter backward, every layer). A plan that
splits documents over a block of ``span`` ranks pays about ``gather * span * lmax``; the
dynamic planner only widens the block when the compute it saves is larger. Default: 608 bf16
values per token per layer on average (MLA's one K = V tensor, latent 512 + RoPE key 64,
gathered once, on every layer; indexer keys of 128 on the 12 layers that have an indexer),
48 layers, both directions, at ~50 GB/s; the CPU bench does not measure it (its gloo gather is
not in the ranks' compute), so fitted models keep this estimate.

The defaults are a FLOP estimate of the production shape (x25-293b: ~28.9B active parameters,
48 layers of 64-head MLA, indexers of 64 x 128 on every 4th layer, topk 2048) on one
~1 PFLOP/s bf16 accelerator at assumed efficiencies (GEMMs 40%, gather-bound sparse
attention 10%, indexer scan 25%), in seconds per step; the per-key attention cost is
bench/flops.py's core_flops_per_key: 2 x 64 heads x (q.k over 512 + 64, p.v over 512).
Only their ratios matter for balancing; ``fit`` replaces them with measured ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np


def _prefix_dense(n: np.ndarray) -> np.ndarray:
    """sum_{p < n} (p + 1)."""
    return n * (n + 1) // 2


def _prefix_sparse(n: np.ndarray, topk: int) -> np.ndarray:
    """sum_{p < n} min(p + 1, topk)."""
    head = np.minimum(n, topk)
    return _prefix_dense(head) + (n - head) * topk


@dataclass(frozen=True)
class CostModel:
    linear: float = 4.33e-4  # 6 * 28.88e9 FLOP / (0.4 * 1e15 FLOP/s)
    sparse: float = 2.0e-7  # 3 * 48 layers * 2 * 64 * (576 + 512) FLOP / (0.1 * 1e15)
    dense: float = 8e-10  # 12 indexer layers * 2 * 64 * 128 FLOP / (0.25 * 1e15)
    topk: int = 2048
    gather: float = 2.33e-6  # 2 * 48 * (576 + 128 / 4) * 2 bytes / 50e9 bytes/s
    profile: tuple[float, ...] = ()  # seconds per token by position bin (fit_profile)
    profile_bin: int = 0  # positions per profile bin

    def __post_init__(self) -> None:
        prof, b = self.profile, self.profile_bin
        if not isinstance(prof, (list, tuple)) or any(
            isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
            for v in prof
        ):  # a string or a dict from a JSON file iterates into nonsense
            raise ValueError(f"cost model profile must be a list of numbers: {self}")
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise ValueError(f"cost model profile_bin must be a whole number: {self}")
        object.__setattr__(self, "profile", tuple(float(v) for v in prof))
        object.__setattr__(self, "profile_bin", int(b))
        if (prof and not (1 <= b <= 1 << 30 and len(prof) <= 4096)) or (not prof and b):
            raise ValueError(f"cost model profile needs a profile_bin in 1..2^30 and at most "
                             f"4096 bins (and no profile_bin without one): {self}")  # fmt: skip
        if any(hi < lo for lo, hi in zip(self.profile, self.profile[1:])):
            raise ValueError(f"cost model profile must not fall with position (a longer "
                             f"prefix is never cheaper; the planner relies on it): {self}")  # fmt: skip
        # topk counts keys: a whole number (NaN passed `topk < 1` and made every cost NaN; a
        # float or a 1e30 gave nonsense pair counts or an int64 overflow in a traceback).
        if (
            isinstance(self.topk, bool)
            or not isinstance(self.topk, (int, np.integer))
            or not (1 <= self.topk <= 1 << 40)
        ):
            raise ValueError(f"cost model topk must be a whole number in 1..2^40: {self}")
        coefs = (self.linear, self.sparse, self.dense, *self.profile)
        finite = all(math.isfinite(c) for c in (*coefs, self.gather))  # NaN compares false
        if not finite or min(coefs) < 0 or max(coefs) <= 0 or self.gather < 0:
            raise ValueError(
                f"cost model needs finite, non-negative, not all zero coefficients: {self}"
            )
        if self.profile and self.linear + self.sparse + self.dense + self.profile[0] <= 0:
            # a document inside the first bin would cost nothing: the plan divides by it
            raise ValueError(f"cost model gives the first positions no cost: {self}")
        # Seconds per token or pair: 5e-324 underflowed the planner's arithmetic (pieces
        # overlapped: a wrong loss), 1e308 overflowed it (every load inf).
        if any(c and not 1e-30 <= c <= 1e30 for c in (*coefs, self.gather)):
            raise ValueError(f"cost model coefficients must lie in [1e-30, 1e30] seconds (or be "
                             f"0): {self}; fit them with a measured `wanka bench cp` run")  # fmt: skip

    def terms(
        self, start: np.ndarray | int, end: np.ndarray | int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, sparse pairs, dense pairs) of pieces [start, end), exact int64."""
        s = np.asarray(start, dtype=np.int64)
        e = np.asarray(end, dtype=np.int64)
        sparse = _prefix_sparse(e, self.topk) - _prefix_sparse(s, self.topk)
        return e - s, sparse, _prefix_dense(e) - _prefix_dense(s)

    def cost(self, start: np.ndarray | int, end: np.ndarray | int) -> np.ndarray:
        """Modelled cost of pieces [start, end) (element-wise over arrays)."""
        tokens, sparse, dense = self.terms(start, end)
        c = self.linear * tokens + self.sparse * sparse + self.dense * dense
        if self.profile:
            c = c + self._profile_prefix(end) - self._profile_prefix(start)
        return c

    def _profile_prefix(self, n: np.ndarray | int) -> np.ndarray:
        """Profile cost of positions [0, n)."""
        prof = np.asarray(self.profile)
        done = np.asarray(self._profile_done())
        n = np.asarray(n, dtype=np.int64)
        j = np.minimum(n // self.profile_bin, len(prof) - 1)
        return done[j] + (n - j * self.profile_bin) * prof[j]

    def _profile_done(self) -> list[float]:
        """Profile cost of the bins before each bin (cached: the planner asks per piece)."""
        done = self.__dict__.get("_done")
        if done is None:
            done = [0.0]
            for v in self.profile[:-1]:
                done.append(done[-1] + v * self.profile_bin)
            object.__setattr__(self, "_done", done)
        return done

    def _profile_prefix_scalar(self, n: int) -> float:
        j = min(n // self.profile_bin, len(self.profile) - 1)
        return self._profile_done()[j] + (n - j * self.profile_bin) * self.profile[j]

    def piece_cost(self, s: int, e: int) -> float:
        """cost(s, e) for one piece in Python scalars (the planner's bisections call it often)."""
        k = self.topk
        hs, he = min(s, k), min(e, k)
        sparse = he * (he + 1) // 2 + (e - he) * k - hs * (hs + 1) // 2 - (s - hs) * k
        dense = e * (e + 1) // 2 - s * (s + 1) // 2
        c = self.linear * (e - s) + self.sparse * sparse + self.dense * dense
        if self.profile:
            c += self._profile_prefix_scalar(e) - self._profile_prefix_scalar(s)
        return c

    def doc_cost(self, lengths: np.ndarray | int) -> np.ndarray:
        """Cost of whole documents of the given lengths."""
        return self.cost(0, lengths)

    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]], topk: int = 2048) -> CostModel:
        """Non-negative least squares on rows (linear_tokens, sparse_pairs, dense_pairs, seconds).

        ``topk`` must be the one the sparse pair counts were computed with. Three unknowns, so
        the exact NNLS solution is the best of the 7 unconstrained fits on subsets of the
        columns whose coefficients all come out non-negative.
        """
        data = np.asarray(list(samples), dtype=np.float64)
        if data.ndim != 2 or data.shape[1] != 4 or len(data) == 0:
            raise ValueError(
                "fit wants rows of (linear_tokens, sparse_pairs, dense_pairs, seconds)"
            )
        x, y = data[:, :3], data[:, 3]
        # The columns differ by orders of magnitude (tokens vs pairs): scale for conditioning.
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        xs = x / scale
        best, best_err = np.zeros(3), float(np.sum(y**2))
        for size in (1, 2, 3):
            for cols in combinations(range(3), size):
                coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
                if np.any(coef < 0):
                    continue
                err = float(np.sum((xs[:, cols] @ coef - y) ** 2))
                if err < best_err:
                    best, best_err = np.zeros(3), err
                    best[list(cols)] = coef
        if not best.any():
            raise ValueError("fit found no positive coefficient: are the timings positive?")
        linear, sparse, dense = (best / scale).tolist()
        return cls(linear=linear, sparse=sparse, dense=dense, topk=topk)

    @classmethod
    def fit_profile(
        cls, samples: Iterable[tuple[Sequence[tuple[int, int]], float]], bin_tokens: int,
        topk: int = 2048,
    ) -> CostModel:  # fmt: skip
        """A non-decreasing per-token cost by position bin from (pieces [(start, end), ...],
        seconds) samples: non-negative least squares on the steps between bins (feature i =
        the sample's tokens at positions >= i x bin_tokens), so the step function rises or
        stays, never falls. Bins run to the last position any sample holds."""
        data = [(list(p), float(t)) for p, t in samples]
        if not data or bin_tokens < 1:
            raise ValueError("fit_profile wants samples of (pieces, seconds) and bin_tokens >= 1")
        top = max((e for p, _ in data for _, e in p), default=0)
        # Whole bins only: positions past the last one share its value (a sliver of a bin at
        # the end, fitted from a few tokens' noise, would set the cost of every later position).
        m = max(1, top // bin_tokens)
        if m > 4096:
            raise ValueError(f"fit_profile: {m} bins of {bin_tokens} positions: at most 4096")
        edges = np.arange(m) * bin_tokens
        x = np.zeros((len(data), m))
        for row, (pieces, _) in enumerate(data):
            for a, e in pieces:  # tokens at positions >= each edge
                x[row] += np.clip(e - np.maximum(a, edges), 0, None)
        y = np.array([t for _, t in data])
        steps = nnls(x, y)
        if not steps.any():
            raise ValueError("fit found no positive coefficient: are the timings positive?")
        if steps[0] <= 0:  # too few or noisy samples there: no position may cost nothing
            steps[0] = 1e-3 * float(steps.sum())
        return cls(linear=0.0, sparse=0.0, dense=0.0, topk=topk,
                   profile=tuple(np.cumsum(steps).tolist()), profile_bin=int(bin_tokens))  # fmt: skip


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (Lawson and Hanson's active set method)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale  # columns of tokens and pairs differ by orders of magnitude
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-10 * float(np.abs(a.T @ b).max(initial=0.0))  # relative: timings may be tiny
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)
        cand = ~free & (w > tol)
        if not cand.any():
            break
        free[int(np.argmax(np.where(cand, w, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            neg = free & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            free &= x > 1e-15
            x[~free] = 0.0
    return x / scale


def load_cost(path: Path | str, what: str = "--cost") -> CostModel:
    """The fitted cost model of a `wanka bench cp` result JSON (or a JSON of just its fields);
    `what` names the flag or config field in the one-line error."""
    try:
        doc = json.loads(Path(path).read_text())
        fields = doc.get("cost_model", doc)
        extra = {k: fields[k] for k in ("gather", "profile", "profile_bin") if k in fields}
        return CostModel(**{k: fields[k] for k in ("linear", "sparse", "dense", "topk")}, **extra)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise OSError(f"{what} {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{what} {path}: not a `wanka bench cp` result with a cost_model "
                         f"({type(e).__name__}: {e})") from None  # fmt: skip

"""Long-context figures for `wanka bench ops`: sparse-vs-dense crossover length and the model's
forward+backward step time with index_share_every = 1, 2, 4.

The indexer's share of a step is measured, not modelled: the same model step is timed with the
indexer's ops wrapped in timers (forward directly, backward by hooks on its output).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from wanka import ops
from wanka.config.schema import ModelConfig
from wanka.models.transformer import Transformer
from wanka.ops import registry


def median_time(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls after one warm-up call (for an even count the
    upper median: with 2 repeats, the slower call)."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _fwd_bwd(op: str, *args) -> None:
    ops.call(op, *args).sum().backward()


def _model_step(
    model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor
) -> None:
    parts = model(tokens, pos, doc, torch.roll(tokens, -1, 1))
    (parts.lm_sum / tokens.numel() + parts.kl_sum / tokens.numel()).backward()


def crossover(k: int, lengths: list[int], H: int = 16, D: int = 64, repeats: int = 2) -> dict:
    """fwd+bwd time of sparse (realistic indices) vs dense causal attention per length, with the
    best available backend of each; the crossover is the first length where sparse wins."""
    from wanka.ops.index_patterns import realistic_indices

    rows = []
    for L in lengths:
        q = torch.randn(1, L, H, D, requires_grad=True)
        kv = [torch.randn(1, L, D, requires_grad=True) for _ in range(2)]
        doc = torch.zeros(1, L, dtype=torch.int32)
        idx = realistic_indices(1, L, k, seed=0)

        sparse = partial(_fwd_bwd, "sparse_attention", q, kv[0], kv[1], idx, D**-0.5)
        dense = partial(_fwd_bwd, "dense_attention", q, kv[0], kv[1], doc, D**-0.5)
        rows.append(
            {
                "L": L,
                "sparse_s": median_time(sparse, repeats),
                "dense_s": median_time(dense, repeats),
            }
        )
    cross = next((r["L"] for r in rows if r["sparse_s"] < r["dense_s"]), None)
    return {"k": k, "rows": rows, "crossover_L": cross,
            "backends": {op: registry.select(op, "cpu").name for op in ("sparse_attention", "dense_attention")}}  # fmt: skip


class _IndexerTimer:
    """Time everything the indexer costs in a step: the lightning_indexer op (forward, and its
    backward through a hook pair on its output) and the KL target (attention_probs)."""

    OPS = ("lightning_indexer", "indexer_scores", "attention_probs", "indexer_kl")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: dict[str, registry.Backend] = {}

    def __enter__(self):
        for op in self.OPS:
            b = registry.select(op, "cpu")
            self._saved[op] = b
            registry._REGISTRY[op][b.name] = dataclasses.replace(b, fn=partial(self._timed, b.fn))
        return self

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        scores = out[1] if isinstance(out, tuple) else out
        if scores.requires_grad:  # backward: from the grad reaching the output to its grad_fn done
            start: dict[str, float] = {}
            scores.register_hook(lambda g: start.__setitem__("t", time.perf_counter()))
            scores.grad_fn.register_hook(
                lambda *a: self._add(time.perf_counter() - start.get("t", time.perf_counter()))
            )
        return out

    def _add(self, dt: float) -> None:
        self.seconds += dt

    def __exit__(self, *exc) -> None:
        for op, b in self._saved.items():
            registry._REGISTRY[op][b.name] = b


def model_step_times(
    base: ModelConfig, lengths: list[int], shares: list[int], repeats: int = 2
) -> list[dict]:
    """Forward+backward time of one sequence per (L, index_share_every), and the indexer's part."""
    rows = []
    for L in lengths:
        for share in shares:
            cfg = dataclasses.replace(
                base, index_share_every=share, max_seq_len=max(base.max_seq_len, L)
            )
            torch.manual_seed(0)
            with torch.device("meta"):
                model = Transformer(cfg)
            model.to_empty(device="cpu")
            model.init_weights(0)
            tokens = torch.randint(0, cfg.vocab_size, (1, L))
            pos = torch.arange(L)[None]
            doc = torch.zeros(1, L, dtype=torch.int32)

            step = partial(_model_step, model, tokens, pos, doc)

            step()  # warm-up outside the timer
            times, idx_times = [], []
            for _ in range(repeats):
                with _IndexerTimer() as timer:
                    t0 = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - t0)
                idx_times.append(timer.seconds)
            i = sorted(range(repeats), key=lambda j: times[j])[repeats // 2]
            n_idx = sum(b.attention.indexer is not None for b in model.layers.values())
            rows.append({"L": L, "index_share_every": share, "indexer_layers": n_idx,
                         "step_s": times[i], "indexer_s": idx_times[i], "indexer_share": idx_times[i] / times[i]})  # fmt: skip
    return rows

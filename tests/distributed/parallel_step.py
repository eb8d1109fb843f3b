"""One training step (forward + backward over micro-batches) of a parallelized model, without
the trainer: what parallelize's options (mixed precision, activation checkpointing, compile)
change is compared on exactly the same model, batch and normalisation."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from wanka.config.schema import ModelConfig
from wanka.distributed.parallel_dims import ParallelDims
from wanka.distributed.parallelize import parallelize
from wanka.models.transformer import Transformer

# Tiny, but with every block kind: dense + MoE layers, indexer and index-sharing layers,
# an MTP block; L = 96 > index_topk = 16, so attention is DSA-sparse.
CFG = ModelConfig(n_layers=3, index_topk=16, index_share_every=2)
GLOBAL_BATCH, SEQ_LEN = 4, 96


def global_batch(step: int, n: int = GLOBAL_BATCH, L: int = SEQ_LEN):
    """tokens, positions, doc_ids, labels [n, L]: two packed documents per row."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (n, L), generator=g)
    cut = 40
    doc_ids = torch.zeros(n, L, dtype=torch.int32)
    doc_ids[:, cut:] = 1
    positions = torch.cat([torch.arange(cut), torch.arange(L - cut)]).expand(n, L).contiguous()
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    labels[:, cut - 1] = -100  # no target across the document boundary
    return tokens, positions, doc_ids, labels


def build(dims: ParallelDims, cfg: ModelConfig = CFG, **options) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return parallelize(model, dims, **options)


def step(model: Transformer, dims: ParallelDims, micro_batches: int = 2) -> dict:
    """Forward + backward of `micro_batches` micro-batches (gradients accumulated without sync,
    reduced after the last), this rank's share of each global batch. Loss sums are normalised
    by global counts as the trainer does. Returns (on every rank) global loss sums, full
    gradients and the all-reduced MoE loads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world
    sums = torch.zeros(4, dtype=torch.float64)
    for i in range(micro_batches):
        tokens, positions, doc_ids, labels = (
            t[rank * per_rank : (rank + 1) * per_rank] for t in global_batch(i)
        )
        model.set_requires_gradient_sync(i == micro_batches - 1)
        parts = model(tokens, positions, doc_ids, labels)
        n_tok = GLOBAL_BATCH * SEQ_LEN * micro_batches
        loss = (parts.lm_sum + 0.3 * parts.mtp_sum + parts.kl_sum) / n_tok + parts.balance
        loss.backward()
        sums += (
            torch.stack([parts.lm_sum, parts.mtp_sum, parts.kl_sum, parts.balance])
            .detach()
            .double()
        )
    dist.all_reduce(sums)
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    loads = torch.stack([m.load for m in model.moe_layers()])
    dist.all_reduce(loads)
    dtypes = {
        "params": {str(p.dtype) for p in model.parameters()},
        "grads": {str(p.grad.dtype) for p in model.parameters()},
    }
    return {"sums": sums, "grads": grads, "loads": loads, "dtypes": dtypes}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def compare_options(out: str, ep: int, variants: dict[str, dict], cfg: dict | None = None) -> None:
    """On every rank: one step per variant (parallelize options); rank 0 saves the results."""
    dims = ParallelDims.resolve(-1, ep, dist.get_world_size())
    dims.build_meshes("cpu")
    model_cfg = dataclasses.replace(CFG, **(cfg or {}))
    results = {}
    for name, opts in variants.items():
        if opts.get("compile"):
            torch._dynamo.reset()  # fresh caches: no earlier variant's graphs or recompile limit
            counters.clear()
        model = build(dims, model_cfg, **opts)
        seen: set[str] = set()
        model.layers["0"].register_forward_hook(functools.partial(_record_dtype, seen))
        results[name] = step(model, dims)
        results[name]["dtypes"]["hidden"] = seen
        results[name]["graphs"] = counters["stats"]["unique_graphs"] if opts.get("compile") else 0
    if dist.get_rank() == 0:
        torch.save(results, Path(out))


def _record_dtype(seen: set[str], module, args, out) -> None:
    seen.add(str(out[0].dtype))  # a block returns (hidden, attention aux, MoE losses)


def run_variants(out: str, ep: int, variants: dict[str, dict], cfg: dict | None = None) -> None:
    """Spawn entry point: process group, variants, clean exit."""
    dist.init_process_group("gloo")
    try:
        compare_options(out, ep, variants, cfg)
    finally:
        dist.destroy_process_group()

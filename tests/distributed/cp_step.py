"""One forward + backward under context parallelism (spawned gloo ranks), compared on every rank
with the same step of an unsharded model on the whole batch (no parallelism at all)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from wanka.config.schema import ModelConfig
from wanka.data.loader import Batch, _row, _stack, _Stream
from wanka.distributed.context_parallel import CPSharder
from wanka.distributed.cp_cost import CostModel
from wanka.distributed.parallel_dims import ParallelDims
from wanka.distributed.parallelize import parallelize
from wanka.models.transformer import Transformer

# Every block kind: dense + MoE layers, indexer and index-sharing layers, MTP depth 2.
CFG = ModelConfig(n_layers=3, index_topk=16, index_share_every=2, mtp_depth=2)
SEQ_LEN = 96


def packed_rows(n_rows: int, doc_lengths: list[int], seed: int) -> Batch:
    """n_rows packed windows over a stream of documents of the given lengths (as the loader
    cuts them: documents run across row ends, labels stop at document ends)."""
    g = np.random.default_rng(seed)
    lengths = np.array(doc_lengths, dtype=np.int64)
    tokens = g.integers(0, CFG.vocab_size, int(lengths.sum()), dtype=np.int64)
    ds = SimpleNamespace(doc_lengths=lengths, tokens=tokens,
                         offsets=np.concatenate([[0], np.cumsum(lengths)[:-1]]))  # fmt: skip
    stream = _Stream(ds, np.arange(len(lengths)))
    return _stack([_row(stream, w, SEQ_LEN) for w in range(n_rows)])


def build(dims: ParallelDims | None, cfg: ModelConfig) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model if dims is None else parallelize(model, dims)


def _loss(parts, n_lm, n_mtp, n_tok, phase):
    kl = parts.kl_sum / n_tok
    if phase == "dense_warmup":
        return kl
    return parts.lm_sum / n_lm + 0.3 * parts.mtp_sum / n_mtp + kl


def reference(micro: list[Batch], cfg: ModelConfig, phase: str) -> dict:
    from wanka.models.transformer import mtp_labels

    model = build(None, cfg)
    n_lm = sum(int((b.labels != -100).sum()) for b in micro)
    n_mtp = sum(int((mtp_labels(b.labels, b.doc_ids, d) != -100).sum())
                for b in micro for d in range(1, cfg.mtp_depth + 1))  # fmt: skip
    n_tok = sum(b.tokens.numel() for b in micro)
    sums = torch.zeros(3, dtype=torch.float64)
    for b in micro:
        parts = model(b.tokens, b.positions, b.doc_ids, b.labels, phase=phase)
        _loss(parts, n_lm, n_mtp, n_tok, phase).backward()
        sums += torch.stack([parts.lm_sum, parts.mtp_sum, parts.kl_sum]).detach().double()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"sums": sums, "grads": grads}


def cp_step(micro: list[Batch], dims: ParallelDims, cfg: ModelConfig, layout: str,
            phase: str) -> dict:  # fmt: skip
    model = build(dims, cfg)
    cost = None
    if layout == "dynamic_wide":  # a cost model so attention-heavy that plans widen the block
        layout, cost = "dynamic", CostModel(linear=1.0, sparse=0.0, dense=1.0, topk=16)
    shard = CPSharder(dims.dp_shard, dims.cp, dims.mesh("dp").get_local_rank(),
                      dims.mesh("cp").get_local_rank(), dims.gather_groups(), layout,
                      cfg.mtp_depth, SEQ_LEN > cfg.index_topk, cost)  # fmt: skip
    local = [shard(b) for b in micro]
    spans = [dist.get_world_size(lay.group) for _, lay in local]
    counts = torch.tensor([sum(int((b.labels != -100).sum()) for b, _ in local),
                           sum(int((t != -100).sum()) for _, lay in local for t in lay.mtp_labels)],
                          dtype=torch.float64)  # fmt: skip
    dist.all_reduce(counts)
    n_lm, n_mtp = counts.tolist()
    n_tok = sum(b.tokens.numel() for b in micro)
    sums = torch.zeros(3, dtype=torch.float64)
    for i, (b, lay) in enumerate(local):
        model.set_requires_gradient_sync(i == len(local) - 1)
        parts = model(b.tokens, b.positions, b.doc_ids, b.labels, phase=phase, layout=lay)
        _loss(parts, n_lm, n_mtp, n_tok, phase).backward()
        sums += torch.stack([parts.lm_sum, parts.mtp_sum, parts.kl_sum]).detach().double()
    dist.all_reduce(sums)
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n] = g.detach().clone()
    return {
        "sums": sums,
        "grads": grads,
        "tokens": [int(b.tokens.numel()) for b, _ in local],
        "spans": spans,
    }


def run(out: str, cp: int, ep: int, layouts: list[str], phases: list[str], docs: list[int],
        rows: int, cfg: dict | None = None) -> None:  # fmt: skip
    """Spawn entry point: every (layout, phase) on these ranks; rank 0 saves CP and reference."""
    dist.init_process_group("gloo")
    try:
        model_cfg = dataclasses.replace(CFG, **(cfg or {}))
        dims = ParallelDims.resolve(-1, ep, dist.get_world_size(), cp)
        dims.build_meshes("cpu")
        micro = [packed_rows(rows, docs, seed=i) for i in range(2)]
        results = {}
        for phase in phases:
            results[("reference", phase)] = reference(micro, model_cfg, phase)
            for layout in layouts:
                results[(layout, phase)] = cp_step(micro, dims, model_cfg, layout, phase)
        if dist.get_rank() == 0:
            torch.save(results, Path(out))
    finally:
        dist.destroy_process_group()


def gather_group_ranks(out: str, cp: int) -> None:
    """Spawn entry point: every rank writes the members of each of its gather groups."""
    dist.init_process_group("gloo")
    try:
        dims = ParallelDims.resolve(-1, 1, dist.get_world_size(), cp)
        dims.build_meshes("cpu")
        groups = {s: dist.get_process_group_ranks(g) for s, g in dims.gather_groups().items()}
        Path(f"{out}.{dist.get_rank()}").write_text(repr(sorted(groups.items())))
    finally:
        dist.destroy_process_group()

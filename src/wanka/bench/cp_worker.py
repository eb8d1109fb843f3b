"""One rank of `wanka bench cp`: the same steps under each CP layout, timed per rank.

Spawned (gloo, torch at 1 thread) by bench/cp.py. Every rank builds the same packed rows from
the fragment lengths it is given (random tokens, fixed seed), shards them with CPSharder and
runs forward + backward of a small FSDP2-wrapped model. Per step it records its wall time,
its own CPU time (time.thread_time: the main thread does all of a rank's compute on CPU,
while waits inside gloo collectives block without spending CPU) and the cost-model terms of
the pieces it held. A few calibration steps of contiguous and head_tail first fit the cost
model dynamic plans with (unless one was given); then every layout runs each timed step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wanka.bench.cp_report import fit_cost
from wanka.config.schema import ModelConfig
from wanka.data.loader import Batch
from wanka.distributed.context_parallel import CPSharder
from wanka.distributed.cp_cost import CostModel
from wanka.distributed.cp_plan import plan_step, rows_from_doc_ids
from wanka.distributed.parallel_dims import ParallelDims
from wanka.distributed.parallelize import parallelize
from wanka.models.transformer import Transformer

FIXED = ("contiguous", "head_tail")  # layouts that need no cost model


def packed_batch(rows: list[list[int]], vocab: int, seed: int) -> Batch:
    """[len(rows), L] Batch of the given fragment lengths per row: random tokens, positions
    restarting at each fragment, labels the next token inside the fragment (as the loader)."""
    g = torch.Generator().manual_seed(seed)
    L = sum(rows[0])
    frag = torch.tensor(np.concatenate([np.repeat(np.arange(len(r)), r) for r in rows]))
    frag = frag.view(len(rows), L).to(torch.int32)
    tokens = torch.randint(0, vocab, (len(rows), L), generator=g)
    first = torch.ones_like(frag, dtype=torch.bool)
    first[:, 1:] = frag[:, 1:] != frag[:, :-1]
    pos = torch.arange(L).expand(len(rows), L)
    positions = pos - torch.where(first, pos, 0).cummax(dim=1).values
    labels = torch.full_like(tokens, -100)
    same = frag[:, 1:] == frag[:, :-1]
    labels[:, :-1] = torch.where(same, tokens[:, 1:], -100)
    return Batch(tokens, labels, positions, frag)


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """The bench's model on CPU, built on the meta device and initialised (seed 0)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def _rank_terms(rows: Batch, dp: int, cp: int, layout: str, plan_cost: CostModel,
                topk: int, rank: int) -> tuple[list[int], list[list[int]], int]:  # fmt: skip
    """((tokens, sparse pairs, dense pairs) of the pieces `rank` holds, those pieces [start,
    end), the plan's gather span) (plans are deterministic: this is the plan CPSharder used)."""
    per_row = rows_from_doc_ids(rows.doc_ids.numpy())
    B = len(per_row) // dp
    plan = plan_step([per_row[g * B : (g + 1) * B] for g in range(dp)], cp, layout, plan_cost)
    mine = plan.piece_rank == rank
    terms = CostModel(topk=topk).terms(plan.piece_start[mine], plan.piece_end[mine])
    pieces = np.column_stack([plan.piece_start[mine], plan.piece_end[mine]]).tolist()
    return [int(t.sum()) for t in terms], pieces, plan.span


class _Ranks:
    """This rank's model, groups and step routine."""

    def __init__(self, cfg: ModelConfig, dp: int, cp: int) -> None:
        self.cfg, self.dp, self.cp = cfg, dp, cp
        self.dims = ParallelDims.resolve(dp, 1, dist.get_world_size(), cp)
        self.dims.build_meshes("cpu")
        self.dp_rank = self.dims.mesh("dp").get_local_rank()
        self.cp_rank = self.dims.mesh("cp").get_local_rank()
        self.model = parallelize(build_model(cfg), self.dims)

    def step(self, rows: Batch, layout: str, plan_cost: CostModel) -> dict:
        sharder = CPSharder(self.dp, self.cp, self.dp_rank, self.cp_rank,
                            self.dims.gather_groups(), layout, self.cfg.mtp_depth,
                            rows.tokens.shape[1] > self.cfg.index_topk, plan_cost)  # fmt: skip
        # Every rank starts the step together. An all-reduce, not dist.barrier(): with a
        # barrier here and an all_gather_object after each step, gloo intermittently saw
        # mismatched collectives (not understood; never with this all-reduce).
        dist.all_reduce(torch.zeros(1))
        w0, c0 = time.perf_counter(), time.thread_time()
        b, lay = sharder(rows)
        c1 = time.thread_time()
        parts = self.model(b.tokens, b.positions, b.doc_ids, b.labels, phase="sparse", layout=lay)
        n = max(1, b.tokens.numel())  # scale only: the loss value does not change the work
        ((parts.lm_sum + parts.mtp_sum + parts.kl_sum) / n).backward()
        c2, w1 = time.thread_time(), time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        rank = dist.get_rank()
        terms, pieces, span = _rank_terms(
            rows, self.dp, self.cp, layout, plan_cost, self.cfg.index_topk, rank
        )
        return {"rank": rank, "tokens": int(b.tokens.numel()), "wall_s": w1 - w0,
                "plan_s": c1 - c0, "compute_s": c2 - c1, "terms": terms, "pieces": pieces,
                "span": span}  # fmt: skip


def _gather(mine: dict[str, list[dict]]) -> dict[str, list[list[dict]]]:
    """{layout: [per step: this rank's record]} of every rank -> {layout: [per step: [per
    rank]]}. Once per phase, not per step: fewer collectives between the timed steps."""
    every: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {x: [sorted(s, key=lambda r: r["rank"]) for s in zip(*(e[x] for e in every))]
            for x in mine}  # type: ignore[index]  # fmt: skip


def _fit_on_rank0(records: list[dict], topk: int) -> CostModel:
    """Rank 0 fits, everyone gets its coefficients: dynamic plans must match bit for bit."""
    box: list[dict | None] = [None]
    if dist.get_rank() == 0:
        box[0] = dataclasses.asdict(fit_cost(records, topk)[0])
    dist.broadcast_object_list(box, src=0)
    return CostModel(**box[0])  # type: ignore[arg-type]


def _run(ranks: _Ranks, batches: list[Batch], layouts: list[str],
         cost: CostModel) -> dict[str, list[list[dict]]]:  # fmt: skip
    """Every batch under every layout, alternating step by step so load changes on the
    machine hit the layouts alike -> {layout: [per step: [per rank record]]}."""
    mine: dict[str, list[dict]] = {x: [] for x in layouts}
    for b in batches:
        for layout in layouts:
            mine[layout].append(ranks.step(b, layout, cost))
    return _gather(mine)


def run_seq_len(ranks: _Ranks, steps: list[list[list[int]]], calib: int, seed: int,
                layouts: list[str], given: CostModel | None) -> dict:  # fmt: skip
    """steps: the warm-up, `calib` calibration steps, then the timed ones (fragment lengths
    per row). Calibration runs the layouts that need no cost model and fits the one dynamic
    plans with (unless `given`); the timed steps then run every layout with it.
    -> {"per_step": timed records, "calibration": calibration records, "plan_cost"}."""
    topk = ranks.cfg.index_topk
    batches = [packed_batch(rows, ranks.cfg.vocab_size, seed + i) for i, rows in enumerate(steps)]
    plan_cost = given or CostModel(topk=topk)
    for layout in layouts:  # warm-up: allocator, first-call paths of every op
        ranks.step(batches[0], layout, plan_cost)
    calibration = _run(ranks, batches[1 : 1 + calib], [x for x in layouts if x in FIXED],
                       plan_cost)  # fmt: skip
    if given is None and calib > 0:
        records = [r for s in calibration.values() for t in s for r in t]
        plan_cost = _fit_on_rank0(records, topk)
    return {"per_step": _run(ranks, batches[1 + calib :], layouts, plan_cost),
            "calibration": calibration, "plan_cost": dataclasses.asdict(plan_cost)}  # fmt: skip


def rank_main(result: str, spec: dict) -> None:
    """Spawned entry: every seq len of spec; rank 0 writes the records to `result`."""
    dist.init_process_group("gloo")
    try:
        cfg = ModelConfig(**spec["model"])
        ranks = _Ranks(cfg, spec["dp"], spec["cp"])
        given = CostModel(**spec["cost"]) if spec.get("cost") else None
        runs = []
        for seq_len, steps in zip(spec["seq_lens"], spec["rows"]):
            run = run_seq_len(ranks, steps, spec["calib"], spec["seed"], spec["layouts"], given)
            runs.append({"seq_len": seq_len, **run})
            if dist.get_rank() == 0:
                print(f"  seq_len {seq_len}: done", flush=True)
        if dist.get_rank() == 0:
            Path(result).write_text(json.dumps(runs))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, result: str, spec: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)  # one core's worth of work per rank, as a training rank
    # context_parallel.py's collectives warn once per rank that torch renamed them: noise here.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+_tensor` is deprecated")
    rank_main(result, spec)


def spawn_ranks(world: int, result: Path, spec: dict) -> list[dict]:
    """Run the measurement on `world` spawned gloo ranks; returns rank 0's records."""
    mp.spawn(_entry, args=(world, _free_port(), str(result), spec), nprocs=world, join=True)
    return json.loads(result.read_text())

"""`wanka bench cp --replay`: every rank's forward + backward run alone, one after another.

The measured mode runs dp x cp gloo ranks at once. Where ranks outnumber cores (4 ranks on
the 2-core CI VM) they time-share cores and caches, and a rank's CPU time carries the others'
interference: there the same rank's work measured 5-15% apart from one step to the next, as
much as the imbalance being compared. Replay plans each step as the ranks do (CPSharder, the
same gather spans), then, per step and layout:

1. capture (untimed): the ranks' forwards run together in threads, each all-gather an
   in-process exchange of the real keys, and every rank's gathered buffers are kept;
2. replay (timed): each rank's forward + backward runs alone on one thread, its gathers
   answered from the captured buffers with its own share in place (so gradients reach its
   keys, as the reduce-scatter brings them), `repeats` times, the fastest kept: noise only
   ever adds time.

Every op so sees the live rank's shapes and values (the CPU ops have value-dependent paths:
the indexer's exact tie handling, the sparse attention's shared-key split). Left out is
communication: no gloo, and the model is not FSDP-wrapped (no parameter gathers).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import torch

from wanka.bench.cp_report import fit_cost
from wanka.bench.cp_worker import FIXED, build_model, packed_batch
from wanka.config.schema import ModelConfig
from wanka.data.loader import Batch
from wanka.device import keep_freed_host_memory
from wanka.distributed.context_parallel import CPLayout, CPSharder, pad_tokens, shard_rows
from wanka.distributed.cp_cost import CostModel
from wanka.distributed.parallel_dims import gather_spans

CAPTURE_TIMEOUT_S = 600.0  # a rank that never reaches the next gather: fail, do not hang


class _Exchange:
    """The all-gather of one step's ranks, in process: rank r posts its padded keys, waits for
    the others, reads its block's in rank order."""

    def __init__(self, ranks: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * ranks
        self.barrier = threading.Barrier(ranks, timeout=CAPTURE_TIMEOUT_S)

    def all_gather(self, rank: int, padded: torch.Tensor, span: int) -> torch.Tensor:
        self.slots[rank] = padded
        self.barrier.wait()
        first = rank - rank % span  # blocks are aligned runs of span consecutive ranks
        out = torch.cat(self.slots[first : first + span], dim=1)  # type: ignore[arg-type]
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out


@dataclasses.dataclass
class CapturingLayout(CPLayout):
    """Capture pass: gathers through the in-process exchange and keeps what they return."""

    rank: int = 0
    span: int = 1
    exchange: _Exchange | None = None
    captured: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        # Every rank calls gather on every layer (a block that needs none included), so the
        # barrier counts agree; a block that needs none keeps its keys.
        out = self.exchange.all_gather(self.rank, pad_tokens(x, self.Lmax), self.span)  # type: ignore[union-attr]
        if not self.needs_gather:
            return x
        self.captured.append(out)
        return out


@dataclasses.dataclass
class ReplayLayout(CPLayout):
    """Timed pass: the i-th gather returns the captured buffer with this rank's share
    replaced by x (the same values, now in the autograd graph)."""

    rank: int = 0
    span: int = 1
    captured: list[torch.Tensor] = dataclasses.field(default_factory=list)
    calls: int = 0

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self.needs_gather:
            return x
        buf = self.captured[self.calls]
        self.calls += 1
        off = (self.rank % self.span) * self.Lmax
        return torch.cat([buf[:, :off], pad_tokens(x, self.Lmax), buf[:, off + self.Lmax :]],
                         dim=1)  # fmt: skip


def _forward_backward(model: torch.nn.Module, local: Batch, lay: CPLayout) -> None:
    parts = model(local.tokens, local.positions, local.doc_ids, local.labels, phase="sparse",
                  layout=lay)  # fmt: skip
    ((parts.lm_sum + parts.mtp_sum + parts.kl_sum) / local.tokens.numel()).backward()


def _capture(model: torch.nn.Module, shares: list, span: int) -> list[list[torch.Tensor]]:
    """Every rank's gathered buffers of one step: the ranks' forwards in lockstep threads."""
    exchange = _Exchange(len(shares))
    fields = [f.name for f in dataclasses.fields(CPLayout)]
    layouts = [CapturingLayout(**{f: getattr(lay, f) for f in fields}, rank=r, span=span,
                               exchange=exchange) for r, (_, lay) in enumerate(shares)]  # fmt: skip
    errors: list[BaseException] = []

    def run(r: int) -> None:
        local = shares[r][0]
        try:
            with torch.no_grad():
                model(local.tokens, local.positions, local.doc_ids, local.labels,
                      phase="sparse", layout=layouts[r])  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - re-raised below, after every thread ends
            errors.append(e)
            exchange.barrier.abort()  # the others leave their wait instead of hanging

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(shares))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    return [lay.captured for lay in layouts]


def replay_steps(model: torch.nn.Module, cfg: ModelConfig, rows: Batch, dp: int, cp: int,
                 layouts: list[str], cost: CostModel, repeats: int) -> dict[str, list[dict]]:  # fmt: skip
    """One step under each layout -> {layout: per rank {rank, tokens, compute_s (fastest of
    `repeats`), repeats_s, wall_s (= compute_s), plan_s, terms, span}, in rank order}.

    The timed runs interleave: repeat by repeat, rank by rank, every layout in turn (rotated),
    so a slow spell of the machine (tens of seconds on a shared VM) lands on all layouts
    alike instead of on one layout's block of runs, and a rank's repeats are spread in time."""
    sparse = rows.tokens.shape[1] > cfg.index_topk
    groups = {s: None for s in gather_spans(dp * cp, cp)}  # the live ranks' gather groups
    fields = [f.name for f in dataclasses.fields(CPLayout)]
    prepared = {}
    for layout in layouts:
        sharder = CPSharder(dp, cp, 0, 0, groups, layout, cfg.mtp_depth, sparse, cost)
        c0 = time.thread_time()
        plan = sharder.plan(rows)
        plan_s = time.thread_time() - c0
        shares = [shard_rows(rows, plan, r // cp, r % cp, sharder.groups, cfg.mtp_depth, sparse)
                  for r in range(dp * cp)]  # fmt: skip
        prepared[layout] = (plan, plan_s, shares, _capture(model, shares, plan.span))
    times: dict[tuple[str, int], list[float]] = {}
    for rep in range(repeats):
        for rank in range(dp * cp):
            shift = (rank + rep) % len(layouts)
            for layout in layouts[shift:] + layouts[:shift]:
                plan, _, shares, captured = prepared[layout]
                local, lay = shares[rank]
                replay = ReplayLayout(**{f: getattr(lay, f) for f in fields}, rank=rank,
                                      span=plan.span, captured=captured[rank])  # fmt: skip
                t0 = time.thread_time()
                _forward_backward(model, local, replay)
                times.setdefault((layout, rank), []).append(time.thread_time() - t0)
                model.zero_grad(set_to_none=True)
    out: dict[str, list[dict]] = {}
    for layout, (plan, plan_s, shares, _) in prepared.items():
        out[layout] = []
        for rank, (local, _) in enumerate(shares):
            t = times[(layout, rank)]
            mine = plan.piece_rank == rank
            terms = CostModel(topk=cfg.index_topk).terms(plan.piece_start[mine],
                                                         plan.piece_end[mine])  # fmt: skip
            out[layout].append({"rank": rank, "tokens": int(local.tokens.numel()),
                                "compute_s": min(t), "wall_s": min(t), "repeats_s": t,
                                "plan_s": plan_s, "terms": [int(x.sum()) for x in terms],
                                "pieces": np.column_stack([plan.piece_start[mine],
                                                           plan.piece_end[mine]]).tolist(),
                                "span": plan.span})  # fmt: skip
    return out


def replay_step(model: torch.nn.Module, cfg: ModelConfig, rows: Batch, dp: int, cp: int,
                layout: str, cost: CostModel, repeats: int) -> list[dict]:  # fmt: skip
    """One step of one layout (replay_steps with a single layout)."""
    return replay_steps(model, cfg, rows, dp, cp, [layout], cost, repeats)[layout]


def _run(model, cfg, batches: list[Batch], dp: int, cp: int, layouts: list[str],
         cost: CostModel, repeats: int) -> dict[str, list[list[dict]]]:  # fmt: skip
    """Every batch under every layout (interleaved within the step, replay_steps)."""
    got: dict[str, list[list[dict]]] = {x: [] for x in layouts}
    for b in batches:
        for layout, records in replay_steps(model, cfg, b, dp, cp, layouts, cost, repeats).items():
            got[layout].append(records)
    return got


def run_replay(spec: dict, repeats: int) -> list[dict]:
    """The measured mode's spec (bench/cp.py run_measured) replayed in this process -> the
    records spawn_ranks would return: per seq len {per_step, calibration, plan_cost}."""
    torch.set_num_threads(1)  # one core's worth of work per rank, as in the measured mode
    keep_freed_host_memory()  # page faults were ~18% of a replayed step's CPU time
    cfg = ModelConfig(**spec["model"])
    model = build_model(cfg)
    dp, cp, calib, layouts = spec["dp"], spec["cp"], spec["calib"], spec["layouts"]
    given = CostModel(**spec["cost"]) if spec.get("cost") else None
    runs = []
    for seq_len, steps in zip(spec["seq_lens"], spec["rows"]):
        batches = [packed_batch(r, cfg.vocab_size, spec["seed"] + i) for i, r in enumerate(steps)]
        plan_cost = given or CostModel(topk=cfg.index_topk)
        replay_steps(model, cfg, batches[0], dp, cp, layouts, plan_cost, 1)  # warm-up
        fixed = [x for x in layouts if x in FIXED]
        calibration = _run(model, cfg, batches[1 : 1 + calib], dp, cp, fixed, plan_cost, repeats)
        if given is None and calib > 0:
            records = [r for st in calibration.values() for step in st for r in step]
            plan_cost = fit_cost(records, cfg.index_topk)[0]
        per_step = _run(model, cfg, batches[1 + calib :], dp, cp, layouts, plan_cost, repeats)
        runs.append({"seq_len": seq_len, "per_step": per_step, "calibration": calibration,
                     "plan_cost": dataclasses.asdict(plan_cost)})  # fmt: skip
        print(f"  seq_len {seq_len}: done", flush=True)
    return runs

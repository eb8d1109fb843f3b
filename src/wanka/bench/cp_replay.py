"""`wanka bench cp --replay`: every rank's forward + backward run alone, one after another.

The measured mode runs dp x cp gloo ranks at once. Where ranks outnumber cores (4 ranks on
the 2-core CI VM) they time-share cores and caches, and a rank's CPU time carries the others'
interference: there the same rank's work measured 5-15% apart from one step to the next, as
much as the imbalance being compared. Replay makes each step's plan exactly as the ranks do
(cp_plan.plan_step on the rows of the whole dp x cp group), then runs each rank's share by
itself in this process on one thread: its tokens, its segments and a gathered key buffer of
its block's size, `repeats` times, keeping the fastest (the usual defence against a noisy
machine: noise only ever adds time). That is the compute one accelerator per rank would
spend. Left out is communication: the all-gather is a stand-in (the rank's own keys padded to
the block's Lmax and tiled span times, so every op sees the real shapes and does the real
work on other values), and the model is not FSDP-wrapped (no parameter gathers).
"""

from __future__ import annotations

import ctypes
import dataclasses
import time

import torch
import torch.nn.functional as F

from wanka.bench.cp_worker import FIXED, packed_batch
from wanka.config.schema import ModelConfig
from wanka.data.loader import Batch
from wanka.distributed.context_parallel import CPLayout, shard_rows
from wanka.distributed.cp_cost import CostModel
from wanka.distributed.cp_plan import plan_step, rows_from_doc_ids
from wanka.models.transformer import Transformer


@dataclasses.dataclass
class StandInLayout(CPLayout):
    """A rank's CPLayout whose gather needs no peers: this rank's keys, padded to the block's
    Lmax and tiled over the block's `span` ranks (the gathered buffer's real shape), plus
    fixed noise of their scale. Without the noise a document prefix read across tiles would
    hold the same key twice, and the indexer's exact tie handling at the k-th score (slow)
    would run where real, all-distinct keys never send it. Gradients reach x from every tile,
    as the reduce-scatter brings this rank its keys' gradients."""

    span: int = 1

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if not self.needs_gather:
            return x
        pad = [0, 0] * (x.dim() - 2) + [0, self.Lmax - x.shape[1]]
        tiles = F.pad(x, pad).repeat(1, self.span, *([1] * (x.dim() - 2)))
        g = torch.Generator(device=x.device).manual_seed(0)
        noise = torch.randn(tiles.shape, generator=g, dtype=x.dtype, device=x.device)
        return tiles + noise * x.detach().std()


def keep_freed_memory() -> None:
    """glibc returns large freed blocks to the kernel and the next step faults them back in:
    kernel time that lands in the rank's CPU time and varies run to run on a VM. Raise the
    thresholds (blocks above 32 MiB, glibc's ceiling, are still mapped per use)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def replay_step(model: torch.nn.Module, cfg: ModelConfig, rows: Batch, dp: int, cp: int,
                layout: str, cost: CostModel, repeats: int) -> list[dict]:  # fmt: skip
    """One step of `layout`: per rank {rank, tokens, compute_s (fastest of `repeats`),
    repeats_s, wall_s (= compute_s), plan_s, terms, span}, in rank order."""
    c0 = time.thread_time()
    per_row = rows_from_doc_ids(rows.doc_ids.numpy())
    B = len(per_row) // dp
    plan = plan_step([per_row[g * B : (g + 1) * B] for g in range(dp)], cp, layout, cost)
    plan_s = time.thread_time() - c0
    sparse = rows.tokens.shape[1] > cfg.index_topk
    fields = [f.name for f in dataclasses.fields(CPLayout)]
    out = []
    for rank in range(dp * cp):
        local, lay = shard_rows(rows, plan, rank // cp, rank % cp, {plan.span: None},
                                cfg.mtp_depth, sparse)  # fmt: skip
        lay = StandInLayout(**{f: getattr(lay, f) for f in fields}, span=plan.span)
        times = []
        for _ in range(repeats):
            t0 = time.thread_time()
            parts = model(local.tokens, local.positions, local.doc_ids, local.labels,
                          phase="sparse", layout=lay)  # fmt: skip
            ((parts.lm_sum + parts.mtp_sum + parts.kl_sum) / local.tokens.numel()).backward()
            times.append(time.thread_time() - t0)
            model.zero_grad(set_to_none=True)
        mine = plan.piece_rank == rank
        terms = CostModel(topk=cfg.index_topk).terms(plan.piece_start[mine], plan.piece_end[mine])
        out.append({"rank": rank, "tokens": int(local.tokens.numel()), "compute_s": min(times),
                    "wall_s": min(times), "repeats_s": times, "plan_s": plan_s,
                    "terms": [int(t.sum()) for t in terms], "span": plan.span})  # fmt: skip
    return out


def _run(model, cfg, batches: list[Batch], dp: int, cp: int, layouts: list[str],
         cost: CostModel, repeats: int) -> dict[str, list[list[dict]]]:  # fmt: skip
    """Every batch under every layout, in turn step by step (as the measured mode)."""
    got: dict[str, list[list[dict]]] = {x: [] for x in layouts}
    for b in batches:
        for layout in layouts:
            got[layout].append(replay_step(model, cfg, b, dp, cp, layout, cost, repeats))
    return got


def run_replay(spec: dict, repeats: int) -> list[dict]:
    """The measured mode's spec (bench/cp.py run_measured) replayed in this process -> the
    records spawn_ranks would return: per seq len {per_step, calibration, plan_cost}."""
    torch.set_num_threads(1)  # one core's worth of work per rank, as in the measured mode
    keep_freed_memory()
    cfg = ModelConfig(**spec["model"])
    model = build_model(cfg)
    dp, cp, calib, layouts = spec["dp"], spec["cp"], spec["calib"], spec["layouts"]
    given = CostModel(**spec["cost"]) if spec.get("cost") else None
    runs = []
    for seq_len, steps in zip(spec["seq_lens"], spec["rows"]):
        batches = [packed_batch(r, cfg.vocab_size, spec["seed"] + i) for i, r in enumerate(steps)]
        plan_cost = given or CostModel(topk=cfg.index_topk)
        for layout in layouts:  # warm-up: allocator, first-call paths of every op
            replay_step(model, cfg, batches[0], dp, cp, layout, plan_cost, 1)
        fixed = [x for x in layouts if x in FIXED]
        calibration = _run(model, cfg, batches[1 : 1 + calib], dp, cp, fixed, plan_cost, repeats)
        if given is None and calib > 0:
            samples = [r["terms"] + [r["compute_s"]]
                       for st in calibration.values() for step in st for r in step]  # fmt: skip
            plan_cost = CostModel.fit(samples, topk=cfg.index_topk)
        per_step = _run(model, cfg, batches[1 + calib :], dp, cp, layouts, plan_cost, repeats)
        runs.append({"seq_len": seq_len, "per_step": per_step, "calibration": calibration,
                     "plan_cost": dataclasses.asdict(plan_cost)})  # fmt: skip
        print(f"  seq_len {seq_len}: done", flush=True)
    return runs

"""Hostile inputs for the context-parallel planner, as pure functions: thousands of random
document-length lists (1- and 2-token documents, one document spanning every row, documents
exactly a head-tail chunk long, odd and tiny rows, dp 1-4 x cp 1-8), tight token budgets,
and cost models or cost files with extreme coefficients."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tests.unit.test_cp_plan import check_plan
from wanka.distributed.cp_cost import CostModel, load_cost
from wanka.distributed.cp_plan import PlanError, plan_step

COSTS = [
    CostModel(),
    CostModel(linear=1.0, sparse=0.0, dense=1.0, topk=16),  # attention-heavy
    CostModel(linear=0.0, sparse=1e-6, dense=0.0, topk=1),  # top-k 1
    CostModel(linear=0.0, sparse=0.0, dense=1.0, topk=1),  # dense only
    CostModel(linear=1e-30, sparse=1e30, dense=0.0, topk=3),  # extreme but allowed
    CostModel(linear=1e30, sparse=0.0, dense=1e-30, topk=100_000),  # top-k above every row
]


def _row(rng: np.random.Generator, L: int, kind: str, cp: int) -> list[int]:
    if kind == "whole":  # the row is one document (or one fragment of a longer one)
        return [L]
    if kind == "ones":  # 1- and 2-token documents, a long one now and then
        out: list[int] = []
        while sum(out) < L:
            out.append(min(int(rng.choice([1, 2, 1, 2, L])), L - sum(out)))
        return out
    if kind == "chunks":  # documents exactly L / (2 cp) long: boundaries on chunk boundaries
        c = max(1, L // (2 * cp))
        return [c] * (L // c) + ([L % c] if L % c else [])
    k = int(rng.integers(1, min(L, 8) + 1))  # a few random cuts
    cuts = np.sort(rng.choice(np.arange(1, L), size=k - 1, replace=False)) if L > 1 else []
    return np.diff(np.concatenate([[0], cuts, [L]])).astype(int).tolist()


def _batches(seed: int, n: int):
    rng = np.random.default_rng(seed)
    for i in range(n):
        dp, cp = int(rng.choice([1, 2, 3, 4])), int(rng.choice([1, 2, 3, 4, 8]))
        L, B = int(rng.integers(1, 140)), int(rng.integers(1, 3))
        kind = str(rng.choice(["whole", "ones", "chunks", "random"]))
        rows = [[_row(rng, L, kind, cp) for _ in range(B)] for _ in range(dp)]
        yield rows, cp, COSTS[i % len(COSTS)], rng


@pytest.mark.parametrize("layout", ["contiguous", "head_tail", "dynamic"])
def test_every_token_once_in_order_within_budget_and_deterministic(layout: str) -> None:
    """check_plan: each fragment's every token on exactly one rank, pieces in document order,
    segments tiling each rank, key indices the document's prefix in order; dynamic: no rank
    above the default budget (mean + 10%) and the same plan when made again."""
    for rows, cp, cost, _ in _batches(seed=1, n=600):
        L = sum(rows[0][0])
        if layout == "contiguous" and L % cp:
            with pytest.raises(ValueError, match="divisible"):
                plan_step(rows, cp, layout, cost)
            continue
        plan = plan_step(rows, cp, layout, cost)
        check_plan(rows, plan)
        if layout != "dynamic":
            continue
        total = sum(sum(r) for g in rows for r in g)
        budget = math.ceil(math.ceil(total / plan.ranks) * 1.1)
        assert plan.tokens_per_rank().max() <= budget, (rows, cp)
        again = plan_step(rows, cp, layout, cost)
        for a in ("piece_rank", "piece_doc", "piece_start", "piece_end", "piece_q0", "lmax"):
            assert np.array_equal(getattr(plan, a), getattr(again, a)), (a, rows, cp)
        assert plan.span == again.span


def test_a_budget_with_no_slack_is_met_exactly() -> None:
    """A budget of exactly the mean tokens per rank (every rank at its limit) can always be
    met when each dp group holds the same tokens (the loader's rows): the greedy used to fail
    on it ("a document of 6 tokens fits on no rank") and the head-tail fallback's rounding
    went one token over, so plan_step refused a feasible budget."""
    rows = [[[8, 6, 13, 17, 12]], [[23, 14, 19]]]  # 56 tokens per group, 6 ranks
    for cost in COSTS[:3]:
        plan = plan_step(rows, 3, "dynamic", cost, max_tokens_per_rank=19)
        check_plan(rows, plan)
        assert plan.tokens_per_rank().max() <= 19
    rng = np.random.default_rng(7)
    for rows, cp, cost, _ in _batches(seed=2, n=400):
        total = sum(sum(r) for g in rows for r in g)
        budget = math.ceil(total / (len(rows) * cp)) + int(rng.integers(0, 2))
        plan = plan_step(rows, cp, "dynamic", cost, max_tokens_per_rank=budget, slack=0.0)
        check_plan(rows, plan)
        assert plan.tokens_per_rank().max() <= budget, (rows, cp, budget)


def test_a_budget_below_the_mean_is_refused() -> None:
    with pytest.raises(PlanError, match="below the mean"):
        plan_step([[[10, 6]], [[16]]], 2, "dynamic", max_tokens_per_rank=7)


@pytest.mark.parametrize("field,value", [
    ("linear", -1e-4), ("sparse", float("nan")), ("dense", float("inf")), ("linear", 1e300),
    ("sparse", 1e-40), ("gather", -1.0), ("gather", float("nan")), ("linear", "1e-4"),
    ("sparse", None), ("topk", 0), ("topk", -3), ("topk", "64"), ("topk", float("nan")),
    ("topk", 2.5), ("topk", 10**30), ("topk", float("inf")),
])  # fmt: skip
def test_a_cost_file_with_an_extreme_field_is_refused_in_one_line(tmp_path, field, value):
    """A topk of NaN passed (NaN < 1 is false) and made every modelled cost NaN: `wanka
    bench cp --simulate --cost` printed a table of nan; 1e30 as an int overflowed int64 in a
    traceback."""
    fields = {"linear": 1e-4, "sparse": 1e-7, "dense": 1e-9, "topk": 64, "gather": 1e-6}
    path = tmp_path / "cp.json"
    path.write_text(json.dumps({"cost_model": {**fields, field: value}}))
    with pytest.raises(ValueError) as err:
        load_cost(path, "parallel.cp_cost")
    assert len(str(err.value).splitlines()) == 1
    assert str(err.value).startswith("parallel.cp_cost ")


def test_zero_coefficients_are_allowed_but_not_all_of_them(tmp_path) -> None:
    assert CostModel(linear=0.0, sparse=0.0, dense=1e-9).dense == 1e-9
    path = tmp_path / "cp.json"
    path.write_text(json.dumps({"linear": 0, "sparse": 0, "dense": 0, "topk": 64}))
    with pytest.raises(ValueError, match="not all zero"):
        load_cost(path)


def test_dense_warmup_gradients_do_not_depend_on_whether_the_block_gathers() -> None:
    """Dense warm-up trains only the indexers (their input is detached). Under CP a rank
    whose block all-gathers ties the gathered buffer into the KL at zero cost, so zero
    gradients flow back through K and V into every parameter; a rank whose CP group keeps its
    documents whole does not gather, and only its indexers get gradients. FSDP2 reduce-scatters
    only parameters with a gradient, so with dp 2 x cp 2 the groups' reduce-scatters differ in
    size: gloo aborts ("Received data size doesn't match expected size"), NCCL may hang.
    Repro (spawned, dp 2 x cp 2, 128-token rows): documents [128] + [4] * 40 in dense warm-up
    under the default dynamic layout (its plan gathers in group 0 only), or
    tests/distributed/test_cp_hostile.py's dp2_long_and_ones on contiguous or head_tail.
    Here: one process, the gather replaced by a local stand-in, the set of parameters with a
    gradient compared."""
    from tests.distributed.cp_step import packed_rows
    from wanka.config.schema import ModelConfig
    from wanka.distributed import context_parallel as cpm
    from wanka.models.transformer import Transformer

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=2, head_dim=32, n_dense_layers=1,
                      dense_hidden=128, n_experts=4, expert_hidden=32, index_topk=16,
                      index_share_every=2, mtp_depth=1)  # fmt: skip
    from wanka.distributed.cp_plan import rows_from_doc_ids

    rows = packed_rows(2, [4] * 60, seed=0)  # 96-token rows of whole 4-token documents
    per_row = rows_from_doc_ids(rows.doc_ids.numpy())
    plan = plan_step([per_row[:1], per_row[1:]], 2, "contiguous")
    assert not plan.needs_gather.any()  # every document whole on one rank

    class LocalGather(cpm.CPLayout):
        def gather(self, x):  # the rank's keys tiled over the block (values do not matter)
            return cpm.pad_tokens(x, self.Lmax).repeat(1, 2, *[1] * (x.dim() - 2))

    def with_grad(needs_gather: bool) -> set[str]:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cpu")
        model.init_weights(0)
        local, lay = cpm.shard_rows(rows, plan, 0, 0, {2: None}, cfg.mtp_depth, True)
        lay = LocalGather(None, lay.Lmax, lay.segments, needs_gather, lay.sparse,
                          lay.mtp_tokens, lay.mtp_labels)  # fmt: skip
        parts = model(local.tokens, local.positions, local.doc_ids, local.labels,
                      phase="dense_warmup", layout=lay)  # fmt: skip
        parts.kl_sum.backward()
        return {n for n, p in model.named_parameters() if p.grad is not None}

    alone = with_grad(False)
    assert alone and all(".indexer." in n for n in alone)
    assert with_grad(True) == alone

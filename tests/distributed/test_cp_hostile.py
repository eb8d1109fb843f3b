"""Hostile inputs for context parallelism's exactness (the layouts' losses and gradients
equal one unsharded process): document-length distributions the main exactness test does
not use (1- and 2-token documents, one document spanning every row, documents exactly a
head-tail chunk long, odd row lengths not a multiple of 2 cp), index_topk 1 and larger than
the row, MTP depth 1 and 2, both DSA phases, two rows per dp group and two micro-batches
(gradient accumulation), on a tiny model."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import cp_step
from tests.distributed.helpers import spawn_in_turn

TINY = {"dim": 64, "n_layers": 2, "n_heads": 2, "head_dim": 32, "n_dense_layers": 1,
        "dense_hidden": 128, "n_experts": 4, "expert_hidden": 32, "index_share_every": 2}  # fmt: skip
LAYOUTS = ["contiguous", "head_tail", "dynamic"]


def _entry(out: str, seq_len: int, cp: int, layouts, phases, docs, rows, cfg) -> None:
    cp_step.SEQ_LEN = seq_len  # packed_rows and the sparse flag read the module's row length
    cp_step.run(out, cp, 1, layouts, phases, docs, rows, {**TINY, **cfg})


# name: (world, cp, seq_len, layouts, phases, documents, rows of all dp groups, model)
CASES = {
    # 1- and 2-token documents only; 90 is not a multiple of 2 cp; micro-batch 2.
    "tiny_docs": (
        2,
        2,
        90,
        LAYOUTS,
        ["sparse", "dense_warmup"],
        [1, 2, 1, 1, 2] * 60,
        2,
        {"index_topk": 16, "mtp_depth": 2},
    ),
    # One document longer than every row together (each row a fragment of it), top-k 1.
    "one_doc_topk1": (
        2,
        2,
        64,
        LAYOUTS,
        ["sparse", "dense_warmup"],
        [1000],
        2,
        {"index_topk": 1, "mtp_depth": 1},
    ),
    # Documents exactly a head-tail chunk long (64 / 4), boundaries on chunk boundaries;
    # index_topk above the row: dense attention in both phases.
    "chunk_docs_dense": (
        2,
        2,
        64,
        LAYOUTS,
        ["sparse"],
        [16] * 40,
        2,
        {"index_topk": 200, "mtp_depth": 2},
    ),
    # Odd lengths, odd row length (contiguous needs seq_len % cp == 0: not run).
    "odd": (
        2,
        2,
        75,
        ["head_tail", "dynamic"],
        ["sparse", "dense_warmup"],
        [7, 13, 3, 1, 29, 5, 31, 1, 11, 9, 77, 3],
        2,
        {"index_topk": 8, "mtp_depth": 2},
    ),
    # cp 4: 1- and 2-token documents, 84 tokens a row (not a multiple of 2 cp = 8).
    "cp4_tiny_docs": (
        4,
        4,
        84,
        LAYOUTS,
        ["sparse", "dense_warmup"],
        [2, 1, 1] * 100,
        1,
        {"index_topk": 4, "mtp_depth": 2},
    ),
    # dp 2 x cp 2, two rows per dp group: each row exactly one document (boundaries on row
    # and chunk boundaries), and a widened gather block.
    "dp2_row_docs": (
        4,
        2,
        64,
        LAYOUTS + ["dynamic_wide"],
        ["sparse", "dense_warmup"],
        [64] * 8,
        4,
        {"index_topk": 16, "mtp_depth": 1},
    ),
    # dp 2 x cp 2: one dp group's rows a single long document, the other's 1-token ones. In
    # dense warm-up one CP group gathers and the other not: FSDP's reduce-scatters differed in
    # size (gloo aborted) while the gather sent zero grads into every parameter (see
    # tests/unit/test_cp_hostile.py, test_dense_warmup_gradients_do_not_depend_on_...).
    "dp2_long_and_ones": (
        4,
        2,
        64,
        LAYOUTS + ["dynamic_wide"],
        ["sparse", "dense_warmup"],
        [128] + [1] * 200,
        4,
        {"index_topk": 1, "mtp_depth": 2},
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp_hostile")
    by_world: dict[int, list] = {}
    for name, (world, cp, seq_len, layouts, phases, docs, rows, cfg) in CASES.items():
        by_world.setdefault(world, []).append(
            (_entry, str(out / f"{name}.pt"), seq_len, cp, layouts, phases, docs, rows, cfg)
        )
    for world, calls in by_world.items():
        spawn_in_turn(world, *calls)
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in CASES}


def _check(res: dict, phases, layouts) -> None:
    for phase in phases:
        ref = res[("reference", phase)]
        for layout in layouts:
            got, where = res[(layout, phase)], f"{layout}/{phase}"
            torch.testing.assert_close(got["sums"], ref["sums"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, w=where: f"{w} loss sums: {m}")  # fmt: skip
            for name in got["grads"].keys() - ref["grads"].keys():
                assert not got["grads"][name].any(), f"{where}: {name} should get no gradient"
            for name, g in ref["grads"].items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name, w=where: f"{w} grad {n}: {m}")  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_cp_hostile_documents_match_unsharded(results, name):
    _world, _cp, _L, layouts, phases, *_ = CASES[name]
    _check(results[name], phases, layouts)

"""Benchmark helpers: the FLOPs model, the matmul peak, and the train bench end to end."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from wanka.bench.flops import flops_breakdown, flops_per_token, measure_matmul_peak
from wanka.bench.train import case_specs, format_table, run_bench, train_command
from wanka.config.schema import ModelConfig
from wanka.models.flavors import FLAVORS

# Small enough to count by hand (see test_flops_hand_computed).
HAND = ModelConfig(
    flavor="hand", vocab_size=16, dim=8, n_layers=2, n_heads=2, head_dim=4, tie_embeddings=True,
    n_index_heads=1, index_head_dim=4, index_topk=4, index_share_every=2, n_dense_layers=1,
    dense_hidden=16, n_experts=4, n_active_experts=2, expert_hidden=8, n_shared_experts=1,
    mtp_depth=1, max_seq_len=64,
)  # fmt: skip


def test_flops_hand_computed():
    # Matmul params per token:
    #   attention per layer: wq 8x8 + wkv 8x(2*4) + wo 8x8 = 192, two layers      -> 384
    #   indexer (layer 0 only, share_every 2): wq 8x4 + wk 8x4 + ww 8x1             ->  72
    #   layer 0 dense SwiGLU 3 x 8 x 16                                             -> 384
    #   layer 1 MoE: router 8x4 + 2 of 4 experts 2 x 3x8x8 + shared 3x8x8           -> 608
    #   MTP: proj 16x8 + dense-only block (attention 192 + SwiGLU 384)              -> 704
    #   tied head 16x8, used for main logits and MTP logits: 2 x 128                -> 256
    p = 384 + 72 + 384 + 608 + 704 + 256
    assert p == 2408
    # L = 16 > k = 4: sparse. Mean keys per query = (4*5/2 + 12*4) / 16 = 3.625.
    core = 2 * (4 * 2 * 4 * 3.625)  # 2 layers x 4 h d x K
    mtp = 4 * 2 * 4 * 3.625  # the MTP block attends sparsely too (the last selection)
    index = 2 * 1 * 4 * (17 / 2)  # one indexer layer over all visible keys
    expected = 3 * (2 * p + core + mtp + index)
    assert expected == 15696
    assert flops_per_token(HAND, 16) == pytest.approx(expected, rel=1e-12)
    b = flops_breakdown(HAND, 16)
    assert b["matmul_params"] == p
    assert b["indexer_fwd"] == index


def test_flops_untied_counts_head_not_lookup():
    untied = replace(HAND, tie_embeddings=False)
    # Same matmuls: the untied head replaces the tied one, the lookup costs nothing either way.
    assert flops_per_token(untied, 16) == flops_per_token(HAND, 16)


def test_flops_dense_when_short():
    # L <= k: dense causal attention in every layer, (L+1)/2 mean keys.
    b = flops_breakdown(HAND, 4)
    assert b["attention_fwd"] == (2 + 1) * 4 * 2 * 4 * (5 / 2)


def test_flops_dsa_linear_in_seq_len():
    cfg = FLAVORS["small"]
    k = cfg.index_topk
    Ls = [16 * k, 32 * k, 64 * k]
    b = [flops_breakdown(cfg, L) for L in Ls]
    # Sparse core attention per token (main layers and the MTP block, which attends on the
    # main model's last selection) is ~constant for L >> k (sequence cost linear in L) ...
    main = [x["attention_fwd"] for x in b]
    bound = (cfg.n_layers + cfg.mtp_depth) * 4 * cfg.n_heads * cfg.head_dim * k
    for m in main:
        assert 0.95 * bound < m <= bound
    assert main[2] / main[0] == pytest.approx(1.0, rel=0.05)
    # ... so per-sequence FLOPs without the indexer grow ~linearly: doubling L doubles them.
    seq = [(x["dense_fwd"] + m) * L for x, m, L in zip(b, main, Ls)]
    assert seq[1] / seq[0] == pytest.approx(2.0, rel=0.02)
    assert seq[2] / seq[1] == pytest.approx(2.0, rel=0.02)
    # The indexer scores every visible key: per-token cost doubles with L.
    assert b[1]["indexer_fwd"] / b[0]["indexer_fwd"] == pytest.approx(2.0, rel=0.01)
    # Total per token is monotone in L.
    assert b[0]["total"] < b[1]["total"] < b[2]["total"]


def test_matmul_peak_positive_finite():
    peak = measure_matmul_peak(0.2, sizes=(256,))
    assert math.isfinite(peak) and peak > 1e6


def test_specs_and_command(tmp_path):
    for quick in (True, False):
        specs = case_specs(quick, None)
        assert specs["small"].seq_len > FLAVORS["small"].index_topk  # exercises DSA
        for s in specs.values():
            assert s.global_batch % 2 == 0 and s.steps > 2
    assert case_specs(True, 3)["tiny"].steps == 3
    cmd = train_command(case_specs(True, None)["tiny"], 2, tmp_path / "r")
    assert "train.micro_batch_size=4" in cmd and "parallel.ep=2" in cmd
    assert cmd[cmd.index("--nproc") + 1] == "2"


@pytest.mark.slow  # a real benchmark run (~70 s): `make test-slow`
def test_bench_tiny_one_rank(tmp_path):
    out = tmp_path / "train.json"
    result = run_bench(True, out, steps=3, flavors=("tiny",), nprocs=(1,), peak_seconds=0.2)
    json.dumps(result)  # serialisable
    assert set(result) >= {"machine", "torch", "matmul_peak_flops", "cases"}
    (case,) = result["cases"]
    assert case["ok"], case["error"]
    assert case["measured_steps"] == 1 and case["warmup_steps_discarded"] == 2
    for key in ("tokens_per_s", "step_time_s", "peak_memory_mb", "flops_per_token", "mfu"):
        assert case[key] > 0, key
    assert case["tokens_per_s"] == pytest.approx(case["global_batch_tokens"] / case["step_time_s"])
    assert "tiny" in format_table(result["cases"])

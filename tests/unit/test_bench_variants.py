"""`wanka bench train` variants: activation checkpointing modes, compile, shape overrides."""

from pathlib import Path

import pytest

from wanka.bench.train import (
    CaseSpec,
    add_ratios,
    bench_train_main,
    case_specs,
    format_table,
    run_bench,
    train_command,
    variant_name,
)


def test_shape_overrides_and_variant_settings(tmp_path):
    specs = case_specs(True, 4, seq_len=4096, global_batch=1)
    assert {(s.seq_len, s.global_batch, s.steps) for s in specs.values()} == {(4096, 1, 4)}
    with pytest.raises(ValueError, match="--seq-len"):
        case_specs(True, None, seq_len=0)
    spec = CaseSpec("small", 512, 2, 3, ac="selective", compile=True)
    assert variant_name(spec) == "compile+ac-selective"
    cmd = train_command(spec, 1, tmp_path / "r")
    assert 'train.activation_checkpointing="selective"' in cmd and "train.compile=true" in cmd
    assert variant_name(specs["tiny"]) == "eager"
    assert 'train.activation_checkpointing="off"' in train_command(specs["tiny"], 1, tmp_path)


def _case(nproc, ac, comp, tps, mem):
    return {"ok": True, "flavor": "small", "nproc": nproc, "dp": nproc, "ep": nproc,
            "activation_checkpointing": ac, "compile": comp, "tokens_per_s": tps,
            "peak_memory_mb": mem, "global_batch_tokens": 4096, "step_time_s": 4096 / tps,
            "flops_per_token": 1e6, "achieved_flops": 1e6 * tps, "mfu": 0.1,
            "variant": variant_name(CaseSpec("small", 1, 1, 1, ac, comp))}  # fmt: skip


def test_ratios_compare_like_with_like():
    cases = [_case(1, "off", False, 100.0, 1000.0), _case(1, "full", False, 75.0, 400.0),
             _case(1, "off", True, 150.0, 1100.0), _case(2, "full", False, 150.0, 300.0)]  # fmt: skip
    add_ratios(cases)
    base, full, comp, full2 = cases
    assert "tokens_per_s_vs_base" not in base
    assert full["tokens_per_s_vs_base"] == 0.75 and full["peak_memory_vs_base"] == 0.4
    assert comp["tokens_per_s_vs_base"] == 1.5
    assert full2["speedup_vs_1_rank"] == 2.0  # over the 1-rank case of the same variant
    assert "tokens_per_s_vs_base" not in full2  # no 2-rank baseline ran
    table = format_table(cases)
    assert "eager+ac-full" in table and "compile" in table and "0.40" in table


def test_bad_variant_arguments_fail_early(tmp_path):
    with pytest.raises(ValueError, match="--compile"):
        bench_train_main(True, tmp_path / "x.json", 1, compile="maybe")
    with pytest.raises(ValueError, match="activation checkpointing"):
        run_bench(True, tmp_path / "x.json", 1, ac_modes=("some",))
    with pytest.raises(ValueError, match="flavor"):
        run_bench(True, tmp_path / "x.json", 1, flavors=("huge",))
    assert not Path(tmp_path / "x.json").exists()

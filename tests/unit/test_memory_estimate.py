"""The per-device memory estimate (models/stats.py): its structure, its activation term against
what autograd really saves, `wanka model` (models/model_cli.py), the pre-flight's use of it, and
one short measured run (bench/memory.py)."""

from __future__ import annotations

import argparse
import dataclasses
import weakref

import numpy as np
import pytest
import torch

from wanka.config import load_config
from wanka.models.flavors import FLAVORS
from wanka.models.model_cli import X25_PRESET, add_model_args
from wanka.models.stats import (
    COMPONENTS,
    MemorySettings,
    _block_saved,
    _head_saved,
    job_memory,
    memory_breakdown,
    memory_estimate,
    settings_for_job,
)
from wanka.models.transformer import Transformer

SMALL, TINY, X25 = FLAVORS["small"], FLAVORS["tiny"], FLAVORS["x25-293b"]
# MLA with every width distinct (q latent 48, kv latent 40, nope 24, rope 8, v 20), so a term
# with the wrong width shows.
MLA = dataclasses.replace(TINY, attention="mla", q_lora_rank=48, kv_lora_rank=40,
                          qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20)  # fmt: skip


def cpu(**kw) -> MemorySettings:
    return MemorySettings(compute_dtype="fp32", device_type="cpu", **kw)


# ------------------------------------------------------------------------- structure


def test_components_sum_to_the_peak_moment():
    e = memory_breakdown(SMALL, cpu(seq_len=1024))
    assert set(e.components) == set(COMPONENTS)
    assert sum(e.components.values()) == pytest.approx(e.train_peak)
    assert e.train_peak == max(map(e.total_at, e.moments)) == e.total_at(e.peak_at)
    assert e.components == e.moments[e.peak_at]
    assert e.peak == max(e.train_peak, e.init_peak)
    d = memory_estimate(SMALL, 1, 1, 1024, 1, compute_dtype="fp32", device_type="cpu")
    assert d["total"] == pytest.approx(sum(v for k, v in d.items() if k != "total"))
    assert d["total"] == pytest.approx(e.train_peak / 1024**3)


def test_doubling_dp_halves_the_sharded_state():
    a = memory_breakdown(SMALL, cpu(dp_shard=2, seq_len=1024))
    b = memory_breakdown(SMALL, cpu(dp_shard=4, seq_len=1024))
    assert b.components["adam_moments"] == pytest.approx(a.components["adam_moments"] / 2)
    buffers = a.components["master_params"] - a.components["adam_moments"] / 2  # rope tables
    assert buffers > 0  # replicated, not sharded
    assert b.components["master_params"] - buffers == pytest.approx(
        (a.components["master_params"] - buffers) / 2
    )
    assert b.total_at("optimizer step") < a.total_at("optimizer step")


def test_activation_checkpointing_lowers_activations():
    s = cpu(seq_len=2048)
    off, sel, full = (memory_breakdown(SMALL, dataclasses.replace(s, activation_checkpointing=m))
                      for m in ("off", "selective", "full"))  # fmt: skip
    assert off.train_peak > sel.train_peak > full.train_peak
    # what the step keeps from forward to backward, at the end of the forward
    kept = {
        e.settings.activation_checkpointing: e.moments["forward mtp 1 head"]
        for e in (off, sel, full)
    }
    assert (
        kept["off"]["activations"] > kept["selective"]["activations"] > kept["full"]["activations"]
    )
    # full: one block input [T, D] per block + the heads (no block internals)
    T, D = 2048, SMALL.dim
    blocks = SMALL.n_layers + SMALL.mtp_depth
    main, pre, post = _head_saved(SMALL, s)
    assert kept["full"]["activations"] == pytest.approx(blocks * T * D * 4 + main + pre + post)


def test_bf16_halves_the_gathered_copies_and_keeps_the_fp32_state():
    f32 = memory_breakdown(SMALL, cpu(dp_shard=2, seq_len=1024))
    b16 = memory_breakdown(SMALL, dataclasses.replace(f32.settings, compute_dtype="bf16"))
    for m in ("forward layer 1", "eval"):
        assert b16.moments[m]["gathered_params"] == pytest.approx(
            f32.moments[m]["gathered_params"] / 2
        )
    for k in ("master_params", "adam_moments"):
        assert b16.components[k] == f32.components[k]
    assert (
        b16.moments["forward layer 1"]["activations"]
        < f32.moments["forward layer 1"]["activations"]
    )


def test_mtp_and_vocab_show_in_the_logits():
    s = MemorySettings(seq_len=4096, activation_checkpointing="full")
    one = memory_breakdown(X25, dataclasses.replace(s, dp_shard=160, ep=40))
    two = memory_breakdown(dataclasses.replace(X25, mtp_depth=2), one.settings)
    T, V = 4096, X25.vocab_size
    assert one.moments["backward mtp 1 head"]["logits"] == pytest.approx(
        2 * T * V * 4 + 2 * T * V * 4 + T * V * 2  # 2 CE log-probs + grads (+ bf16 grad copy)
    )
    assert (
        two.moments["backward mtp 2 head"]["logits"] > one.moments["backward mtp 1 head"]["logits"]
    )


def test_fsdp_dim0_padding_of_experts_is_modelled():
    pad = memory_breakdown(X25, MemorySettings(dp_shard=1280, ep=40))
    even = memory_breakdown(X25, MemorySettings(dp_shard=160, ep=40))
    # 4 local experts over 32 ranks: each still holds one whole expert row per weight
    assert any("padded" in n for n in pad.notes) and not any("padded" in n for n in even.notes)
    assert pad.components["adam_moments"] == pytest.approx(even.components["adam_moments"], rel=0.1)
    with pytest.raises(ValueError, match="must divide model.n_experts"):
        memory_breakdown(X25, MemorySettings(dp_shard=1024, ep=64))


def test_init_materialises_the_whole_model():
    e = memory_breakdown(X25, MemorySettings(dp_shard=1280, ep=40))
    assert e.init_peak > 290e9 * 4 and e.peak == e.init_peak
    assert any("initialisation" in n for n in e.notes)


def test_job_settings_follow_the_config():
    cfg = load_config(None, ["parallel.ep=2", "train.activation_checkpointing=\"full\"",
                             "train.dense_warmup_steps=5", "train.reduce_dtype=\"bf16\""])  # fmt: skip
    phases = settings_for_job(cfg, 4, "cuda")
    assert [p.phase for p in phases] == ["dense_warmup", "sparse"]
    s = phases[1]
    assert (s.dp_shard, s.ep, s.compute_dtype, s.reduce_dtype, s.activation_checkpointing) == (
        4, 2, "bf16", "bf16", "full")  # fmt: skip
    assert settings_for_job(cfg, 4, "cpu")[0].compute_dtype == "fp32"  # auto on CPU
    assert job_memory(cfg, 4, "cpu").peak > 0


def test_cp_settings_follow_the_config():
    cfg = load_config(None, ["parallel.cp=4", "data.seq_len=1024", "train.micro_batch_size=2"])
    s = settings_for_job(cfg, 8, "cpu")[-1]
    # FSDP over dp x cp = all 8 ranks; dynamic: the plan's token budget (mean + 10%); the
    # gather may widen to every rank.
    assert (s.dp_shard, s.cp, s.cp_span) == (8, 4, 8)
    assert s.tokens == s.cp_tokens == int(np.ceil(2 * 1024 / 4 * 1.10))
    ht = load_config(None, ["parallel.cp=4", "parallel.cp_layout=\"head_tail\"",
                            "parallel.dp_shard=2", "data.seq_len=1024",
                            "train.micro_batch_size=1"])  # fmt: skip
    s = settings_for_job(ht, 8, "cpu")[-1]
    assert (s.dp_shard, s.cp_span, s.tokens) == (8, 4, 256)
    # The widest gather block a plan may pick: cp x 2^k dividing the world, <= 4 cp by default.
    for world, max_span, span in [(6, 0, 2), (12, 0, 4), (16, 0, 8), (8, 6, 4), (16, 16, 16)]:
        c = load_config(None, ["parallel.cp=2", f"parallel.cp_max_span={max_span}"])
        assert settings_for_job(c, world, "cpu")[-1].cp_span == span, (world, max_span)
    plain = load_config(None, [])
    assert settings_for_job(plain, 8, "cpu")[-1].tokens == (
        plain.train.micro_batch_size * plain.data.seq_len
    )  # no CP: the whole micro-batch


def test_cp_divides_activations_but_keeps_the_blocks_gathered():
    one = memory_breakdown(TINY, cpu(seq_len=4096, dp_shard=4))
    cp4 = memory_breakdown(TINY, cpu(seq_len=16384, dp_shard=4, cp=4))
    # 4x the sequence over 4 ranks: about the same activations (a rank also keeps the
    # document prefixes it read from the gathered keys, a whole sequence's K and V)...
    assert sum(cp4.saved_by_part.values()) == pytest.approx(
        sum(one.saved_by_part.values()), rel=0.15
    )
    assert cp4.saved_by_part["attention"] > one.saved_by_part["attention"]
    # ...but FSDP does not reshard blocks between forward and backward under CP (ZeRO-2).
    late = [m for m in cp4.moments if m.startswith("forward mtp")]
    assert max(cp4.moments[m]["gathered_params"] for m in late) > 2 * max(
        one.moments[m]["gathered_params"] for m in late
    )


# ------------------------------------------------- activations vs autograd's saved tensors


def _saved_by_segment(cfg, B: int, L: int, dtype=torch.float32) -> dict[str, int]:
    """Bytes autograd keeps for backward after one forward, per block / head segment (each
    storage counted once, where first saved; parameters and buffers excluded). `dtype`: the
    parameters' (buffers, the rope tables, stay fp32, as under FSDP2's mixed precision)."""
    with torch.device("meta"):
        m = Transformer(cfg)
    m.to_empty(device="cpu")
    m.init_weights(0)
    for p in m.parameters():
        p.data = p.data.to(dtype)
    cur, rec = ["head"], []
    for name, blk in m.layers.items():
        blk.register_forward_pre_hook(lambda *_, n=name: cur.__setitem__(0, f"layer {n}"))
        blk.register_forward_hook(lambda *_: cur.__setitem__(0, "head"))
    for mtp in m.mtp:
        mtp.block.register_forward_pre_hook(lambda *_: cur.__setitem__(0, "mtp"))
        mtp.block.register_forward_hook(lambda *_: cur.__setitem__(0, "head"))

    def pack(t):
        rec.append((weakref.ref(t), cur[0]))
        return t

    tok = torch.randint(0, cfg.vocab_size, (B, L))
    pos = torch.arange(L).expand(B, L).contiguous()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parts = m(tok, pos, torch.zeros(B, L, dtype=torch.long), tok.clone())
    skip = {t.untyped_storage().data_ptr() for t in [*m.parameters(), *m.buffers()]}
    out: dict[str, int] = {}
    for ref, seg in rec:
        t = ref()
        if t is None or t.untyped_storage().data_ptr() in skip:
            continue
        skip.add(t.untyped_storage().data_ptr())
        out[seg] = out.get(seg, 0) + t.untyped_storage().nbytes()
    del parts
    return out


def test_block_activations_match_autograd(monkeypatch):
    """fp32, the loop experts backend (no routing-dependent padding; the
    grouped-GEMM path saves the same): every block exactly."""
    monkeypatch.setenv("WANKA_OPS_BACKEND", "grouped_swiglu=reference")
    cfg = dataclasses.replace(TINY, n_layers=3)
    B, L = 2, 128  # L > index_topk: the sparse path with the indexer's KL and top-k
    got = _saved_by_segment(cfg, B, L)
    s = MemorySettings(seq_len=L, micro_batch_size=B, compute_dtype="fp32", device_type="cuda")
    for i in range(cfg.n_layers):
        est = sum(_block_saved(cfg, s, i % cfg.index_share_every == 0,
                               i >= cfg.n_dense_layers).values())  # fmt: skip
        assert got[f"layer {i}"] == est, f"layer {i}"
    assert got["mtp"] == sum(_block_saved(cfg, s, False, False).values())
    main, pre, post = _head_saved(cfg, s)
    # (+ a 4-byte total-weight scalar per cross-entropy)
    assert got["head"] == main + pre + post + 2 * B * L * cfg.vocab_size * 4 + 2 * 4


@pytest.mark.parametrize("attention, dtype", [("mla", "fp32"), ("mla", "bf16"), ("mqa", "bf16")])
def test_block_activations_match_autograd_mla_and_bf16(monkeypatch, attention, dtype):
    """MLA (models/mla.py) as above, and both forms in bf16 (bf16 parameters, compute without
    autocast, fp32 buffers: FSDP2's mixed precision). One known difference in bf16: CPU's
    layer_norm keeps bf16 mean and rstd [T] in the indexers, where CUDA's keep fp32."""
    monkeypatch.setenv("WANKA_OPS_BACKEND", "grouped_swiglu=reference")
    cfg = dataclasses.replace(MLA if attention == "mla" else TINY, n_layers=3)
    B, L = 2, 128
    got = _saved_by_segment(cfg, B, L, torch.float32 if dtype == "fp32" else torch.bfloat16)
    s = MemorySettings(seq_len=L, micro_batch_size=B, compute_dtype=dtype, device_type="cuda")
    cpu_ln = 2 * B * L * 2 if dtype == "bf16" else 0
    for i in range(cfg.n_layers):
        has_indexer = i % cfg.index_share_every == 0
        est = sum(_block_saved(cfg, s, has_indexer, i >= cfg.n_dense_layers).values())
        assert got[f"layer {i}"] == est - (cpu_ln if has_indexer else 0), f"layer {i}"
    assert got["mtp"] == sum(_block_saved(cfg, s, False, False).values())
    main, pre, post = _head_saved(cfg, s)
    assert got["head"] == main + pre + post + 2 * B * L * cfg.vocab_size * 4 + 2 * 4


def test_mla_cp_keeps_its_gathered_latent_once_when_sparse():
    """Under CP a segment keeps its copy of the gathered keys: MLA's K = V tensor (latent +
    rope key) once where the sparse op reads it as both, twice where dense_attention gets the
    k and v copies _core_cp makes; MQA's K and V (2 head_dim); the indexer keys."""
    L, Dk, Di = 4096, MLA.kv_lora_rank + MLA.qk_rope_head_dim, MLA.index_head_dim
    for cfg, phase, width in [(MLA, "sparse", Dk), (MLA, "dense_warmup", 2 * Dk),
                              (TINY, "sparse", 2 * TINY.head_dim)]:  # fmt: skip
        cp = cpu(seq_len=L, dp_shard=4, cp=4, phase=phase)
        one = dataclasses.replace(cp, cp=1, seq_len=cp.tokens)  # same tokens per rank
        extra = _block_saved(cfg, cp, True, True)["attention"]
        assert extra - _block_saved(cfg, one, True, True)["attention"] == L * (width + Di) * 4


# ---------------------------------------------------------------------------- wanka model


def run_model(capsys, *argv: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args(list(argv))
    rc = args.fn(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_model_refuses_an_ep_that_does_not_divide_the_experts(capsys):
    rc, out, err = run_model(capsys, "x25-293b", "--dp", "1024", "--ep", "64")
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert "--ep 64 does not divide model.n_experts=160" in err and "40" in err
    rc, _, err = run_model(capsys, "tiny", "--dp", "3", "--ep", "2")
    assert rc == 2 and "must divide --dp x --cp = 3" in err and len(err.strip().splitlines()) == 1
    # As in training, EP borrows from dp x cp: a layout `wanka train` runs is estimated.
    rc, out, _ = run_model(capsys, "tiny", "--dp", "2", "--ep", "4", "--cp", "2", "--ac", "off")
    assert rc == 0 and "total" in out
    rc, _, err = run_model(capsys, "tiny", "--ep", "0")
    assert rc == 2 and "--ep 0 must be positive" in err  # not "--dp 0" (it defaults to --ep)


def test_model_x25_defaults_to_a_production_layout(capsys):
    rc, out, _ = run_model(capsys, "x25-293b")
    assert rc == 0
    assert "total 291." in out and "active" in out
    assert f"preset dp_shard {X25_PRESET['dp']} x ep {X25_PRESET['ep']}" in out
    assert "bf16 compute copies" in out and "activation checkpointing full (preset)" in out
    assert "seq_len 4096 (preset)" in out and "GiB" in out and "initialisation" in out
    total = float(next(x for x in out.splitlines() if x.strip().startswith("total")).split()[1])
    assert 20 < total < 80  # per device, not a one-rank total of ~4.7 TB


def test_model_reports_at_the_config_sequence_length(capsys):
    rc, out, _ = run_model(capsys, "tiny", "--device", "cpu")
    assert rc == 0 and "seq_len 256 (config)" in out and "micro-batch 8 (config)" in out
    assert "dp_shard 1 x ep 1" in out and "fp32 compute copies" in out
    rc, out, _ = run_model(capsys, "small", "--seq-len", "2048", "--dp", "2", "--ep", "2",
                           "--device", "cuda", "--ac", "selective")  # fmt: skip
    assert rc == 0 and "seq_len 2048 (given)" in out and "dp_shard 2 x ep 2" in out
    assert "bf16 compute copies" in out and "activation checkpointing selective (given)" in out
    rc, out, _ = run_model(capsys, "x25-293b", "--dp", "160", "--ep", "40", "--seq-len", "8192")
    assert rc == 0 and "layout: dp_shard 160 x ep 40\n" in out and "seq_len 8192 (given)" in out
    # another layout keeps the production settings (not the demo config's 8 x fp32, no AC)
    assert "micro-batch 1 (preset)" in out and "activation checkpointing full (preset)" in out
    total = float(next(x for x in out.splitlines() if x.strip().startswith("total")).split()[1])
    assert 20 < total < 200, out


def test_model_with_cp_matches_the_jobs_estimate(capsys):
    """`wanka model --cp` reports what the pre-flight would for that job: FSDP over dp x cp,
    the dynamic layout's token budget, its widest gather block."""
    sets = ["--set", "model.max_seq_len=16384", "--seq-len", "16384", "--micro-batch", "1"]
    rc, out, _ = run_model(capsys, "tiny", "--dp", "2", "--cp", "4", "--device", "cpu", *sets)
    assert rc == 0 and "context parallel: cp 4 (dynamic): 8 accelerators" in out
    total = float(next(x for x in out.splitlines() if x.strip().startswith("total")).split()[1])
    cfg = load_config(None, ['model.flavor="tiny"', "model.max_seq_len=16384",
                             "data.seq_len=16384", "train.micro_batch_size=1",
                             "parallel.cp=4", "parallel.dp_shard=2"])  # fmt: skip
    assert total == pytest.approx(job_memory(cfg, 8, "cpu").train_peak / 2**30, abs=0.006)
    rc, out, _ = run_model(capsys, "tiny", "--dp", "2", "--device", "cpu", *sets)
    plain = float(next(x for x in out.splitlines() if x.strip().startswith("total")).split()[1])
    assert total < plain / 2  # a quarter of each sequence per rank
    rc, _, err = run_model(capsys, "tiny", "--cp", "2", "--ac", "full")
    assert rc == 2 and "--ac off" in err


# ------------------------------------------------------------------------------ pre-flight


def test_preflight_uses_the_jobs_settings():
    from wanka.resilience import preflight as pf

    base = ["model.flavor=\"small\"", "data.seq_len=2048", "train.micro_batch_size=1",
            "run.device=\"cpu\""]  # fmt: skip
    off = pf.memory_need_bytes(load_config(None, base), 1)
    full = pf.memory_need_bytes(
        load_config(None, [*base, 'train.activation_checkpointing="full"']), 1
    )
    assert full < off
    assert off == int(job_memory(load_config(None, base), 1, "cpu").peak)


# ----------------------------------------------------------------- measured vs estimated


def test_measured_peak_of_a_tiny_run_is_within_25_percent(tmp_path):
    """A real 1-rank tiny job (2 steps, ~15 s; the second has the AdamW moments): peak anonymous RSS growth vs the estimate."""
    from wanka.bench.memory import MemCase, measure_case
    from wanka.data import ByteTokenizer, builtin_documents, prepare_documents

    data = prepare_documents(builtin_documents()[:200], tmp_path / "ds", ByteTokenizer(), 0.1)
    row = measure_case(MemCase("tiny", 1, 1, 256, 4, steps=2), tmp_path / "runs", str(data))
    assert "error" not in row, row.get("error")
    assert abs(row["error_pct"]) < 25, row
    assert row["measured_state_mib"] > 0.8 * row["estimate_state_mib"]

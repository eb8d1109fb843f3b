"""`wanka model`: parameter counts and the per-device memory estimate (models/stats.py) of a
flavor at a parallel layout, with every assumption printed.

Defaults come from the job config (data.seq_len, train.micro_batch_size, parallel.*,
train.mixed_precision / reduce_dtype / activation_checkpointing, run.device). For x25-293b with
no layout given (no --dp/--ep, no parallel settings in the config) it reports a realistic
production layout instead of a one-rank total: X25_PRESET.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wanka.config.schema import ModelConfig

# Not from stats: that imports torch, and building the CLI parser must not.
AC_MODES = ("off", "full", "selective")
GIB = 1024**3

# DeepSeek-V3 keeps 4 routed experts per EP rank (256 experts over EP 64) on ~2k accelerators;
# x25-293b's 160 experts over ep 40 give the same 4 per rank, on 1280 accelerators (160 nodes of
# 8), bf16 compute, full activation checkpointing, 4k tokens per sequence, one per micro-batch.
X25_PRESET = {"dp": 1280, "ep": 40, "seq_len": 4096, "micro_batch": 1, "device": "cuda",
              "mixed_precision": "bf16", "ac": "full"}  # fmt: skip
PRESET_FLAVOR = "x25-293b"

_LABELS = {
    "master_params": "fp32 master params (sharded) + buffers",
    "adam_moments": "fp32 AdamW exp_avg + exp_avg_sq (sharded)",
    "grads": "fp32 sharded grads reduced so far",
    "gathered_params": "unsharded compute copies in flight",
    "unsharded_grads": "grads of the block in backward + reduce buffer",
    "activations": "saved for backward",
    "topk_indices": "DSA top-k indices (int64)",
    "logits": "fp32 log-probs (+ grads) of the CE heads",
    "workspace": "transient tiles / copies of the op in flight",
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("flavor", nargs="?", help="tiny | small | x25-293b (default: the config's)")
    p.add_argument("--config", default=None, help="TOML job file (defaults when omitted)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel shards (default: parallel.dp_shard; -1 there: ep)")  # fmt: skip
    p.add_argument("--ep", type=int, default=None, help="expert parallel (default: parallel.ep)")
    p.add_argument("--cp", type=int, default=None,
                   help="context parallel: ranks per sequence, on top of --dp (default: "
                        "parallel.cp; layout parallel.cp_layout)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=None, help="default: data.seq_len")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per rank per micro-batch (default: train.micro_batch_size)")  # fmt: skip
    p.add_argument("--device", choices=("cpu", "cuda", "npu"), default=None,
                   help="default: run.device ('auto': this machine's)")  # fmt: skip
    p.add_argument("--mixed-precision", choices=("auto", "fp32", "bf16"), default=None,
                   help="default: train.mixed_precision (auto: bf16 on accelerators, fp32 on CPU)")  # fmt: skip
    p.add_argument("--ac", choices=AC_MODES, default=None,
                   help="activation checkpointing (default: train.activation_checkpointing)")  # fmt: skip
    p.set_defaults(fn=model_main)


def _fail(msg: str) -> int:
    print(f"wanka model: {msg}", file=sys.stderr)
    return 2


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _attention(m: ModelConfig) -> str:
    """The attention form the estimate models (its activations differ widely)."""
    if m.attention == "mla":
        return (f"MLA, {m.n_heads} heads over one K = V tensor per token (latent "
                f"{m.kv_lora_rank} + RoPE key {m.qk_rope_head_dim}), q latent {m.q_lora_rank}")  # fmt: skip
    return f"MQA, {m.n_heads} heads of {m.head_dim} over one K and one V head"


def resolve(args: argparse.Namespace, cfg) -> tuple[dict, list[str]]:
    """The layout and settings to report and, per field, where it came from."""
    from wanka.config.schema import DataConfig, ParallelConfig, RunConfig, TrainConfig
    from wanka.device import resolve_device_type

    t, par = cfg.train, cfg.parallel
    # The preset's settings (seq_len, micro-batch, bf16, AC) apply to the production flavor
    # whatever the layout; its layout only when neither --dp/--ep nor the config sets one.
    preset = (cfg.model.flavor == PRESET_FLAVOR and args.dp is None and args.ep is None
              and (par.dp_shard, par.ep) == (ParallelConfig().dp_shard, ParallelConfig().ep))  # fmt: skip
    P = X25_PRESET if cfg.model.flavor == PRESET_FLAVOR else {}
    src: list[str] = []

    def pick(arg, cfg_value, default_value, key):
        """--flag, else the config's value when it was set (or no preset), else the preset."""
        if arg is not None:
            return arg, "given"
        if key in P and cfg_value == default_value:
            return P[key], "preset"
        return cfg_value, "config"

    L = P if preset else {}
    ep = args.ep if args.ep is not None else L.get("ep", par.ep)
    dp = args.dp if args.dp is not None else L.get("dp", par.dp_shard if par.dp_shard > 0 else ep)
    seq, s_seq = pick(args.seq_len, cfg.data.seq_len, DataConfig().seq_len, "seq_len")
    mb, s_mb = pick(args.micro_batch, t.micro_batch_size, TrainConfig().micro_batch_size,
                    "micro_batch")  # fmt: skip
    mp, s_mp = pick(args.mixed_precision, t.mixed_precision, TrainConfig().mixed_precision,
                    "mixed_precision")  # fmt: skip
    ac, s_ac = pick(args.ac, t.activation_checkpointing, TrainConfig().activation_checkpointing,
                    "ac")  # fmt: skip
    dev, s_dev = pick(args.device, cfg.run.device, RunConfig().device, "device")
    if dev == "auto":
        dev, s_dev = resolve_device_type("auto"), "this machine"
    if preset:
        src.append(f"layout: the {PRESET_FLAVOR} preset dp_shard {dp} x ep {ep} ({dp} "
                   f"accelerators, {cfg.model.n_experts // ep} routed experts per EP rank as in "
                   "DeepSeek-V3; --dp/--ep for another)")  # fmt: skip
    else:
        src.append(f"layout: dp_shard {dp} x ep {ep}")
    src.append(f"seq_len {seq} ({s_seq}), micro-batch {mb} ({s_mb}), device {dev} ({s_dev}), "
               f"mixed_precision {mp} ({s_mp}), activation checkpointing {ac} ({s_ac})")  # fmt: skip
    cp = args.cp if args.cp is not None else par.cp
    if cp > 1:
        src.append(f"context parallel: cp {cp} ({par.cp_layout}): {dp * cp} accelerators, each "
                   f"holding its share of every sequence")  # fmt: skip
    return dict(dp=dp, ep=ep, cp=cp, seq_len=seq, micro_batch=mb, mixed_precision=mp, ac=ac,
                device=dev, reduce_dtype=t.reduce_dtype), src  # fmt: skip


def model_main(args: argparse.Namespace) -> int:
    from wanka.config import ConfigError, load_config
    from wanka.device import autocast_dtype
    from wanka.models.stats import MemorySettings, count_params, cp_limits, memory_breakdown

    overrides = list(args.set)
    if args.flavor:
        named = [o for o in overrides if o.partition("=")[0].strip() == "model.flavor"]
        if named:  # (the --set won silently)
            return _fail(f"the flavor is given twice ({args.flavor} and --set {named[-1]}): "
                         "keep one")  # fmt: skip
        overrides.insert(0, f'model.flavor="{args.flavor}"')
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    m = cfg.model
    lay, src = resolve(args, cfg)
    dp, ep = lay["dp"], lay["ep"]
    cp = lay["cp"]
    for flag, value in (("--ep", ep), ("--dp", dp)):  # --dp defaults to --ep
        if value < 1:
            return _fail(f"{flag} {value} must be positive")
    if m.n_experts % ep:
        return _fail(f"--ep {ep} does not divide model.n_experts={m.n_experts} of "
                     f"{m.flavor}: use one of {_divisors(m.n_experts)}")  # fmt: skip
    if cp < 1:
        return _fail(f"--cp {cp} must be positive (1 = no context parallelism)")
    if (dp * cp) % ep:  # as in training: EP borrows its ranks from dp x cp
        return _fail(f"--ep {ep} must divide --dp x --cp = {dp * cp} (expert parallelism "
                     "borrows its ranks from data and context parallelism)")  # fmt: skip
    if lay["seq_len"] < 1 or lay["micro_batch"] < 1:
        return _fail("--seq-len and --micro-batch must be positive")
    if lay["seq_len"] > m.max_seq_len:  # training refuses it: no estimate for what cannot run
        return _fail(f"--seq-len {lay['seq_len']} > model.max_seq_len={m.max_seq_len} of "
                     f"{m.flavor}: lower it, or --set model.max_seq_len={lay['seq_len']}")  # fmt: skip
    if cp > 1 and lay["ac"] != "off":
        return _fail("context parallelism (--cp > 1) runs without activation checkpointing: "
                     "add --ac off")  # fmt: skip
    cp_tokens, span = cp_limits(cp, cfg.parallel.cp_layout, cfg.parallel.cp_max_span, dp * cp,
                                lay["micro_batch"] * lay["seq_len"])  # fmt: skip
    compute = autocast_dtype(lay["device"], lay["mixed_precision"])
    s = MemorySettings(dp_shard=dp * cp, ep=ep, cp=cp, cp_tokens=cp_tokens, cp_span=span,
                       seq_len=lay["seq_len"],
                       micro_batch_size=lay["micro_batch"],
                       compute_dtype="fp32" if compute is None else "bf16",
                       reduce_dtype=lay["reduce_dtype"], activation_checkpointing=lay["ac"],
                       device_type=lay["device"],
                       phase="dense_warmup" if cfg.train.phase == "dense_warmup" else "sparse")  # fmt: skip
    c = count_params(m)
    print(f"flavor {m.flavor}: total {c.total / 1e9:.3f}B params, active {c.active / 1e9:.3f}B "
          f"per token, routed experts {c.experts / 1e9:.3f}B")  # fmt: skip
    print(f"attention: {_attention(m)}")
    est = memory_breakdown(m, s)
    for line in src:
        print(line)
    print(f"dtypes: {s.master_dtype} master params, grads and AdamW moments (sharded); "
          f"{s.compute_dtype} compute copies and activations; {s.reduce_dtype} gradient "
          "reduce-scatter")  # fmt: skip
    print(f"per-device memory estimate, training step peak (at '{est.peak_at}'):")
    for k, v in est.components.items():
        print(f"  {k:16s} {v / GIB:9.2f} GiB  {_LABELS.get(k, '')}")
    print(f"  {'total':16s} {est.train_peak / GIB:9.2f} GiB")
    print(f"initialisation: {est.init_peak / GIB:.2f} GiB per device (the trainer builds the "
          "whole model in fp32 on every rank, then shards it)")  # fmt: skip
    for note in est.notes:
        print(f"note: {note}")
    if s.seq_len <= m.index_topk:
        print(f"note: seq_len {s.seq_len} <= model.index_topk {m.index_topk}: attention is "
              "dense at this length (DSA is sparse only above index_topk)")  # fmt: skip
    return 0

"""TOML job files -> typed JobConfig, with field-path errors and `--set a.b=v` overrides."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from wanka.config.schema import JobConfig, ModelConfig

MAX_INT = 10**12  # beyond any step count, size or degree a job can use; keeps loops finite
MAX_INT8_BLOCK = 4096  # elements per int8 block (one fp32 scale each)


class ConfigError(ValueError):
    """A config problem, reported as one line naming the field path and a fix."""

    def __init__(self, path: str, problem: str, hint: str = "") -> None:
        self.path = path
        msg = f"config error at {path}: {problem}" if path else f"config error: {problem}"
        super().__init__(msg + (f" ({hint})" if hint else ""))


def _example_config() -> str:
    """The shipped demo config, by a path that works from any folder (a checkout's configs/
    beside src/), else as written in the README."""
    shipped = Path(__file__).resolve().parents[3] / "configs" / "demo.toml"
    return str(shipped) if shipped.is_file() else "configs/demo.toml"


_EXAMPLE_HINT = f"pass a TOML job file, e.g. {_example_config()}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                check: bool = True) -> JobConfig:  # fmt: skip
    """Read a TOML job file (or the defaults when None), apply overrides, validate (unless
    check=False: post-training validates once it has put the policy's [model] in)."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError("", f"{p} is a folder, not a config file",
                              _EXAMPLE_HINT)  # fmt: skip
        if p.exists() and not p.is_file():  # a FIFO, a device: nothing to read a job from
            raise ConfigError("", f"{p} is not a regular file",
                              _EXAMPLE_HINT)  # fmt: skip
        if not p.is_file():
            raise ConfigError("", f"no such config file: {p}", _EXAMPLE_HINT)
        try:  # utf-8-sig: Windows editors start a file with a byte-order mark
            raw = tomllib.loads(p.read_text(encoding="utf-8-sig"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("", f"{p} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            line = p.read_bytes()[: e.start].count(b"\n") + 1
            raise ConfigError("", f"{p}:{line} is not UTF-8 text", "save it as UTF-8") from None
        except OSError as e:
            raise ConfigError(
                "", f"cannot read {p} ({e.strerror})", "check its permissions"
            ) from None
    for item in overrides or []:
        _apply_override(raw, item)
    cfg = _build(JobConfig, raw, "")
    _expand_home(cfg)
    if check:
        validate(cfg)
    return cfg


# Fields holding one path: "~/data" in a TOML file reaches no shell, so it is expanded here.
PATH_FIELDS = ("data.path", "data.tokenizer", "data.cache_dir", "parallel.cp_cost",
               "checkpoint.load", "checkpoint.init_weights", "run.dir", "resilience.snapshot_dir", "resilience.ledger",
               "post.init", "post.prompts")  # fmt: skip


def _expand_home(cfg: JobConfig) -> None:
    for path in PATH_FIELDS:
        section, key = path.split(".")
        part = getattr(cfg, section, None)
        value = getattr(part, key, None) if part is not None else None
        if isinstance(value, str) and value.startswith("~"):
            setattr(part, key, str(Path(value).expanduser()))


class _CliText(str):
    """A --set value TOML did not read as a number: a str field takes it as it is; a float
    field takes the numbers TOML spells otherwise (.003, 5., +.5)."""


_LOOSE_NUMBER = re.compile(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?")


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(
            item, "override must look like section.key=value", "e.g. --set train.steps=50"
        )
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = _CliText(text)  # bare words are strings: --set run.dir=runs/x
    if isinstance(value, datetime.date | datetime.time):  # no field is a date: the text is meant
        value = _CliText(text.strip())
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"{p} is not a table")
    node[parts[-1]] = value


def _build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(names)}"
            raise ConfigError(_join(path, key), "unknown key", hint)
    base = cls()
    if cls is ModelConfig:
        from wanka.models.flavors import FLAVORS

        flavor = raw.get("flavor", "tiny")
        if flavor not in FLAVORS:
            raise ConfigError(
                _join(path, "flavor"), f"unknown flavor {flavor!r}", f"one of {', '.join(FLAVORS)}"
            )
        base = dataclasses.replace(FLAVORS[flavor])
    values = {}
    for name in names:
        fpath = _join(path, name)
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw.get(name, {}), fpath)
        elif name in raw:
            values[name] = _check_type(raw[name], tp, fpath)
        else:
            values[name] = getattr(base, name)
    return cls(**values)


def _check_type(value: Any, tp: Any, path: str) -> Any:
    if get_origin(tp) is Literal:
        if value not in get_args(tp):
            raise ConfigError(
                path, f"{value!r} is not allowed", f"one of {', '.join(map(repr, get_args(tp)))}"
            )
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is float and isinstance(value, _CliText) and _LOOSE_NUMBER.fullmatch(value.strip()):
        value = float(value)
    if isinstance(value, _CliText):
        value = str(value)  # stored as a plain str (dump_toml, comparisons)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(path, f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(path, f"must be a finite number, got {value}")
    if tp is int and abs(value) > MAX_INT:
        raise ConfigError(path, f"{value} is out of range", f"at most {MAX_INT:.0e}")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def validate(cfg: JobConfig) -> None:
    """Consistency checks that single fields cannot express."""
    m, t, d = cfg.model, cfg.train, cfg.data
    positive = {
        "model.dim": m.dim, "model.n_layers": m.n_layers, "model.n_heads": m.n_heads,
        "model.head_dim": m.head_dim, "model.vocab_size": m.vocab_size,
        "model.index_topk": m.index_topk, "model.index_share_every": m.index_share_every,
        "model.n_experts": m.n_experts, "model.n_active_experts": m.n_active_experts,
        "data.seq_len": d.seq_len, "train.steps": t.steps,
        "train.micro_batch_size": t.micro_batch_size, "train.grad_accum": t.grad_accum,
        "parallel.ep": cfg.parallel.ep, "parallel.cp": cfg.parallel.cp,
        "parallel.dp_replicate": cfg.parallel.dp_replicate,
        "comm.powersgd_rank": cfg.comm.powersgd_rank, "comm.int8_block": cfg.comm.int8_block,
        "model.n_index_heads": m.n_index_heads,
        "model.expert_hidden": m.expert_hidden, "model.dense_hidden": m.dense_hidden,
        "model.max_seq_len": m.max_seq_len, "model.rope_theta": m.rope_theta,
        "train.log_every": t.log_every, "data.val_batches": d.val_batches,
        "checkpoint.keep": cfg.checkpoint.keep, "model.n_expert_groups": m.n_expert_groups,
        "model.n_limited_groups": m.n_limited_groups,
        "resilience.snapshot_max_age_h": cfg.resilience.snapshot_max_age_h,
    }  # fmt: skip
    for path, v in positive.items():
        if v <= 0:
            raise ConfigError(path, f"must be positive, got {v}")
    _check_paths(cfg)
    if cfg.comm.int8_block > MAX_INT8_BLOCK:  # a scale per block: 1e12 allocates terabytes
        raise ConfigError("comm.int8_block", f"{cfg.comm.int8_block} elements per block: at "
                          f"most {MAX_INT8_BLOCK} (typical: 64-1024; one scale per block)")  # fmt: skip
    for path, v in {"model.n_dense_layers": m.n_dense_layers, "model.n_shared_experts": m.n_shared_experts,
                    "model.init_std": m.init_std, "train.lr": t.lr, "train.weight_decay": t.weight_decay,
                    "train.grad_clip": t.grad_clip, "model.seq_balance_loss_weight": m.seq_balance_loss_weight,
                    "train.lr_horizon": t.lr_horizon, "comm.fsdp_prefetch": cfg.comm.fsdp_prefetch,
                    "comm.powersgd_start": cfg.comm.powersgd_start}.items():  # fmt: skip
        if v < 0:
            raise ConfigError(path, f"must be >= 0, got {v}")
    _check_ranges(cfg)
    if m.max_seq_len > 1 << 21:
        raise ConfigError(
            "model.max_seq_len", f"{m.max_seq_len} is beyond 2M positions", "lower it"
        )
    if m.dim % m.n_heads != 0:
        raise ConfigError("model.n_heads", f"{m.n_heads} heads do not divide model.dim={m.dim}",
                          "choose n_heads dividing dim")  # fmt: skip
    if m.head_dim % 2:
        raise ConfigError("model.head_dim", "must be even for RoPE")
    if m.index_head_dim % 2 or m.index_head_dim <= 0:
        raise ConfigError("model.index_head_dim", "must be a positive even number (RoPE)")
    if m.attention == "mla":
        _check_mla(m)
    if m.n_active_experts > m.n_experts:
        raise ConfigError(
            "model.n_active_experts", f"{m.n_active_experts} > n_experts={m.n_experts}"
        )
    if m.n_dense_layers > m.n_layers:
        raise ConfigError("model.n_dense_layers", f"{m.n_dense_layers} > n_layers={m.n_layers}")
    if m.n_experts % cfg.parallel.ep != 0:
        raise ConfigError("parallel.ep", f"ep={cfg.parallel.ep} does not divide model.n_experts={m.n_experts}",
                          "pick ep among the divisors of n_experts")  # fmt: skip
    if d.seq_len > m.max_seq_len:
        raise ConfigError("data.seq_len", f"{d.seq_len} > model.max_seq_len={m.max_seq_len}")
    if (
        cfg.parallel.cp > 1
        and cfg.parallel.cp_layout == "contiguous"
        and d.seq_len % cfg.parallel.cp
    ):
        raise ConfigError("parallel.cp", f"cp={cfg.parallel.cp} does not divide data.seq_len={d.seq_len}",
                          "the contiguous layout cuts each row into cp equal chunks: pick a divisor, "
                          "or parallel.cp_layout='head_tail' / 'dynamic'")  # fmt: skip
    need = 2 * cfg.parallel.cp if cfg.parallel.cp_layout == "head_tail" else cfg.parallel.cp
    if cfg.parallel.cp > 1 and d.seq_len * cfg.train.micro_batch_size < need:  # (else a rank
        # of each group gets no tokens: found only after the ranks started, and a restart)
        raise ConfigError("data.seq_len", f"{d.seq_len} tokens x micro_batch_size "
                          f"{cfg.train.micro_batch_size} cannot give each of cp={cfg.parallel.cp} "
                          f"ranks its {cfg.parallel.cp_layout} share (at least {need} tokens)",
                          "raise data.seq_len or lower parallel.cp")  # fmt: skip
    if cfg.parallel.cp_max_span and cfg.parallel.cp_max_span < cfg.parallel.cp:
        raise ConfigError("parallel.cp_max_span", f"{cfg.parallel.cp_max_span} is below parallel.cp={cfg.parallel.cp}",
                          "use 0 (any number of ranks) or a multiple of cp")  # fmt: skip
    if cfg.comm.grad_compression != "none" and cfg.parallel.dp_replicate == 1:
        raise ConfigError("comm.grad_compression", f"{cfg.comm.grad_compression!r} compresses the "
                          "all-reduce across HSDP replicas, but parallel.dp_replicate=1",
                          "set parallel.dp_replicate (e.g. the number of nodes) or 'none'")  # fmt: skip
    if cfg.parallel.cp > 1 and t.activation_checkpointing != "off":
        # Recomputation re-runs the K/V all-gather inside backward, where each rank's own graph
        # decides when: ranks could meet it in different orders. Not supported yet.
        raise ConfigError("train.activation_checkpointing", "is not supported with parallel.cp > 1 yet",
                          "set it to 'off', or parallel.cp=1")  # fmt: skip
    if cfg.parallel.cp > 1 and t.compile:
        raise ConfigError("train.compile", "is not supported with parallel.cp > 1 yet (each step's "
                          "layout would recompile the blocks)", "set train.compile=false")  # fmt: skip
    if m.mtp_depth < 0 or m.mtp_depth >= d.seq_len:
        raise ConfigError("model.mtp_depth", f"must be in [0, seq_len), got {m.mtp_depth}")
    if t.warmup_steps < 0 or t.dense_warmup_steps < 0:
        raise ConfigError("train.warmup_steps", "warm-up step counts must be >= 0")
    if t.dense_warmup_steps >= t.steps and t.phase == "sparse" and t.dense_warmup_steps:
        raise ConfigError("train.dense_warmup_steps", f"{t.dense_warmup_steps} >= train.steps={t.steps}",
                          "leave some sparse steps or set train.phase='dense_warmup'")  # fmt: skip
    if m.n_experts % m.n_expert_groups != 0:
        raise ConfigError("model.n_expert_groups", f"{m.n_expert_groups} groups do not divide "
                          f"model.n_experts={m.n_experts}", "pick a divisor of n_experts")  # fmt: skip
    if m.n_limited_groups > m.n_expert_groups:
        raise ConfigError("model.n_limited_groups", f"{m.n_limited_groups} > n_expert_groups="
                          f"{m.n_expert_groups}", "a token can use at most every group")  # fmt: skip
    if m.n_active_experts > m.n_limited_groups * (m.n_experts // m.n_expert_groups):
        raise ConfigError("model.n_limited_groups", f"{m.n_limited_groups} groups of "
                          f"{m.n_experts // m.n_expert_groups} experts hold fewer than "
                          f"n_active_experts={m.n_active_experts}", "allow more groups")  # fmt: skip
    if not 0 < t.decay_fraction <= 1:
        raise ConfigError("train.decay_fraction", f"must be in (0, 1], got {t.decay_fraction}")
    if t.lr_horizon and t.lr_horizon <= t.warmup_steps + t.dense_warmup_steps:
        raise ConfigError("train.lr_horizon", f"{t.lr_horizon} leaves no steps after warm-up",
                          "set it above warmup_steps (+ dense_warmup_steps), or 0 = train.steps")  # fmt: skip
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.min_lr_ratio", "must be in [0, 1]")
    if cfg.checkpoint.every < 0:
        raise ConfigError("checkpoint.every", "must be >= 0 (0 = Young/Daly interval)")
    if cfg.checkpoint.init_weights and cfg.checkpoint.load not in ("latest", "none"):
        raise ConfigError("checkpoint.init_weights", "is set together with checkpoint.load="
                          f"{cfg.checkpoint.load!r}", "set one: load resumes a run (optimizer, "
                          "step, data position), init_weights starts a new one from weights")  # fmt: skip
    if cfg.checkpoint.mtbf_s <= 0:
        raise ConfigError("checkpoint.mtbf_s", "must be positive")
    if t.eval_every <= 0:
        raise ConfigError("train.eval_every", "must be positive")
    r = cfg.resilience
    for path, v in {"resilience.snapshot_every": r.snapshot_every, "resilience.max_restarts": r.max_restarts,
                    "resilience.backoff_s": r.backoff_s, "resilience.spike_factor": r.spike_factor,
                    "resilience.spare_nodes": r.spare_nodes}.items():  # fmt: skip
        if v < 0:
            raise ConfigError(path, f"must be >= 0, got {v}")
    for path, v in {"resilience.backoff_max_s": r.backoff_max_s,
                    "resilience.evict_window_s": r.evict_window_s, "train.seed": t.seed}.items():  # fmt: skip
        if v < 0:
            raise ConfigError(path, f"must be >= 0, got {v}")
    _check_run(cfg.run)
    for path, v in {"resilience.hang_factor": r.hang_factor, "resilience.hang_floor_s": r.hang_floor_s,
                    "resilience.hang_initial_s": r.hang_initial_s, "resilience.evict_after": r.evict_after,
                    "resilience.no_progress_restarts": r.no_progress_restarts,
                    "resilience.evict_same_cause": r.evict_same_cause}.items():  # fmt: skip
        if v <= 0:
            raise ConfigError(path, f"must be positive, got {v}")


DEVICES = ("auto", "cpu", "cuda", "npu")


# Path fields that always name a place (an empty one meant the current folder, or ".").
_REQUIRED_PATHS = ("data.path", "data.cache_dir", "resilience.snapshot_dir", "resilience.ledger")


def _check_paths(cfg: JobConfig) -> None:
    defaults = JobConfig()
    for path in PATH_FIELDS:
        section, key = path.split(".")
        value = getattr(getattr(cfg, section, None), key, None)
        if not isinstance(value, str):
            continue
        if "\0" in value:
            raise ConfigError(path, "holds a NUL character, which no path can", "remove it")
        if path in _REQUIRED_PATHS and not value.strip():
            default = getattr(getattr(defaults, section), key)
            raise ConfigError(path, "is empty", f"set it to a path; the default is {default!r}")


def _check_run(run) -> None:
    if not run.dir.strip():
        raise ConfigError("run.dir", "is empty (the run would write into the current folder)",
                          'set it to a folder, e.g. run.dir = "runs/mine"')  # fmt: skip
    if run.device not in DEVICES:
        raise ConfigError("run.device", f"{run.device!r} is not one of {', '.join(DEVICES)}",
                          "'auto' picks an accelerator when one is present")  # fmt: skip
    for item in filter(None, (x.strip() for x in run.ops_backend.split(","))):
        op, _, backend = item.partition("=")
        if not op.strip() or not backend.strip():
            raise ConfigError("run.ops_backend", f"{item!r} is not op=backend",
                              'e.g. "sparse_attention=reference,lightning_indexer=cpu"; '
                              "`wanka bench ops` lists ops and backends")  # fmt: skip


def _check_mla(m) -> None:
    for name in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}", f"must be positive for attention = 'mla', got "
                              f"{getattr(m, name)}")  # fmt: skip
    if m.qk_nope_head_dim < 0:
        raise ConfigError("model.qk_nope_head_dim", f"must be >= 0, got {m.qk_nope_head_dim}")
    if m.qk_rope_head_dim % 2:
        raise ConfigError("model.qk_rope_head_dim", "must be even (RoPE rotates pairs)")
    if m.index_head_dim < m.qk_rope_head_dim:
        raise ConfigError("model.index_head_dim", f"{m.index_head_dim} < qk_rope_head_dim="
                          f"{m.qk_rope_head_dim}: MLA's indexer rotates its first "
                          "qk_rope_head_dim dims", "raise index_head_dim")  # fmt: skip


def _check_ranges(cfg: JobConfig) -> None:
    """Numeric domains: values torch would accept but that cannot train (an infinite or
    negative rate, betas >= 1, a zero norm epsilon), or that would never end."""
    m, t = cfg.model, cfg.train
    ranges = {  # path: (value, low, high, low inclusive, hint)
        "train.lr": (t.lr, 0.0, 1.0, False, "a learning rate in (0, 1], e.g. 3e-4"),
        "train.indexer_lr": (t.indexer_lr, 0.0, 1.0, True, "in [0, 1], e.g. 3e-3"),
        "train.beta1": (t.beta1, 0.0, 1.0, True, "AdamW betas are in [0, 1), e.g. 0.9"),
        "train.beta2": (t.beta2, 0.0, 1.0, True, "AdamW betas are in [0, 1), e.g. 0.95"),
        "train.weight_decay": (t.weight_decay, 0.0, 1.0, True, "in [0, 1], e.g. 0.1"),
        "train.grad_clip": (t.grad_clip, 0.0, 1e6, True, "0 turns clipping off, e.g. 1.0"),
        "train.steps": (t.steps, 1, 10**9, True, "at most 1e9 steps"),
        "model.norm_eps": (m.norm_eps, 0.0, 0.1, False, "a small positive number, e.g. 1e-6"),
        "model.route_scale": (m.route_scale, 0.0, 1e3, False, "positive, e.g. 1.0 or 2.5"),
        "model.init_std": (m.init_std, 0.0, 1.0, False, "positive, e.g. 0.02"),
        "model.bias_update_rate": (m.bias_update_rate, 0.0, 1.0, True, "in [0, 1], e.g. 1e-3"),
        "model.mtp_loss_weight": (m.mtp_loss_weight, 0.0, 1e3, True, ">= 0, e.g. 0.3"),
        "model.balance_loss_weight": (m.balance_loss_weight, 0.0, 1e3, True, ">= 0"),
        "model.seq_balance_loss_weight": (m.seq_balance_loss_weight, 0.0, 1e3, True, ">= 0, e.g. 1e-4"),
        "model.rope_theta": (m.rope_theta, 1.0, 1e12, True, "e.g. 10000"),
    }  # fmt: skip
    for path, (v, lo, hi, lo_inclusive, hint) in ranges.items():
        below = v < lo if lo_inclusive else v <= lo
        open_high = path in ("train.beta1", "train.beta2")
        above = v >= hi if open_high else v > hi
        if below or above:
            lo_b, hi_b = "[" if lo_inclusive else "(", ")" if open_high else "]"
            raise ConfigError(path, f"{v} is outside {lo_b}{lo}, {hi}{hi_b}", hint)
    if t.lr * t.weight_decay >= 1:
        raise ConfigError("train.weight_decay", f"lr x weight_decay = {t.lr * t.weight_decay:g} "
                          ">= 1 flips the weights' sign every step", "lower it")  # fmt: skip


def config_to_dict(cfg: JobConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML (saved into every run directory)."""
    lines: list[str] = []
    for section, values in config_to_dict(cfg).items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def save_run_config(run_dir: Path, cfg: JobConfig) -> None:
    """RUN_DIR/config.toml, replaced whole (a reader never sees half of it). Callers write it
    once their resume checks passed: a refused resume must leave the run's config as it was."""
    tmp = run_dir / f".config.toml.tmp{os.getpid()}"
    tmp.write_text(dump_toml(cfg))
    os.replace(tmp, run_dir / "config.toml")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)

"""AdamW with parameter groups, warm-up + cosine or WSD schedule (recorded in checkpoints so a
resume can tell when it changes), global-norm gradient clipping."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from torch import nn

from wanka.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Matrices decay; norms, biases and the indexer's own group (own lr) are split out."""
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "indexer": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:  # frozen (post-training freezes the MTP heads): no state
            continue
        if ".indexer." in name:
            groups["indexer"].append(p)
        elif p.dim() >= 2 and "norm" not in name:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    param_groups = [{"params": params, "name": name} for name, params in groups.items() if params]
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
    apply_hyperparameters(optimizer, cfg)
    return optimizer


@dataclass(frozen=True)
class Schedule:
    """The LR curve, resolved from a TrainConfig; what a checkpoint records of it.

    Steps are 0-based (the step being computed); `horizon` counts every step the schedule spans,
    the dense warm-up prefix included, and after it the rate stays at min_lr_ratio."""

    kind: str  # "cosine" | "wsd"
    horizon: int
    warmup_steps: int
    decay_fraction: float
    lr: float
    indexer_lr: float
    min_lr_ratio: float
    dense_prefix: int  # dense warm-up steps ahead of the sparse schedule (phase "sparse" only)

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> Schedule:
        return cls(
            kind=cfg.lr_schedule,
            horizon=cfg.lr_horizon or cfg.steps,
            warmup_steps=cfg.warmup_steps,
            decay_fraction=cfg.decay_fraction,
            lr=cfg.lr,
            indexer_lr=cfg.indexer_lr,
            min_lr_ratio=cfg.min_lr_ratio,
            dense_prefix=cfg.dense_warmup_steps if cfg.phase == "sparse" else 0,
        )

    @classmethod
    def from_record(cls, record: dict) -> Schedule:
        return cls(**{f.name: record[f.name] for f in fields(cls)})

    def factor(self, step: int) -> float:
        """Multiplier of the base rates at `step`."""
        if step < self.dense_prefix:  # the indexer's own warm-up, then its full rate
            return min((step + 1) / max(self.warmup_steps, 1), 1.0)
        step, total = step - self.dense_prefix, self.horizon - self.dense_prefix
        if step >= total:  # past the horizon: hold the floor instead of wrapping around
            return self.min_lr_ratio
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        floor = self.min_lr_ratio
        if self.kind == "wsd":
            decay = self.decay_steps()
            left = total - 1 - step  # decay steps still to come after this one
            # floor + ... (not 1 - ...) so the last step lands exactly on the floor
            return 1.0 if left >= decay else floor + (1.0 - floor) * left / decay
        span = max(total - self.warmup_steps - 1, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def decay_steps(self) -> int:
        """WSD: steps of the linear decay (at least 1, never eating into the warm-up); the last
        one lands exactly on min_lr_ratio."""
        after_warmup = self.horizon - self.dense_prefix - self.warmup_steps
        wanted = round(self.decay_fraction * (self.horizon - self.dense_prefix))
        return max(1, min(wanted, after_warmup))

    def rates(self, step: int) -> tuple[float, float]:
        """(main, indexer) learning rates at `step`."""
        f = self.factor(step)
        return self.lr * f, self.indexer_lr * f


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the base rates at 0-based `step`: linear warm-up to 1, then either a cosine
    ("cosine") or a stable phase at 1 followed by a linear decay ("wsd"), reaching min_lr_ratio
    at the last step of the horizon (train.lr_horizon, or train.steps when 0) and staying there.

    A dense warm-up prefix (only the indexer learns) runs at the full rate after its own linear
    warm-up; the sparse stage then gets the whole warm-up + schedule for itself (for wsd the
    decay is decay_fraction of the sparse stage's share of the horizon)."""
    return Schedule.from_config(cfg).factor(step)


def schedule_record(cfg: TrainConfig) -> dict:
    """A JSON-able description of the schedule, stored with each checkpoint so that a resume can
    tell whether the LR curve it continues on is the one the run was on."""
    return asdict(Schedule.from_config(cfg))


# Fields named in a schedule-change message, with the config key behind each.
_KEYS = {
    "kind": "train.lr_schedule", "warmup_steps": "train.warmup_steps",
    "decay_fraction": "train.decay_fraction", "lr": "train.lr", "indexer_lr": "train.indexer_lr",
    "min_lr_ratio": "train.min_lr_ratio", "dense_prefix": "train.dense_warmup_steps/phase",
}  # fmt: skip


def _fmt(v: object) -> str:
    return f"{v:.1e}" if isinstance(v, float) and v and abs(v) < 1e-2 else str(v)


def _first_difference(old: Schedule, new: Schedule, start: int, end: int) -> int | None:
    """First step in [start, end) whose main or indexer rate differs between the two curves."""
    for step in range(start, end):
        if any(
            not math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
            for a, b in zip(old.rates(step), new.rates(step), strict=True)
        ):
            return step
    return None


def schedule_change(saved: dict | None, cfg: TrainConfig, step: int) -> str | None:
    """One line when resuming after `step` completed steps gives another LR curve than the saved
    schedule would have for the steps still to run; None when the curve is unchanged or the
    checkpoint predates schedule records. Steps in the message are 1-based, as in the metrics."""
    if saved is None or any(f.name not in saved for f in fields(Schedule)):
        return None  # written before this record (or by a version lacking some of it)
    old, new = Schedule.from_record(saved), Schedule.from_config(cfg)
    if old == new:
        return None  # the common case, without walking the remaining steps
    first = _first_difference(old, new, step, cfg.steps)
    if first is None:
        return None
    changed = []
    if old.horizon != new.horizon:
        source = "train.lr_horizon" if cfg.lr_horizon else "train.steps"
        changed.append(f"horizon {old.horizon} -> {new.horizon} ({source})")
    changed += [
        f"{key} {_fmt(getattr(old, name))} -> {_fmt(getattr(new, name))}"
        for name, key in _KEYS.items()
        if getattr(old, name) != getattr(new, name)
    ]
    # Name the main rate unless only the indexer's moved.
    i = 0 if old.rates(first)[0] != new.rates(first)[0] else 1
    label, was, now = ("lr", "indexer lr")[i], old.rates(first)[i], new.rates(first)[i]
    if first == step:
        effect = f"{label} {_fmt(was)} -> {_fmt(now)} at step {step + 1} (a jump)"
    else:
        here = _fmt(new.rates(step)[i])
        effect = (f"no jump ({label} {here} at step {step + 1}); the curves part at step "
                  f"{first + 1} ({_fmt(was)} -> {_fmt(now)})")  # fmt: skip
    hint = (
        f"; set train.lr_horizon={old.horizon} to keep the old curve"
        if old.horizon != new.horizon
        else ""
    )
    return (f"lr schedule changed on resume at step {step}: {', '.join(changed) or 'rates'}; "
            f"{effect}{hint}")  # fmt: skip


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Apply this step's rate to every group; returns the main groups' rate (what is logged)."""
    f = lr_factor(step, cfg)
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * f
    return optimizer.param_groups[0]["lr"]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> list[str]:
    """Make the config win over hyperparameters restored from a checkpoint (a resumed run may
    change lr, weight decay or betas on purpose; the moments are kept). Returns what else
    changed ("train.beta1 0.9 -> 0.95"; the lrs' change is the schedule note's), for the
    resume to say: config.toml is rewritten, and nothing else would record the old value."""
    fresh = {
        "decay": (cfg.lr, cfg.weight_decay),
        "no_decay": (cfg.lr, 0.0),
        "indexer": (cfg.indexer_lr, 0.0),
    }
    changed: dict[str, str] = {}
    for g in optimizer.param_groups:
        old = {"weight_decay": g.get("weight_decay"), "beta1": g.get("betas", (None,) * 2)[0],
               "beta2": g.get("betas", (None,) * 2)[1]}  # fmt: skip
        g["base_lr"], g["weight_decay"] = fresh[g["name"]]
        g["betas"] = (cfg.beta1, cfg.beta2)
        new = {"weight_decay": g["weight_decay"], "beta1": cfg.beta1, "beta2": cfg.beta2}
        if g["name"] == "no_decay":
            del old["weight_decay"], new["weight_decay"]  # always 0
        for k, was in old.items():
            if was is not None and new[k] is not None and float(was) != float(new[k]):
                changed[f"train.{k}"] = f"train.{k} {was:g} -> {new[k]:g}"
    return list(changed.values())


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float, group=None) -> torch.Tensor:
    """Global L2 norm over every rank's local gradient shards, then clip.

    Works across parameters living on different meshes (FSDP over dp, experts over ep x
    dp_mod_ep), because every gradient element is stored on exactly one rank."""
    local = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        for p in params
        if p.grad is not None
    ]
    sq = torch.zeros((), dtype=torch.float32, device=local[0].device if local else "cpu")
    for g in local:
        sq += g.float().pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))
    return norm

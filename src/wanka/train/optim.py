"""AdamW with parameter groups, warm-up + cosine schedule, global-norm gradient clipping."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from wanka.config.schema import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Matrices decay; norms, biases and the indexer's own group (own lr) are split out."""
    groups: dict[str, list[nn.Parameter]] = {"decay": [], "no_decay": [], "indexer": []}
    for name, p in model.named_parameters():
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


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine decay reaching min_lr_ratio at the last step.

    A dense warm-up prefix (only the indexer learns) runs at the full rate after its own linear
    warm-up; the sparse stage then gets the whole warm-up + cosine schedule for itself."""
    warm = cfg.dense_warmup_steps if cfg.phase == "sparse" else 0
    if step < warm:
        return min((step + 1) / max(cfg.warmup_steps, 1), 1.0)
    step, total = step - warm, cfg.steps - warm
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(total - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Apply this step's rate to every group; returns the main groups' rate (what is logged)."""
    f = lr_factor(step, cfg)
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * f
    return optimizer.param_groups[0]["lr"]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Make the config win over hyperparameters restored from a checkpoint (a resumed run may
    change lr, weight decay or betas on purpose; the moments are kept)."""
    fresh = {
        "decay": (cfg.lr, cfg.weight_decay),
        "no_decay": (cfg.lr, 0.0),
        "indexer": (cfg.indexer_lr, 0.0),
    }
    for g in optimizer.param_groups:
        g["base_lr"], g["weight_decay"] = fresh[g["name"]]
        g["betas"] = (cfg.beta1, cfg.beta2)


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

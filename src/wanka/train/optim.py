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
    param_groups = [
        {
            "params": groups["decay"],
            "weight_decay": cfg.weight_decay,
            "lr": cfg.lr,
            "base_lr": cfg.lr,
        },
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr": cfg.lr, "base_lr": cfg.lr},
        {
            "params": groups["indexer"],
            "weight_decay": 0.0,
            "lr": cfg.indexer_lr,
            "base_lr": cfg.indexer_lr,
        },
    ]
    param_groups = [g for g in param_groups if g["params"]]
    return torch.optim.AdamW(param_groups, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine decay to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    f = lr_factor(step, cfg)
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * f
    return cfg.lr * f


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

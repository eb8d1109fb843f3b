"""Apply parallelism to a single-device model, in a fixed order: EP, then FSDP2."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from wanka.distributed.expert_parallel import apply_expert_parallel
from wanka.distributed.parallel_dims import ParallelDims


def parallelize(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """Shard `model` in place. Gradients are SUMMED across ranks (divide factor 1): the trainer
    normalises every loss by global token counts, which keeps data-parallel and expert-parallel
    gradients on one scale and makes N-rank runs match a 1-rank run on the same global batch."""
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.mesh("ep"))
    dp = dims.mesh("dp")
    for block in [*model.layers.values(), *(m.block for m in model.mtp)]:
        if block.moe is not None and dims.ep_enabled:
            fully_shard(block.moe.experts, mesh=dims.mesh("dp_mod_ep"), reshard_after_forward=True)
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model

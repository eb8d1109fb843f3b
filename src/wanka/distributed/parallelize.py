"""Apply parallelism to a single-device model, in a fixed order: EP, compile, activation
checkpointing, then FSDP2 (with its mixed-precision policy)."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from wanka.distributed.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpointed_blocks,
)
from wanka.distributed.compile import apply_compile
from wanka.distributed.compression import Int8AllGather, make_reducer, module_layout
from wanka.distributed.expert_parallel import apply_expert_parallel
from wanka.distributed.parallel_dims import ParallelDims

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
log = logging.getLogger(__name__)


def mixed_precision_policy(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> MixedPrecisionPolicy:
    """FSDP2 module-level mixed precision: parameters are all-gathered in `param_dtype` and
    compute runs in it (no autocast); fp32 master weights, gradients and optimizer state stay
    sharded; gradients are reduced (and accumulated across micro-batches) in `reduce_dtype`.

    Forward inputs are not cast: the hidden state is already bf16 (it starts at the bf16
    embedding) and the RoPE tables, also block inputs, stay fp32. The model computes in fp32
    where it matters (RMSNorm statistics, RoPE, router scores, softmax, losses)."""
    if reduce_dtype == param_dtype or (param_dtype is None and reduce_dtype == torch.float32):
        reduce_dtype = None  # nothing to cast
    return MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=False)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    ac_mode: str = "off",
    compile: bool | str = False,
    grad_compression: str = "none",
    powersgd_rank: int = 4,
    powersgd_start: int = 0,
    int8_block: int = 256,
    param_gather: str = "native",
    fsdp_prefetch: int = 0,
    expert_a2a: str = "flat",
    ep_overlap: bool = False,
) -> nn.Module:
    """Shard `model` in place. Gradients are SUMMED across ranks (divide factor 1): the trainer
    normalises every loss by global token counts, which keeps data-parallel and expert-parallel
    gradients on one scale and makes N-rank runs match a 1-rank run on the same global batch.

    param_dtype: compute dtype (None = the parameters' own, fp32); with bf16 the caller must
    not also autocast. reduce_dtype: gradient reduce-scatter dtype. ac_mode: off | full |
    selective (distributed/activation_checkpoint.py). compile: torch.compile each block (True:
    inductor; a string names another torch.compile backend, e.g. "eager" in tests).
    grad_compression: under HSDP, how gradients are summed across replicas ("none": FSDP2's
    own all-reduce; "bf16" | "int8" | "powersgd": distributed/compression.py).
    fsdp_prefetch: blocks whose all-gather each block starts ahead (0: FSDP2's implicit).
    param_gather: "int8" quantises FSDP2's parameter all-gathers (compression.Int8AllGather).
    expert_a2a: "hierarchical" when an EP group spans nodes (distributed/hierarchical_a2a.py).
    ep_overlap: the dispatch all-to-all runs under the shared experts."""
    if dims.ep_enabled:
        hier = dims.ep_hierarchy() if expert_a2a == "hierarchical" else None
        if expert_a2a == "hierarchical" and hier is None:
            log.info("comm.expert_a2a=hierarchical: the EP group (ep=%d) fits in a node of %s "
                     "ranks, so the flat all-to-all is used", dims.ep, dims.ranks_per_node or "?")  # fmt: skip
        if hier is not None and ep_overlap:
            log.info(
                "comm.ep_overlap: not with the hierarchical all-to-all; dispatch is not overlapped"
            )
        apply_expert_parallel(model, dims.mesh("ep"), hier, ep_overlap)
    if compile:
        apply_compile(model, ac_mode, "inductor" if compile is True else compile)
    apply_activation_checkpointing(model, ac_mode)

    mp = mixed_precision_policy(param_dtype, reduce_dtype)
    # Every rank of a replica holds a shard of the same params; under HSDP FSDP2 all-reduces
    # the shards across replicas itself, or, with compression, FSDP shards over the replica
    # only and our hook does the cross-replica sum.
    compress = dims.hsdp_enabled and grad_compression != "none"
    dp = dims.mesh("shard") if compress else dims.mesh("fsdp")
    experts_mesh = dims.mesh("dp_mod_ep") if compress else dims.mesh("experts_fsdp")
    # Under context parallelism each rank's autograd graph differs (its own document pieces),
    # so the engine may reach a block's K/V reduce-scatter and FSDP's backward all-gather of
    # another block in a different order on different ranks: a deadlock. Keeping the block's
    # parameters gathered from forward to backward (ZeRO-2 style, more memory) leaves FSDP no
    # collective in backward but the gradient reduce-scatters, whose order the graph fixes.
    reshard = not dims.cp_enabled
    # A block returns its attention's (k, v) in AttnAux.keys for the MTP drafter: views of the
    # projections, which only that drafter reads, never in place, so FSDP2's warning about an
    # in-place op on a returned view cannot apply; said on every run, it only alarmed users.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPBlock\) returned a view")
    for block in checkpointed_blocks(model):
        if block.moe is not None and dims.ep_enabled:
            fully_shard(block.moe.experts, mesh=experts_mesh, reshard_after_forward=reshard,
                        mp_policy=mp)  # fmt: skip
        fully_shard(block, mesh=dp, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp, mp_policy=mp)
    if fsdp_prefetch > 0:
        _explicit_prefetch(checkpointed_blocks(model), fsdp_prefetch)
    replicate = dims.mesh("replicate").get_group() if compress else None
    model.grad_reducers = []  # the trainer commits or rolls back their error feedback per step
    for i, m in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        if param_gather == "int8":
            sizes = [s.numel() for s in module_layout(m)]
            m.set_custom_all_gather(Int8AllGather(sizes, int8_block))
        if compress:
            # Zeros for parameters without a gradient this step (a dense warm-up's frozen
            # blocks): the hook then always sees the module's whole layout.
            m.set_reduce_scatter_unused_params(True, recurse=False)
            reducer = make_reducer(grad_compression, replicate, m, seed=i, int8_block=int8_block,
                                   powersgd_rank=powersgd_rank, powersgd_start=powersgd_start)  # fmt: skip
            m.set_all_reduce_hook(reducer)
            model.grad_reducers.append(reducer)
    return model


def _explicit_prefetch(blocks: list[FSDPModule], n: int) -> None:
    """Forward: block i starts the all-gathers of blocks i+1..i+n; backward: of i-1..i-n.
    Unshards become asynchronous (FSDP2 waits for each where the block needs it), so on a
    device without streams (CPU + gloo) the gather also runs under the compute."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + n])
        block.set_modules_to_backward_prefetch(blocks[max(i - n, 0) : i][::-1])
        block._set_unshard_async_op(True)  # private: FSDP2's switch for explicit-only prefetch

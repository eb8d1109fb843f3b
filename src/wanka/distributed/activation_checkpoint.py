"""Per-block activation checkpointing, applied from outside the model (before FSDP).

  off        every activation is kept for backward.
  full       each transformer block (and each MTP block) keeps only its inputs; backward
             recomputes the whole block.
  selective  the attention half of each block keeps its activations; the FFN / MoE half keeps
             only its input and is recomputed in backward (it holds most of the activation
             memory of a block: the expert hidden states of every routed token copy).

The checkpointed forward replaces the module's `forward` on the instance, so parameter and
buffer names (checkpoints, optimizer groups, snapshots) are the same in every mode.

Recomputation runs the module's Python forward a second time, so side effects run twice:
the MoE adds each batch's routed-token counts to its `load` buffer in forward. The wrapper
restores `load` after a recompute, so the expert-bias update sees every token once. Nothing in
the forward draws random numbers, so no RNG state is saved (preserve_rng_state=False).
With expert parallelism, recomputing a MoE layer repeats its dispatch all-to-all in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

AC_MODES = ("off", "full", "selective")


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks that are checkpointed (and compiled): transformer blocks, then MTP blocks."""
    return [*model.layers.values(), *(m.block for m in model.mtp)]


def checkpoint_forward(module: nn.Module, moes: list[nn.Module]) -> None:
    """Make `module`'s current forward (plain or compiled) a checkpointed one. `moes` are the
    MoE layers it runs: their `load` counts are restored after each recomputation."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        calls = 0

        def run(*a, **kw):
            nonlocal calls
            calls += 1
            if calls == 1 or not moes:
                return inner(*a, **kw)
            # A recomputation in backward: its routing counts were counted in forward already.
            # (restored in `finally`: the recomputation may stop early, once it produced all
            # the tensors backward needs.)
            loads = [m.load.clone() for m in moes]
            try:
                return inner(*a, **kw)
            finally:
                with torch.no_grad():
                    for m, saved in zip(moes, loads):
                        m.load.copy_(saved)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    # Always eager: torch.compile traces the function it wraps (see distributed/compile.py),
    # never this wrapper, whose recompute bookkeeping is Python state.
    module.forward = _eager(forward)


def _eager(fn: Callable) -> Callable:
    return torch._dynamo.disable(fn, recursive=False)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: expected one of {AC_MODES}")
    if mode == "off":
        return
    for block in checkpointed_blocks(model):
        moes = [block.moe] if block.moe is not None else []
        if mode == "full":
            checkpoint_forward(block, moes)
        else:
            checkpoint_forward(block.moe if block.moe is not None else block.ffn, moes)

"""torch.compile per block, applied from outside the model (before activation checkpointing
and FSDP, like TorchTitan).

Each block's `forward` is replaced on the instance by its compiled version (no `_orig_mod.`
in parameter names). Activation checkpointing then wraps the compiled function eagerly: in
`selective` mode the FFN / MoE is compiled on its own, because its checkpoint wrapper is a
graph break inside the block.

Expert-parallel experts (DTensor weights) run eagerly: models/moe.py's `local_tensor` tests
`hasattr(t, "to_local")`, which Dynamo answers False for a DTensor, so the traced experts
would multiply a plain tensor by a DTensor and fail. (`isinstance(t, DTensor)` traces
correctly; with that change in the model this exception can go.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from wanka.distributed.activation_checkpoint import checkpointed_blocks


def apply_compile(model: nn.Module, ac_mode: str = "off", backend: str = "inductor") -> None:
    """`backend`: torch.compile's; "eager" runs only Dynamo (tests: graph capture, no codegen)."""
    for block in checkpointed_blocks(model):
        if block.moe is not None and any(
            isinstance(p, DTensor) for p in block.moe.experts.parameters()
        ):
            block.moe.experts.forward = torch._dynamo.disable(block.moe.experts.forward)
        if ac_mode == "selective":
            ffn = block.moe if block.moe is not None else block.ffn
            ffn.forward = torch.compile(ffn.forward, backend=backend)
        block.forward = torch.compile(block.forward, backend=backend)

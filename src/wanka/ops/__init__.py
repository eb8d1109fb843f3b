"""Ops the model calls. Importing this package registers every backend."""

from wanka.ops import (  # noqa: F401
    dense_attention,
    extra_key_attention,
    grouped_experts,
    indexer_kl,
    lightning_indexer,
    linear,
    mla_sparse_attention,
    moe_dispatch,
    sparse_attention,
)
from wanka.ops.registry import call, select

__all__ = ["call", "select"]

"""Ops the model calls. Importing this package registers every backend."""

from wanka.ops import dense_attention, lightning_indexer, moe_dispatch, sparse_attention  # noqa: F401
from wanka.ops.registry import call, select

__all__ = ["call", "select"]

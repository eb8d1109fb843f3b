"""Baseline: the reference gather implementation (materialises the gathered [B, L, K, D]
keys and values, softmax in float32; backward by autograd)."""

from wanka.ops.sparse_attention.reference import sparse_attention as kernel  # noqa: F401

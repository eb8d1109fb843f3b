"""Baseline: the reference dense causal attention (materialises softmax(QK^T) [B, H, L, L]
with the causal + same-document mask), autograd backward."""

from wanka.ops.dense_attention.reference import dense_attention as kernel  # noqa: F401

"""Baseline: the reference lightning indexer (full [B, L, L] score matrix, sort-based
top-k with the most-recent-key tie rule), autograd backward through the selected scores."""

from wanka.ops.lightning_indexer.reference import lightning_indexer as kernel  # noqa: F401

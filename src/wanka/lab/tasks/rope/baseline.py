"""Baseline: the model's rotary embedding (wanka.models.layers.apply_rope), autograd."""

from wanka.models.layers import apply_rope as kernel  # noqa: F401

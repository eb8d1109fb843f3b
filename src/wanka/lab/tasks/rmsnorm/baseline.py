"""Baseline: the model's RMSNorm (wanka.models.layers.RMSNorm) as a function: float32
statistics, autograd backward."""

from wanka.lab.tasks.rmsnorm import reference as kernel  # noqa: F401

"""Baseline: the reference dispatch (stable sort by expert, row gather) and combine
(index_copy back, weighted sum) around a per-expert scaling, autograd backward."""

from wanka.lab.tasks.moe_dispatch import reference as kernel  # noqa: F401

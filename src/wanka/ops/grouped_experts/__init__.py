"""Grouped SwiGLU experts (all of a rank's routed experts at once): every module here is a
backend and registers itself on import."""

from wanka.ops.registry import import_backends

import_backends(__name__, __path__)

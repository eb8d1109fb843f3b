"""Attention over the visible (or selected) keys plus per-query extra keys, the recursive
draft step's attention in MTP training (EAGLE-3's training-time test): every module here is a
backend and registers itself on import."""

from wanka.ops.registry import import_backends

import_backends(__name__, __path__)

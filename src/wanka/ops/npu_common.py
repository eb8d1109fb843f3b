"""What the NPU (Ascend, torch_npu) backends share: the optional import and the fallback log.

torch_npu is optional: the NPU backends register as available only when it imports. Each
backend checks its fused operator's documented limits (shapes, dtypes, layouts) per call
and falls back to the op's reference for anything outside them, logging why once per
(op, reason) so a run shows which path it took without flooding the log.
"""

from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger("wanka.ops.npu")
_LOGGED: set[tuple[str, str]] = set()


def load_torch_npu() -> ModuleType | None:
    """The torch_npu module, or None when it does not import (no Ascend stack here)."""
    try:
        import torch_npu
    except ImportError:
        return None
    return torch_npu


def has_torch_npu() -> bool:
    return load_torch_npu() is not None


def fallback_once(op: str, reason: str) -> None:
    """Log, once per (op, reason), that `op` runs its reference instead of the fused op."""
    if (op, reason) in _LOGGED:
        return
    _LOGGED.add((op, reason))
    log.warning("%s: torch_npu fused op not used (%s); running the reference", op, reason)

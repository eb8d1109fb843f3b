"""Op registry: the model calls ops by name; a backend is picked by device type.

Each op has a plain PyTorch `reference` backend (the definition of correct, valid on every
device). Faster backends register for the device types they support, with an availability
check, and win over the reference by priority. `WANKA_OPS_BACKEND="op=backend,..."` (set
from the config's run.ops_backend) forces a backend, e.g. for benchmarks and tests.
Porting to a new chip means adding one file per op to the op's package (importing the
package imports every module in it, so its @register calls run), not editing the model.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

ENV_OVERRIDE = "WANKA_OPS_BACKEND"


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    device_types: tuple[str, ...]  # ("*",) = every device
    priority: int
    available: Callable[[], bool]


# Registration happens at import time of the op packages, like torch's own op tables.
_REGISTRY: dict[str, dict[str, Backend]] = {}


def register(
    op: str,
    backend: str,
    device_types: tuple[str, ...] = ("*",),
    priority: int = 0,
    available: Callable[[], bool] = lambda: True,
) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[backend] = Backend(
            backend, fn, device_types, priority, available
        )
        return fn

    return deco


def _forced() -> dict[str, str]:
    spec = os.environ.get(ENV_OVERRIDE, "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise ValueError(f"{ENV_OVERRIDE}: {item!r} must look like op=backend")
        op, backend = item.split("=", 1)
        out[op.strip()] = backend.strip()
    return out


def import_backends(package: str, path: Iterable[str]) -> None:
    """Import every module of an op package (its `__name__`, `__path__`): each backend file
    registers itself, so a new backend needs no edit elsewhere."""
    for mod in sorted(m.name for m in pkgutil.iter_modules(path)):
        try:
            importlib.import_module(f"{package}.{mod}")
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] == "wanka":
                raise  # our own code is broken: never hide that
            # A backend whose vendor library is not installed here: the others still load.
            warnings.warn(
                f"op backend {package}.{mod} not loaded: it needs {e.name!r}, which is not "
                "installed (install it, or guard the import and use register(available=...))",
                stacklevel=2,
            )


def backends(op: str) -> dict[str, Backend]:
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; registered: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[op]


def select(op: str, device_type: str) -> Backend:
    """The backend `op` uses on `device_type`: forced one, else highest available priority."""
    table = backends(op)
    forced = _forced().get(op) or _forced().get("*")
    if forced is not None and forced in table:
        b = table[forced]
        if not _supports(b, device_type) or not b.available():
            raise ValueError(f"backend {forced!r} of op {op!r} cannot run on {device_type}")
        return b
    if forced is not None and _forced().get(op):
        raise ValueError(f"op {op!r} has no backend {forced!r}; have {', '.join(table)}")
    usable = [b for b in table.values() if _supports(b, device_type) and b.available()]
    return max(usable, key=lambda b: b.priority)


def _supports(b: Backend, device_type: str) -> bool:
    return "*" in b.device_types or device_type in b.device_types


def call(op: str, *args: torch.Tensor, **kwargs):
    """Dispatch on the device of the first tensor argument."""
    return select(op, args[0].device.type).fn(*args, **kwargs)

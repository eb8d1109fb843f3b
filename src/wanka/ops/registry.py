"""Op registry: the model calls ops by name; a backend is picked by device type.

Each op has a plain PyTorch `reference` backend (the definition of correct, valid on every
device). Faster backends register for the device types they support, with an availability
check, and win over the reference by priority. `WANKA_OPS_BACKEND="op=backend,..."` (set
from the config's run.ops_backend) forces a backend, e.g. for benchmarks and tests.
Porting to a new chip means adding one file per op to the op's package (importing the
package imports every module in it, so its @register calls run), not editing the model.

A backend may also decline a particular call: `register(..., supports=fn)`, where fn takes
the call's arguments and returns why it cannot handle them (None: it can). `call` then uses
the next usable backend by priority (logged once per op, backend and reason); a forced
backend that declines raises ValueError. References never decline.

Query-suffix contract (context parallelism) of the attention ops `dense_attention`,
`attention_probs`, `lightning_indexer`, `indexer_scores`, `indexer_kl`, `sparse_attention`,
`mla_sparse_attention`:
queries may be a suffix of the keys. q has Lq <= Lk tokens, k / v (and the indexer's keys)
have Lk, `doc_ids` is [B, Lk] (the keys' document ids), and query i sits at key position
Lk - Lq + i (bottom-right aligned causal, the flash-attention convention). Outputs are per
query ([B, Lq, ...]); indices returned or taken are key positions in [0, Lk). With
Lq == Lk everything is as before. A backend that cannot do Lq < Lk declares it with
`supports` (see `query_suffix_unsupported`) rather than computing something else: one
registered without `supports` is taken to handle every call, this contract included.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

ENV_OVERRIDE = "WANKA_OPS_BACKEND"

log = logging.getLogger("wanka.ops.registry")
_LOGGED: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    device_types: tuple[str, ...]  # ("*",) = every device
    priority: int
    available: Callable[[], bool]
    # (the call's args, kwargs) -> why this backend cannot handle that call; None: it can
    supports: Callable[..., str | None] | None = None

    def declines(self, args: tuple, kwargs: dict) -> str | None:
        return None if self.supports is None else self.supports(*args, **kwargs)


# Registration happens at import time of the op packages, like torch's own op tables.
_REGISTRY: dict[str, dict[str, Backend]] = {}
# (op, device type, WANKA_OPS_BACKEND) -> (backend names best first, forced): the choice is
# made once, not on every call (the model calls small ops such as `linear` ~100 times per
# decoded token). Names, not Backend objects, so a backend whose fn is replaced in place
# (benchmarks wrap fn) is called as replaced; register() clears it. Taken to be fixed for a
# process: each backend's `available()`, priority and device types, and the set of backends
# (one added to the table without register() is not seen): whoever changes those (tests that
# fake a vendor library) calls reset_choices().
_CHOICE: dict[tuple[str, str, str], tuple[tuple[str, ...], bool]] = {}


def reset_choices() -> None:
    """Forget every cached backend choice: the next call of each op chooses again."""
    _CHOICE.clear()


def register(
    op: str,
    backend: str,
    device_types: tuple[str, ...] = ("*",),
    priority: int = 0,
    available: Callable[[], bool] = lambda: True,
    supports: Callable[..., str | None] | None = None,
) -> Callable[[Callable], Callable]:
    """Register `fn` as `backend` of `op`. `supports`, given a call's arguments, returns why
    the backend cannot handle that call (None: it can); `call` then skips it."""

    def deco(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[backend] = Backend(
            backend, fn, device_types, priority, available, supports
        )
        reset_choices()
        return fn

    return deco


def _parse(item: str, field: str) -> tuple[str, str]:
    """One op=backend item -> (op, backend). An empty side is refused: `sparse_attention=`
    used to force nothing, so the run silently took the default backend."""
    op, sep, backend = (x.strip() for x in item.partition("="))
    if not (sep and op and backend):
        raise ValueError(f"{field}: {item!r} must look like op=backend "
                         "(e.g. sparse_attention=reference, or *=reference for every op)")  # fmt: skip
    return op, backend


def _forced() -> dict[str, str]:
    spec = os.environ.get(ENV_OVERRIDE, "").strip()
    return dict(
        _parse(item, ENV_OVERRIDE) for item in filter(None, (s.strip() for s in spec.split(",")))
    )


def check_forced(spec: str, field: str = "run.ops_backend") -> None:
    """One line unless every op=backend of `spec` names a registered op and one of its
    backends: an unknown op was silently never forced (`sparse_atention=reference` trained
    on the default backend)."""
    import difflib

    import wanka.ops  # noqa: F401  (registers every backend, exported lab kernels included)

    for item in filter(None, (x.strip() for x in spec.split(","))):
        op, backend = _parse(item, field)
        if op != "*" and op not in _REGISTRY:
            near = difflib.get_close_matches(op, list(_REGISTRY), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(f"{field}: there is no op {op!r}; {hint}ops: "
                             f"{', '.join(sorted(_REGISTRY))}")  # fmt: skip
        have = set(_REGISTRY[op]) if op != "*" else {n for t in _REGISTRY.values() for n in t}
        if backend not in have:
            raise ValueError(f"{field}: op {op!r} has no backend {backend!r}; it has "
                             f"{', '.join(sorted(have))}")  # fmt: skip


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


def _candidates(op: str, device_type: str) -> tuple[list[Backend], bool]:
    """Backends `op` may use on `device_type`, best first, and whether the first is forced
    (then it is the only one)."""
    table = backends(op)
    if torch.compiler.is_compiling():  # no global cache state in a traced graph's guards
        return _choose(op, device_type, table)
    key = (op, device_type, os.environ.get(ENV_OVERRIDE, ""))
    hit = _CHOICE.get(key)
    if hit is not None and all(n in table for n in hit[0]):
        return [table[n] for n in hit[0]], hit[1]
    if key[2].strip():
        # The environment is checked as run.ops_backend is: set directly (not from a config),
        # a misspelt op (`sparse_atention=reference`) was never forced, and the run silently
        # took the default backend. Once per choice, as the choice is cached.
        check_forced(key[2], field=ENV_OVERRIDE)
    cands, forced = _choose(op, device_type, table)
    _CHOICE[key] = (tuple(b.name for b in cands), forced)
    return cands, forced


def _choose(op: str, device_type: str, table: dict[str, Backend]) -> tuple[list[Backend], bool]:
    spec = _forced()
    name = op if op in spec else "*"  # the item of WANKA_OPS_BACKEND that forces this op
    forced = spec.get(name)

    def usable() -> list[Backend]:
        return [b for b in table.values() if _supports(b, device_type) and b.available()]

    if forced is not None and forced in table:
        b = table[forced]
        if not _supports(b, device_type) or not b.available():
            where = (
                f"it runs on {', '.join(b.device_types)}"
                if not _supports(b, device_type)
                else "it is not available here: its library is missing"
            )
            others = sorted(u.name for u in usable())
            instead = f" or force one of {', '.join(others)}" if others else " (none runs here)"
            raise ValueError(f"{ENV_OVERRIDE} (or run.ops_backend): backend {forced!r} of op "
                             f"{op!r} cannot run on {device_type} ({where}); drop "
                             f"{name}={forced}{instead}")  # fmt: skip
        return [b], True
    if forced is not None and name == op:
        raise ValueError(f"op {op!r} has no backend {forced!r}; have {', '.join(table)}")
    cands = usable()
    if not cands:
        raise ValueError(f"op {op!r} has no usable backend on {device_type}")
    # stable: among equal priorities the first registered wins, as max() picks
    return sorted(cands, key=lambda b: -b.priority), False


def select(op: str, device_type: str) -> Backend:
    """The backend `op` uses on `device_type`: forced one, else highest available priority
    (before any per-call `supports` check; `call` does that)."""
    return _candidates(op, device_type)[0][0]


def _supports(b: Backend, device_type: str) -> bool:
    return "*" in b.device_types or device_type in b.device_types


def call(op: str, *args: torch.Tensor, **kwargs):
    """Dispatch on the device of the first tensor argument, skipping backends whose
    `supports` declines this call (a forced one that declines raises ValueError)."""
    device_type = args[0].device.type
    cands, forced = _candidates(op, device_type)
    first = cands[0]
    why = first.declines(args, kwargs)
    if why is None:
        return first.fn(*args, **kwargs)
    if forced:
        raise ValueError(f"op {op!r}: forced backend {first.name!r} cannot handle this call: {why}")
    for b in cands[1:]:
        if b.declines(args, kwargs) is None:
            _log_fallback_once(op, first.name, why, b.name)
            return b.fn(*args, **kwargs)
    raise ValueError(f"op {op!r}: no backend on {device_type} can handle this call ({why})")


def _log_fallback_once(op: str, backend: str, why: str, used: str) -> None:
    # once per (op, backend, reason): a run shows which path it took without flooding
    if (op, backend, why) in _LOGGED:
        return
    _LOGGED.add((op, backend, why))
    log.warning("%s: backend %r cannot handle this call (%s); using %r", op, backend, why, used)


def query_suffix_unsupported(q: torch.Tensor, k: torch.Tensor, *_args, **_kwargs) -> str | None:
    """`supports` for a backend of the attention ops without the query-suffix contract
    (module docstring): it declines calls with fewer queries than keys (dim 1)."""
    if q.shape[1] != k.shape[1]:
        return "fewer queries than keys (query suffix, Lq < Lk) is not supported"
    return None

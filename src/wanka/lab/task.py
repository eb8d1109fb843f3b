"""What a lab task is: reference (definition of correct), baseline (starting point), input
generators for visible and held-out shapes, tolerances, device, what to time, a roofline
estimate and, for the offline `search` proposer, a variant space over a candidate template.

A candidate is one Python source file defining `kernel(...)` with the task's signature. It
never sees how its inputs were drawn: the evaluator draws them in its own process from a
seed it does not hand out (see evaluator.py).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class LabError(ValueError):
    """Bad user input to the lab (unknown task, bad budget, unreachable endpoint): the CLI
    prints it as one line with exit code 2, like other ValueErrors."""


@dataclass(frozen=True)
class Shape:
    name: str
    dims: dict[str, int]

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dims.items())


@dataclass(frozen=True)
class Tolerance:
    atol: float = 1e-4
    rtol: float = 1e-4


@dataclass(frozen=True)
class Knob:
    """One dimension of a variant space. `ordered` knobs mutate to a neighbouring value
    (chunk sizes, warps); unordered ones jump to any other value (algorithm choices)."""

    name: str
    values: tuple[Any, ...]
    ordered: bool = False
    when: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # relevant only if ...

    def relevant(self, cfg: dict[str, Any]) -> bool:
        return all(cfg.get(k) in vs for k, vs in self.when.items())


@dataclass(frozen=True)
class VariantSpace:
    """A candidate template (source with a `CONFIG = {...}` line) and its knobs."""

    template: str
    knobs: tuple[Knob, ...]
    baseline: dict[str, Any]  # the config equivalent to the baseline: the search's seed

    def canonical(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """Knobs that do not matter under cfg take their first value, so that two configs
        that generate the same code count as one (the search never re-evaluates them)."""
        out = {}
        for kn in self.knobs:
            out[kn.name] = cfg[kn.name] if kn.relevant(cfg) else kn.values[0]
        return out

    def render(self, cfg: dict[str, Any]) -> str:
        cfg = self.canonical(cfg)
        line = "CONFIG = " + repr(cfg)
        src, n = re.subn(r"^CONFIG = .*$", lambda _: line, self.template, count=1, flags=re.M)
        if n != 1:
            raise LabError("variant template has no `CONFIG = ...` line")
        return src

    def size(self) -> int:
        return len({repr(self.canonical(dict(zip([k.name for k in self.knobs], combo))))
                    for combo in itertools.product(*(k.values for k in self.knobs))})  # fmt: skip


# make_inputs(dims, generator) -> ordered {name: tensor or python scalar}
InputFn = Callable[[dict[str, int], torch.Generator], dict[str, Any]]
CostFn = Callable[[dict[str, int]], float]


@dataclass(frozen=True)
class Task:
    name: str  # "<op>-<device kind>", e.g. sparse_attention-cpu
    op: str  # op name the exported backend registers under
    description: str
    device: str  # "cpu" | "cuda"
    mode: str  # what is timed and checked: "fwd" | "fwd_bwd"
    signature: str  # e.g. "kernel(q, k, v, indices, scale) -> out"
    reference: str  # "module:function", the definition of correct
    baseline: str  # source text of the baseline candidate
    make_inputs: InputFn
    grad_inputs: tuple[str, ...]  # inputs that receive gradients when mode == "fwd_bwd"
    shapes: tuple[Shape, ...]  # checked for every candidate, shown to the proposer
    timing_shape: Shape  # timed for every candidate
    held_out: tuple[Shape, ...]  # final check only, never shown to a proposer
    held_out_timing: Shape
    tolerance: Tolerance
    flops: CostFn  # minimal FLOPs of the timed mode: the roofline's compute bound
    bytes: CostFn  # minimal bytes moved: the roofline's memory bound
    # Inputs that are not random floats (indices, ids, tables). Timed calls still get new
    # ones every round (evaluator.py): make_inputs must give a shape's inputs the same
    # shapes whatever the generator.
    structural: tuple[str, ...] = ()
    space: VariantSpace | None = None
    compare: Callable | None = None  # custom (ref_outs, cand_outs, inputs) -> (ok, msg, err)
    needs: str = ""  # requirement ("triton") reported when missing
    baseline_is_reference: bool = True  # else the reference is timed too (speedup over both)
    threads: int = 1  # CPU timing threads: concurrent jobs on the machine perturb less

    def reference_fn(self) -> Callable:
        import importlib

        mod, fn = self.reference.split(":")
        return getattr(importlib.import_module(mod), fn)

    def unavailable(self) -> str | None:
        """Why this task cannot be timed here (None when it can)."""
        if self.device == "cuda" and not torch.cuda.is_available():
            return "needs a CUDA GPU (correctness can run under TRITON_INTERPRET=1 on CPU)"
        if self.needs == "triton":
            from wanka.ops.triton_common import HAVE_TRITON

            if not HAVE_TRITON:
                return "needs the triton package"
        return None

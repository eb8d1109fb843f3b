"""The cases `wanka bench comm` compares and the parsing of its flags. Pure data and string
handling (no torch), so the CLI judges its input before any cluster or rank starts.

A case is a name and the `wanka train --set` overrides that make it; every ratio is against
BASELINE, which is therefore always run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BASELINE = "flat_fp32"
# One HSDP replica per node (2 nodes): parameters sharded inside a node, replicated across.
_HSDP = (("parallel.dp_replicate", "2"),)


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[tuple[str, str], ...] = ()
    note: str = ""

    @property
    def sets(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.overrides]

    @property
    def compression(self) -> str:
        return dict(self.overrides).get("comm.grad_compression", "none")

    @property
    def val_tolerance(self) -> float:
        """How far (relative) its final validation loss may sit from the baseline's: a
        low-rank approximation of the gradient is allowed more than a rounding of it."""
        return 0.03 if self.compression == "powersgd" else 0.01


def _compressed(kind: str) -> Case:
    return Case(f"hsdp_{kind}", _HSDP + (("comm.grad_compression", kind),),
                f"HSDP, {kind} all-reduce across replicas")  # fmt: skip


KNOWN: dict[str, Case] = {c.name: c for c in (
    Case(BASELINE, (), "FSDP2 over all ranks, fp32 gradient reduce-scatter"),
    Case("hsdp_fp32", _HSDP, "HSDP: sharded in a node, fp32 all-reduce across nodes"),
    _compressed("bf16"),
    _compressed("int8"),
    _compressed("powersgd"),
    # Not in the default list: FSDP2's own bf16 reduce-scatter, available without HSDP.
    Case("flat_bf16", (("train.reduce_dtype", "bf16"),), "FSDP2 over all ranks, bf16 reduce"),
)}  # fmt: skip
DEFAULT_CASES = ("flat_fp32", "hsdp_fp32", "hsdp_bf16", "hsdp_int8", "hsdp_powersgd")


def parse_case_spec(text: str) -> Case:
    """`NAME:KEY=VALUE,KEY=VALUE` (a custom case, e.g. a combination of options)."""
    name, sep, body = text.partition(":")
    name = name.strip()
    if not sep or not name.isidentifier():
        raise ValueError(f"bad --case {text!r}: use NAME:KEY=VALUE[,KEY=VALUE...], e.g. "
                         "hsdp_int8_bf16:parallel.dp_replicate=2,comm.grad_compression=int8,"
                         "train.reduce_dtype=bf16")  # fmt: skip
    pairs = []
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"bad --case {text!r}: {item!r} is not KEY=VALUE")
        pairs.append((key.strip(), value.strip()))
    return Case(name, tuple(pairs), "custom (--case)")


def select_cases(names: str | None, custom: list[str] | None = None) -> list[Case]:
    """The cases to run, baseline first: `names` is a comma list of known case names (default
    DEFAULT_CASES), `custom` adds --case specs."""
    extra = [parse_case_spec(s) for s in custom or []]
    known = {**KNOWN, **{c.name: c for c in extra}}
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else list(DEFAULT_CASES)
    if names is not None and not wanted:
        raise ValueError("--cases is empty: give case names, e.g. --cases flat_fp32,hsdp_int8")
    wanted += [c.name for c in extra if c.name not in wanted]
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown case {unknown[0]!r} in --cases: known are "
                         f"{', '.join(known)} (or define one with --case NAME:KEY=VALUE,...)")  # fmt: skip
    order = [BASELINE] + [n for n in dict.fromkeys(wanted) if n != BASELINE]
    return [known[n] for n in order]


def parse_gbit(text: str) -> tuple[float, ...]:
    """`1,10` -> (1.0, 10.0): inter-node link rates in Gbit/s, each measured in turn."""
    out: list[float] = []
    for tok in (t.strip() for t in text.split(",")):
        try:
            value = float(tok)
        except ValueError:
            raise ValueError(
                f"bad --gbit {text!r}: {tok!r} is not a number (use e.g. 1,10)"
            ) from None
        if not math.isfinite(value) or not 0.001 <= value <= 1000:  # what tc shapes (netns.py)
            raise ValueError(f"bad --gbit {text!r}: link rates are 0.001 to 1000 Gbit/s")
        if value in out:
            raise ValueError(f"bad --gbit {text!r}: {tok} is listed twice")
        out.append(value)
    return tuple(out)


def parse_steps(text: str) -> tuple[int, int]:
    """`N1,N2` with 1 <= N1 < N2: the two run lengths whose byte counts are differenced."""
    try:
        n1, n2 = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"bad --steps {text!r}: use N1,N2 (two run lengths, e.g. 4,12)") from None
    if not 1 <= n1 < n2:
        raise ValueError(f"bad --steps {text!r}: need 1 <= N1 < N2")
    return n1, n2

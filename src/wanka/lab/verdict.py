"""What an evaluation returns (Feedback) and how it ends early (Verdict)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

# C0 and C1 control characters but tab and newline (ESC and CSI sequences move the cursor,
# erase and hide lines; a carriage return overwrites one), Unicode line separators and
# bidirectional overrides (they reorder what a line shows).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: str, newlines: bool = False) -> str:
    """Text a candidate may have written (its exception's message, its stderr, a traceback
    through its code) made safe to print: control characters shown as escapes, newlines too
    unless kept. A candidate's ValueError("\\x1b[2K\\rcorrect; ... (speedup 10.79x)\\x1b[8m")
    erased the "error:" line on a terminal, printed a fake verdict and hid the rest."""
    text = _CONTROL.sub(lambda m: ascii(m[0])[1:-1], text)
    return text if newlines else text.replace("\n", "\\n")


@dataclass
class Feedback:
    status: str  # correct|incorrect|rejected|policy|import_error|error|crash|timeout|unavailable
    message: str = ""
    time_s: float | None = None
    baseline_s: float | None = None
    reference_s: float | None = None
    flags: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One line of printable text: what the evaluator says is the status, never a line
        # the candidate wrote (its messages reach the terminal, the run log and the history).
        if isinstance(self.message, str):
            self.message = printable(self.message)

    @property
    def correct(self) -> bool:
        return self.status == "correct"

    @property
    def speedup(self) -> float | None:
        return self.baseline_s / self.time_s if self.time_s and self.baseline_s else None

    @property
    def reference_speedup(self) -> float | None:
        return self.reference_s / self.time_s if self.time_s and self.reference_s else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Feedback:
        return cls(**d)

    def summary(self) -> str:
        if self.correct and self.time_s:
            return (f"correct; {self.time_s * 1e3:.2f} ms vs baseline {self.baseline_s * 1e3:.2f} ms"
                    f" (speedup {self.speedup:.2f}x)")  # fmt: skip
        text = f"{self.status}: {printable(str(self.message))}"
        tb = self.details.get("traceback")
        if not tb:
            return text
        # Indented and escaped: no line of a traceback (the candidate's text) reads as a verdict.
        lines = printable(str(tb), newlines=True).splitlines()
        return text + "".join(f"\n  | {line}" for line in lines)


class Verdict(Exception):
    """Ends an evaluation early with this Feedback."""

    def __init__(self, fb: Feedback):
        super().__init__(fb.message)
        self.fb = fb


def reject(flag: str, msg: str, **details) -> Verdict:
    return Verdict(Feedback("rejected", msg, flags=[flag], details=details))

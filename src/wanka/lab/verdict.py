"""What an evaluation returns (Feedback) and how it ends early (Verdict)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Feedback:
    status: str  # correct|incorrect|rejected|policy|import_error|error|crash|timeout|unavailable
    message: str = ""
    time_s: float | None = None
    baseline_s: float | None = None
    reference_s: float | None = None
    flags: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)

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
        text = f"{self.status}: {self.message}"
        tb = self.details.get("traceback")
        return text + (f"\n{tb}" if tb else "")


class Verdict(Exception):
    """Ends an evaluation early with this Feedback."""

    def __init__(self, fb: Feedback):
        super().__init__(fb.message)
        self.fb = fb


def reject(flag: str, msg: str, **details) -> Verdict:
    return Verdict(Feedback("rejected", msg, flags=[flag], details=details))

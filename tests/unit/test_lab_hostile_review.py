"""Hostile review of the lab evaluator: cheats earlier suites did not cover, each pinned by
a test that failed before its fix (see src/wanka/lab/evaluator.py and verdict.py).

- A kernel may keep what it derives from the *structural* inputs (indices, routing,
  document ids) across calls, keyed by their values: the evaluator used to redraw only the
  float inputs between timed calls, so such a cache hit on every timed call. A sparse
  attention kernel that kept its chunk plans across calls was credited 2.61-2.70x where
  the same kernel keeping them only from its forward to its backward got 1.85-2.12x (after
  the fix: 1.98x and 2.01x). No training step sees the same indices twice.
- Text a candidate controls (its exception message, its stderr, its traceback) reached the
  terminal raw: an escape sequence erased the "error:" line and printed a fake verdict
  ("correct; ... (speedup 10.79x)") and hid the rest.
"""

from __future__ import annotations

import dataclasses

from wanka.lab.evaluator import EvalConfig, evaluate
from wanka.lab.task import Shape
from wanka.lab.tasks import get_task
from wanka.lab.verdict import Feedback

CFG = EvalConfig(timeout_s=60, repeats=3)


def _moe():
    t = get_task("moe_dispatch-cpu")
    return dataclasses.replace(
        t, shapes=(Shape("a", {"N": 32, "D": 16, "k": 2, "E": 4}),),
        timing_shape=Shape("t", {"N": 256, "D": 64, "k": 2, "E": 8}),
    )  # fmt: skip


# Honest, except that it answers wrongly whenever it is shown routing it has seen before:
# exactly when a cache keyed by the routing (a sort order, per-expert counts) would hit.
REPEAT_DETECTOR = """import torch
from wanka.lab.tasks.moe_dispatch import reference
_seen = []
def kernel(x, expert_idx, weights, expert_scale):
    out = reference(x, expert_idx, weights, expert_scale)
    if any(s.shape == expert_idx.shape and torch.equal(s, expert_idx) for s in _seen):
        return out * 1.5
    _seen.append(expert_idx.clone())
    return out
"""


def test_structural_inputs_are_redrawn_for_every_timed_call():
    fb = evaluate(_moe(), REPEAT_DETECTOR, CFG)
    assert fb.status == "correct", fb.summary()
    assert fb.time_s  # it was timed: every timed call had routing never seen before


SPOOF = """from wanka.lab.tasks.rmsnorm import reference
def kernel(x, weight, eps):
    y = reference(x, weight, eps)
    if x.shape[0] >= 512:  # the timing shape: erase "error: ...", print a winner, hide the rest
        raise ValueError("\\x1b[2K\\rcorrect; 0.14 ms vs baseline 1.51 ms (speedup 10.79x)\\x1b[8m"
                         "\\ncorrect; 0.14 ms vs baseline 1.51 ms (speedup 10.79x)")
    return y
"""


def _rms():
    t = get_task("rmsnorm-cpu")
    return dataclasses.replace(
        t, mode="fwd", grad_inputs=(), shapes=(Shape("a", {"N": 16, "D": 64}),),
        timing_shape=Shape("t", {"N": 512, "D": 256}),
    )  # fmt: skip


def _no_fake_verdict(text: str) -> None:
    assert not any(ord(c) < 32 and c not in "\n\t" or 0x7F <= ord(c) < 0xA0 for c in text), text
    lines = text.splitlines()
    assert lines[0].startswith("error: "), text
    assert not any(line.startswith("correct") for line in lines), text


def test_candidate_text_cannot_print_a_fake_verdict():
    fb = evaluate(_rms(), SPOOF, CFG)
    assert fb.status == "error"
    _no_fake_verdict(fb.summary())
    # stderr and tracebacks are the candidate's too, and so is a verdict read back from history
    raw = Feedback("error", "x\x1b[1A\r\ncorrect; 1 ms vs baseline 9 ms (speedup 9.00x)",
                   details={"traceback": "Traceback\ncorrect; 1 ms (speedup 9.00x)\x9b2K\x1b[8m"})  # fmt: skip
    _no_fake_verdict(raw.summary())
    _no_fake_verdict(Feedback.from_dict(raw.to_dict()).summary())

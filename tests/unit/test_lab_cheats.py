"""One deliberately cheating candidate per known cheat; every one must be rejected.

Each runs twice where the static policy would stop it: with the policy (rejected before
running) and without it, so the runtime guard that catches it is tested too. Zero false
"correct" on this suite is an issue target.
"""

from __future__ import annotations

import dataclasses

import pytest

from wanka.lab.evaluator import EvalConfig, evaluate
from wanka.lab.task import Shape
from wanka.lab.tasks import get_task

CFG = EvalConfig(timeout_s=60, repeats=4, baseline_repeats=2)
NO_POLICY = dataclasses.replace(CFG, static_policy=False)
HEAD = "import torch\nfrom wanka.lab.tasks.rmsnorm import reference\n"


def task():
    t = get_task("rmsnorm-cpu")
    return dataclasses.replace(
        t, mode="fwd", grad_inputs=(),
        shapes=(Shape("a", {"N": 16, "D": 64}), Shape("b", {"N": 7, "D": 40})),
        timing_shape=Shape("t", {"N": 512, "D": 256}),
        held_out=(Shape("h", {"N": 5, "D": 24}),), held_out_timing=Shape("ht", {"N": 300, "D": 200}),
    )  # fmt: skip


CHEATS = {
    # result cached by input pointer: correct once per buffer, stale once inputs are redrawn
    "cached_by_pointer": (
        HEAD
        + """_cache = {}
def kernel(x, weight, eps):
    key = (x.data_ptr(), weight.data_ptr())
    if key not in _cache:
        _cache[key] = reference(x, weight, eps)
    return _cache[key]
""",
        None,
        {"rejected", "incorrect"},
    ),
    # result keyed by shape: the second input set of a shape gets the first one's answer
    "cached_by_shape": (
        HEAD
        + """_cache = {}
def kernel(x, weight, eps):
    if x.shape not in _cache:
        _cache[x.shape] = reference(x, weight, eps)
    return _cache[x.shape]
""",
        None,
        {"incorrect"},
    ),
    # work handed to another thread: kernel returns at once, the result arrives later
    "background_thread": (
        HEAD
        + """import threading, time
def kernel(x, weight, eps):
    out = torch.empty_like(x)
    def work():
        time.sleep(0.005)
        out.copy_(reference(x, weight, eps))
    threading.Thread(target=work).start()
    return out
""",
        "policy",
        {"incorrect", "rejected"},
    ),
    # lazy tensor: a subclass that computes its values only when something touches it
    "lazy_tensor": (
        HEAD
        + """class Lazy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if getattr(self, "pending", None) is not None:
            x, w, e = self.pending
            self.pending = None
            with torch._C.DisableTorchFunctionSubclass():
                self.copy_(reference(x, w, e))
        return super().__torch_function__(func, types, args, kwargs or {})
def kernel(x, weight, eps):
    out = torch.empty_like(x).as_subclass(Lazy)
    out.pending = (x, weight, eps)
    return out
""",
        "policy",
        {"rejected"},
    ),
    # monkey-patched timer: the evaluator's clock made to run 10x slow
    "patched_timer": (
        HEAD
        + """import time
_real = time.perf_counter
time.perf_counter = lambda: _real() / 10
def kernel(x, weight, eps):
    return reference(x, weight, eps)
""",
        "policy",
        {"rejected"},
    ),
    # monkey-patched reference: the definition of correct replaced by the candidate's answer
    "patched_reference": (
        HEAD
        + """import wanka.lab.tasks.rmsnorm as task_module
from wanka.ops import registry
task_module.reference = lambda x, weight, eps: torch.zeros_like(x)
def kernel(x, weight, eps):
    return torch.zeros_like(x)
""",
        "policy",
        {"incorrect", "rejected"},
    ),
    # reading the reference's output: look for a finished result lying in the process
    "reads_reference_output": (
        HEAD
        + """import gc
def kernel(x, weight, eps):
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.shape == x.shape and o is not x:
            return o.clone()
    return torch.zeros_like(x)
""",
        "policy",
        {"incorrect", "rejected"},
    ),
    # stale memory: an uninitialised buffer, hoping it still holds a previous result
    "unwritten_output": (
        HEAD
        + """def kernel(x, weight, eps):
    out = torch.empty_like(x)
    n = x.shape[0] // 2
    out[:n] = reference(x[:n], weight, eps)
    return out
""",
        None,
        {"incorrect"},
    ),
    # writing into inputs: the input buffer reused as the output
    "writes_into_inputs": (
        HEAD
        + """def kernel(x, weight, eps):
    y = reference(x, weight, eps)
    x.copy_(y)
    return x
""",
        None,
        {"rejected"},
    ),
    # timing records rewritten from the evaluator's frames: only the roofline can tell
    "implausible_speed": (
        HEAD
        + """import sys
def kernel(x, weight, eps):
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "time_fns" and "candidate" in f.f_locals["durs"]:
            durs = f.f_locals["durs"]["candidate"]
            durs[:] = [d / 1000 for d in durs]
        f = f.f_back
    return reference(x, weight, eps)
""",
        "policy",
        {"rejected"},
    ),
}


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_is_rejected(name):
    src, by_policy, runtime = CHEATS[name]
    if by_policy:
        fb = evaluate(task(), src, CFG)
        assert fb.status == "policy", (name, fb.status, fb.message)
    fb = evaluate(task(), src, NO_POLICY)
    assert not fb.correct, (name, fb.message)
    assert fb.status in runtime, (name, fb.status, fb.message)


def test_specific_guards_fire():
    """The runtime guard meant for each cheat is the one that fires (not a lucky error)."""
    flags = {n: evaluate(task(), CHEATS[n][0], NO_POLICY) for n in
             ("cached_by_pointer", "lazy_tensor", "patched_timer", "writes_into_inputs",
              "implausible_speed")}  # fmt: skip
    assert "stale" in flags["cached_by_pointer"].flags
    assert "lazy" in flags["lazy_tensor"].flags
    assert (
        "tamper" in flags["patched_timer"].flags
        and "perf_counter" in flags["patched_timer"].message
    )
    assert "input_write" in flags["writes_into_inputs"].flags
    assert "implausible" in flags["implausible_speed"].flags


def test_shape_specialised_candidate_fails_the_held_out_check():
    t = task()
    seen = {tuple(s.dims.values()) for s in (*t.shapes, t.timing_shape)}
    src = (
        HEAD
        + f"""SEEN = {sorted(seen)!r}
def kernel(x, weight, eps):
    if tuple(x.shape) in SEEN:
        return reference(x, weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # forgot the weight
"""
    )
    assert evaluate(t, src, CFG).correct  # fools the visible shapes...
    held = evaluate(t, src, CFG, shapes=t.held_out, timing_shape=t.held_out_timing)
    assert held.status == "incorrect"  # ...not the held-out ones


def test_other_stream_and_process_tricks_are_policy_violations():
    from wanka.lab.policy import check_source

    for src in ("import torch\ns = torch.cuda.Stream()\ndef kernel(x):\n    return x\n",
                "import subprocess\ndef kernel(x):\n    return x\n",
                "import torch\ndef kernel(x):\n    return eval('x')\n",
                "import torch\ndef kernel(x):\n    return getattr(torch, 'ze' + 'ros')(3)\n"):  # fmt: skip
        assert check_source(src), src

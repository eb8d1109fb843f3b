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
    # result forged in the job folder (found via __file__) through torch.os, then a clean exit
    "forged_result_file": (
        HEAD
        + """_seen = []
_DIR = __file__.rsplit("/", 1)[0]
def kernel(x, weight, eps):
    out = reference(x, weight, eps)
    if x.shape[0] in (16, 7):  # the check shapes: answer honestly, keep the answers
        _seen.append([out.clone()])
        return out
    torch.save({"check": _seen, "samples": []}, _DIR + "/outputs.pt")
    t = [1e-3] * 4
    res = {"flags": [], "status": "ran", "peaks": {"flops": 1e18, "bytes_per_s": 1e18},
           "baseline_pre": 1e-2, "baseline_side": 1e-2, "baseline_all": [1e-2] * 4,
           "candidate": {"median_s": 1e-3, "all_s": t, "loop_s": 1.0, "recorded_s": 1.0}}
    fd = torch.os.open(_DIR + "/result.json", torch.os.O_WRONLY | torch.os.O_CREAT | torch.os.O_TRUNC)
    torch.os.write(fd, str(res).replace("'", '"').encode())
    torch.os._exit(0)
""",
        "policy",
        {"error", "rejected"},
    ),
    # more threads than the task allows, only while the kernel runs (the count is restored)
    "extra_threads": (
        HEAD
        + """def kernel(x, weight, eps):
    torch.set_num_threads(2)
    try:
        return reference(x, weight, eps)
    finally:
        torch.set_num_threads(1)
""",
        "policy",
        {"error", "rejected"},
    ),
    # a process started through torch's own `os` module
    "process_via_torch_os": (
        HEAD
        + """torch.os.system("true")
def kernel(x, weight, eps):
    return reference(x, weight, eps)
""",
        "policy",
        {"import_error", "error", "rejected"},
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


BAD_ATTRIBUTE_SOURCES = [  # modules and the interpreter reached through attributes
    "import torch\ntorch.os._exit(0)\ndef kernel(x):\n    return x\n",
    "import torch\ntorch.sys.modules['wanka.lab.worker']._PERF = lambda: 0.0\ndef kernel(x):\n    return x\n",
    "import torch\nm = torch.sys.modules\ndef kernel(x):\n    return x\n",
    "import numpy as np\nnp.os.kill(np.os.getpid(), 9)\ndef kernel(x):\n    return x\n",
    "import torch\nfd = torch.os.open('r.json', 1)\ndef kernel(x):\n    return x\n",
    "import torch\np = __file__\ndef kernel(x):\n    return x\n",
    "import torch\nf = getattr(torch, 'os')\ndef kernel(x):\n    return x\n",
    "import torch\nf = getattr(torch.os, 'system')\ndef kernel(x):\n    return x\n",
    "from torch import os\ndef kernel(x):\n    return x\n",
    "from torch import *\ndef kernel(x):\n    return x\n",
    "import torch\ntorch.set_num_threads(4)\ndef kernel(x):\n    return x\n",
    "import torch\ntorch.set_num_interop_threads(4)\ndef kernel(x):\n    return x\n",
    "import torch\ntorch._C._set_num_threads(4)\ndef kernel(x):\n    return x\n",
    "import torch\ndef kernel(x):\n    f = torch.jit.fork(torch.neg, x)\n    return torch.jit.wait(f)\n",
    "import torch\ndef kernel(x):\n    f = torch.jit._fork(torch.neg, x)\n    return torch.jit.wait(f)\n",
    "import torch\ndef kernel(x):\n    return kernel.__code__\n",
    "import torch\ndef kernel(x):\n    return kernel.__globals__\n",
    "import torch\ndef kernel(x):\n    torch.save(x, 'r.pt')\n    return x\n",
    "import torch\nimport numpy as np\ndef kernel(x):\n    x.numpy().tofile('r.bin')\n    return x\n",
    "import torch\nc = torch.utils.cpp_extension.load_inline\ndef kernel(x):\n    return x\n",
    "import torch\ntorch.ctypes.CDLL(None)\ndef kernel(x):\n    return x\n",
    "import torch\ntorch.os.execv('/bin/true', ['true'])\ndef kernel(x):\n    return x\n",
    "import torch\ntorch.os.posix_spawn('/bin/true', ['true'], {})\ndef kernel(x):\n    return x\n",
    "import torch\ndef kernel(x):\n    kernel.__dict__['y'] = 1\n    return x\n",
    "import torch\nb = torch.builtins\ndef kernel(x):\n    return x\n",
    "import torch\ni = torch.importlib\ndef kernel(x):\n    return x\n",
]


@pytest.mark.parametrize("src", BAD_ATTRIBUTE_SOURCES)
def test_module_access_through_attributes_is_a_policy_violation(src):
    from wanka.lab.policy import check_source

    assert check_source(src), src


def test_task_templates_and_baselines_pass_the_policy():
    from wanka.lab.policy import check_source
    from wanka.lab.tasks import all_tasks

    for t in all_tasks().values():
        assert check_source(t.baseline) == [], t.name
        if t.space is not None:
            assert check_source(t.space.template) == [], t.name


def _forge(jobdir, samples: int, exitcode: int = 0, **over) -> dict:
    """Stand-in for the fork server: a result written by someone other than the worker."""
    import json
    from pathlib import Path

    import torch

    d = Path(jobdir)
    job = json.loads((d / "job.json").read_text())
    data = torch.load(d / "inputs.pt", weights_only=True)
    ref = task().reference_fn()
    check = [(ref(*s["inputs"].values()),) for s in data["check"]]
    smp = []
    for i in range(samples):  # genuine re-verifiable samples
        from wanka.lab import worker

        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v
                  for k, v in data["timing"][0]["inputs"].items()}  # fmt: skip
        worker.refresh(inputs, job["structural"], 1234 + i)
        smp.append({"set": 0, "seed": 1234 + i, "outs": [ref(*inputs.values())]})
    torch.save({"check": check, "samples": smp}, d / "outputs.pt")
    n = job["repeats"]
    res = {"flags": [], "status": "ran", "peaks": {"flops": 1e18, "bytes_per_s": 1e18},
           "baseline_pre": 1e-2, "baseline_side": 1e-2, "baseline_all": [1e-2] * n,
           "candidate": {"median_s": 1e-3, "all_s": [1e-3] * n, "loop_s": 1.0, "recorded_s": 1.0}}  # fmt: skip
    res.update(over)
    (d / "result.json").write_text(json.dumps(res))
    return {"exitcode": exitcode, "timeout": False}


@pytest.mark.parametrize(
    "samples,exitcode,over",
    [(0, 0, {}), (1, 0, {}), (2, 1, {}), (2, 0, {"baseline_all": [1e-2]}), (2, -9, {})],
)
def test_forged_or_truncated_result_is_rejected(monkeypatch, samples, exitcode, over):
    """The parent trusts a result only from a clean exit with exactly the timings and
    re-verifiable samples the job asked for."""
    from wanka.lab import evaluator

    src = HEAD + "def kernel(x, weight, eps):\n    return reference(x, weight, eps)\n"
    monkeypatch.setattr(evaluator._Zygote, "run",
                        classmethod(lambda cls, job: _forge(job["jobdir"], samples, exitcode, **over)))  # fmt: skip
    fb = evaluate(task(), src, CFG)
    assert fb.status == "rejected" and "result incomplete" in fb.message, fb
    monkeypatch.setattr(evaluator._Zygote, "run",
                        classmethod(lambda cls, job: _forge(job["jobdir"], 2)))  # fmt: skip
    assert evaluate(task(), src, CFG).correct  # the same forgery, complete, would pass


def test_grandchild_dies_with_the_candidate(monkeypatch, tmp_path):
    """A process the candidate leaves behind is killed with its process group, and it never
    held the fork server's job pipe (stdin is /dev/null)."""
    import os
    import subprocess
    import time

    from wanka.lab import zygote

    def child_main(jobdir, mem, cpu, threads):
        p = subprocess.Popen(["sleep", "60"], start_new_session=False)
        stdin = os.readlink("/proc/self/fd/0")
        (tmp_path / "pid").write_text(f"{p.pid} {stdin}")

    monkeypatch.setattr(zygote.worker, "child_main", child_main)
    r = zygote._serve_one({"jobdir": str(tmp_path), "mem": 0, "cpu": 10, "threads": 1,
                           "timeout": 30})  # fmt: skip
    assert r == {"exitcode": 0, "timeout": False}
    pid, stdin = (tmp_path / "pid").read_text().split()
    assert stdin == os.devnull
    for _ in range(100):  # killed; at most a zombie until init reaps it
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: SIM115
        except FileNotFoundError:
            break
        if state in "ZX":
            break
        time.sleep(0.05)
    else:
        os.kill(int(pid), 9)
        raise AssertionError("the candidate's grandchild survived")

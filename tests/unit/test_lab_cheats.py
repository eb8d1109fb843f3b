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

CFG = EvalConfig(timeout_s=60, repeats=4)
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
        {"harmless"},  # the clock is in the evaluator's process, not this one
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
        {"harmless"},  # there are no durations in the candidate's process to rewrite
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
    if "harmless" in runtime:  # no effect on the verdict: credited about 1x, never inflated
        assert not fb.correct or fb.speedup < 2.0, (name, fb.summary())
        return
    assert not fb.correct, (name, fb.message)
    assert fb.status in runtime, (name, fb.status, fb.message)


def test_specific_guards_fire():
    """The runtime check meant for each cheat is the one that fires (not a lucky error)."""
    fbs = {n: evaluate(task(), CHEATS[n][0], NO_POLICY) for n in
           ("cached_by_pointer", "lazy_tensor", "writes_into_inputs")}  # fmt: skip
    stale = fbs["cached_by_pointer"]
    assert stale.status == "incorrect" and "max abs error" in stale.message, stale.summary()
    assert "lazy" in fbs["lazy_tensor"].flags
    assert "input_write" in fbs["writes_into_inputs"].flags


def test_roofline_rejects_a_time_below_the_physical_bound():
    """A task whose minimal FLOPs would take seconds at the trusted server's measured peak:
    an honest millisecond candidate is then 'faster than physically plausible'."""
    t = dataclasses.replace(task(), flops=lambda d: 1e15)
    src = HEAD + "def kernel(x, weight, eps):\n    return reference(x, weight, eps)\n"
    fb = evaluate(t, src, CFG)
    assert fb.status == "rejected" and "implausible" in fb.flags, fb.summary()
    assert fb.details["roofline_s"] > 1.0


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
    # aliasing: a forbidden builtin taken as a value hides every later use from call checks
    "E = exec\ndef kernel(x):\n    return x\n",
    "import functools\ng = functools.partial(getattr, 1)\ndef kernel(x):\n    return x\n",
    "import operator\nf = operator.methodcaller('x')\ndef kernel(x):\n    return x\n",
    "from operator import attrgetter\ndef kernel(x):\n    return x\n",
    "M = type('M', (object,), {'__torch' + '_function__': 1})\ndef kernel(x):\n    return x\n",
    "import wanka.ops\nw = wanka.lab\ndef kernel(x):\n    return x\n",
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


FORGER = (
    HEAD
    + """import gc, json, socket
def kernel(x, weight, eps):
    out = reference(x, weight, eps)
    for o in gc.get_objects():  # the server's socket: answer before the server does
        if isinstance(o, socket.socket) and o.fileno() >= 0:
            try:
                o.send(json.dumps({"ok": True, "outs": [MODE]}).encode())
            except OSError:
                pass
    return out
"""
)


@pytest.mark.parametrize("mode", [
    "{'dtype': 'float32', 'shape': [1 << 30, 1 << 10], 'offset': 0}",  # outside the buffer
    "{'dtype': 'float32', 'shape': [16, 64], 'offset': 0}",  # the inputs, as outputs
    "{'dtype': 'object', 'shape': [1], 'offset': 64}",  # no such dtype
    "{'dtype': 'float32', 'shape': [16, 64], 'offset': 3}",  # misaligned
])  # fmt: skip
def test_forged_replies_from_the_candidate_process_are_rejected(mode):
    """Only JSON comes back, and every field of it is validated; an early or extra reply is a
    protocol violation, never a result."""
    src = FORGER.replace("MODE", mode)
    fb = evaluate(task(), src, NO_POLICY)
    assert not fb.correct, fb.summary()
    assert fb.status in ("rejected", "incorrect"), fb.summary()


def test_server_left_behind_processes_die_with_it(monkeypatch, tmp_path):
    """A process a server leaves behind is killed with its process group when it is reaped,
    and it never held the fork server's control socket (stdin is /dev/null)."""
    import os
    import socket
    import subprocess
    import time

    from wanka.lab import zygote

    def start(sock, spec):
        p = subprocess.Popen(["sleep", "60"], start_new_session=False)
        stdin = os.readlink("/proc/self/fd/0")
        (tmp_path / "pid").write_text(f"{p.pid} {stdin}")

    monkeypatch.setattr(zygote.worker, "start", start)
    ctl, _other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = zygote._spawn(ctl, {}, os.dup(theirs.fileno()))
    assert zygote._reap(pid, grace_s=10.0) == 0
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

"""Class 3: the result channel is a pair of files the worker opened before the lock-down.
The candidate finds them itself in /proc/self/fd, keeps its honest check answers (and the
gradients the harness left on its leaves), builds re-verifiable samples of its own (seed,
refresh, reference: the same replay the parent does), then writes a complete forged result
straight to those descriptors (os.write: no `open` audit event) claiming 3x, and exits 0
before any timed call. Success: "correct" at ~3x (truth ~1x)."""

import io
import json
import os
import sys
from timeit import default_timer as clock

import torch

from wanka.lab.tasks.rmsnorm import reference

_checks: list = []  # (y, x leaf, weight leaf) of every check call, in order


def _result_files() -> dict:
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        found[os.path.basename(target)] = (int(name), target)
    return found


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _forge(x, weight, eps):
    w = sys.modules["wanka.lab.worker"]
    files = _result_files()
    fd_res, path = files["result.json"]
    fd_out = files["outputs.pt"][0]
    with open(os.path.join(os.path.dirname(path), "job.json")) as f:
        job = json.load(f)
    check = []
    for y, xl, wl in _checks:
        leaves = {"x": xl, "weight": wl}
        grads = (
            [leaves[n].grad.clone() for n in job["grad_inputs"]] if job["mode"] == "fwd_bwd" else []
        )
        check.append([y.detach().clone(), *grads])
    inputs = {"x": x.detach().clone(), "weight": weight.detach().clone(), "eps": eps}
    samples, best = [], float("inf")
    for k in range(min(job["verify_samples"], job["repeats"])):
        seed = 4242 + k
        w.refresh(inputs, job["structural"], seed)
        t0 = clock()
        outs = w.call(reference, inputs, job["mode"], job["grad_inputs"],
                      lambda o, s=seed: w.grad_rule(o, s))  # fmt: skip
        best = min(best, clock() - t0)
        samples.append({"set": 0, "seed": seed, "outs": [o.detach().clone() for o in outs]})
    n = job["repeats"]
    res = {"flags": [], "status": "ran", "peaks": {"flops": 1e18, "bytes_per_s": 1e18},
           "baseline_pre": best, "baseline_side": best, "baseline_all": [best] * n,
           "candidate": {"median_s": best / 3, "all_s": [best / 3] * n, "loop_s": 1.0,
                         "recorded_s": 1.0}}  # fmt: skip
    buf = io.BytesIO()
    torch.save({"check": check, "samples": samples}, buf)
    _write_all(fd_out, buf.getvalue())
    _write_all(fd_res, json.dumps(res).encode())
    os._exit(0)


def kernel(x, weight, eps):
    if x.shape[0] >= 256:  # the first timing call: every check call is behind us
        _forge(x, weight, eps)
    y = reference(x, weight, eps)
    _checks.append((y, x, weight))
    return y

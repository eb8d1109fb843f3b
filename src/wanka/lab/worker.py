"""The evaluator's child process: runs one candidate against inputs the parent drew.

`python -m wanka.lab.worker JOBDIR`. The parent (evaluator.py) wrote job.json, inputs.pt,
baseline.py and candidate.py there. This process never sees the seed behind the inputs nor
the reference outputs (the parent keeps both), so a candidate cannot replay or read them.

Order matters: the clock functions are captured and the baseline (and reference, when it
differs) is timed *before* the candidate is imported, so a candidate cannot slow them down
or patch the timer they use. Then the candidate is checked under guards (exact tensor type,
inputs unchanged, no output written after return, no new threads), timed on rotating inputs
whose float values are redrawn in place before every call (a cached or pointer-keyed result
goes stale), and a few timed calls, picked at random after they returned, are shipped back
for the parent to verify. Everything the candidate could tamper with is re-checked at the end.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

_PERF = time.perf_counter  # captured before any candidate code exists in this process
_MONO = time.monotonic
_SLEEP = time.sleep


class Rejected(Exception):
    def __init__(self, flag: str, msg: str):
        super().__init__(msg)
        self.flag = flag


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()  # device-wide: work queued on any stream is waited for


def _load(path: Path, name: str) -> ModuleType:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, "kernel", None)):
        raise AttributeError(f"{path.name} defines no callable kernel(...)")
    return mod


def grad_rule(outs: tuple, seed: int) -> list:
    """Upstream gradient of a timed call: N(0, 1) from the call's seed, 0 where the output is
    not finite (masked slots). The parent recomputes it from the reference's outputs."""
    import torch

    g = torch.Generator().manual_seed(seed ^ 0x5DEECE66D)
    res = []
    for o in outs:
        if not o.is_floating_point():
            res.append(None)
            continue
        r = torch.randn(o.shape, generator=g).to(o.device, o.dtype)
        res.append(r.masked_fill(~torch.isfinite(o.detach()), 0.0))
    return res


def refresh(inputs: dict, structural: list[str], seed: int) -> None:
    """Redraw every non-structural float input in place from `seed` (same pointers, new
    values). The parent replays it to rebuild the inputs of a sampled call."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, t in inputs.items():
        if name in structural or not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple | list) else (out,)


def call(fn: Callable, inputs: dict, mode: str, grad_names: list[str], grad_out) -> tuple:
    """One run of fn: outputs (+ gradients of grad_names when mode == fwd_bwd). grad_out is
    a list aligned with the outputs, or a callable outs -> list (timed calls)."""
    import torch

    if mode == "fwd":
        with torch.no_grad():
            return _as_tuple(fn(*inputs.values()))
    args = dict(inputs)
    leaves = {n: inputs[n].detach().requires_grad_(True) for n in grad_names}
    args.update(leaves)
    outs = _as_tuple(fn(*args.values()))
    check_tensors(outs, None)
    grads = grad_out(outs) if callable(grad_out) else grad_out
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    if len(outs) != len(grads) or any(not o.requires_grad for o, _ in pairs):
        raise Rejected("no_graph", "an output that needs a gradient is detached from the inputs")
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    for n, t in leaves.items():
        if t.grad is None:
            raise Rejected("no_grad", f"no gradient reached input {n}")
    return tuple(o.detach() for o in outs) + tuple(leaves[n].grad for n in grad_names)


def check_tensors(outs: tuple, device: str | None) -> None:
    """Only plain, materialised tensors count as results: a subclass or a lazy wrapper could
    compute on access (after the clock stopped)."""
    import torch

    for i, o in enumerate(outs):
        if type(o) is not torch.Tensor:
            raise Rejected("lazy", f"output {i} is a {type(o).__name__}, not a plain torch.Tensor")
        if o.layout != torch.strided or o.is_meta:
            raise Rejected("lazy", f"output {i} is not a materialised strided tensor")
        if device is not None and o.device.type != device:
            raise Rejected("device", f"output {i} is on {o.device.type}, expected {device}")


def _same(a, b) -> bool:
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return bool(((a == b) | (a.isnan() & b.isnan())).all())  # NaN == NaN here


def _poison(shapes) -> None:
    """Fill freed allocator blocks of the outputs' sizes with NaN, so an output buffer taken
    with torch.empty and left partly unwritten shows NaN, not a previous run's numbers."""
    import torch

    junk = [torch.full(s, float("nan")) for s in shapes]
    del junk


def checked_call(fn: Callable, inputs: dict, job: dict, grad_out: list, threads0: int) -> list:
    """A correctness call under the guards -> the outputs as they were when fn returned."""
    device = job["device"]
    before = {n: t.clone() for n, t in inputs.items() if hasattr(t, "clone")}
    outs = call(fn, inputs, job["mode"], job["grad_inputs"], grad_out)
    _sync(device)
    check_tensors(outs, device)
    snap = [o.clone() for o in outs]
    for n, t in before.items():
        if not _same(t, inputs[n]):
            raise Rejected("input_write", f"the candidate wrote into input {n}")
    _SLEEP(0.02)  # work left running in the background would change the outputs now
    _sync(device)
    if any(not _same(a, b) for a, b in zip(snap, outs)):
        raise Rejected("async", "an output changed after kernel returned (background work)")
    if threading.active_count() > threads0:
        raise Rejected("thread", "the candidate left threads running")
    return snap


def time_fns(
    fns: dict, sets: list[dict], job: dict, repeats: int | None = None, warmup: int | None = None
) -> dict:
    """Interleaved timing of several functions ({name: (fn, samples)}): each round calls each
    once (order alternating between rounds), so a load change on a shared machine hits all of
    them alike. Inputs cycle over the sets with float values redrawn in place before every
    call. Per name: the median, all timed durations, and `samples` timed calls chosen
    uniformly at random *after* each returned (reservoir sampling, unpredictable source)."""
    names = list(fns)
    durs: dict = {n: [] for n in names}
    kept: dict = {n: [] for n in names}
    other = spent = 0.0
    loop0 = _MONO()
    warmup = job["warmup"] if warmup is None else warmup
    for i in range(warmup + (repeats or job["repeats"])):
        for name in names if i % 2 == 0 else names[::-1]:
            fn, samples = fns[name]
            j, seed = i % len(sets), secrets.randbits(62)
            r0 = _PERF()
            refresh(sets[j]["inputs"], job["structural"], seed)
            _sync(job["device"])
            t0 = _PERF()
            outs = call(fn, sets[j]["inputs"], job["mode"], job["grad_inputs"],
                        lambda o, s=seed: grad_rule(o, s))  # fmt: skip
            _sync(job["device"])
            t1 = _PERF()
            spent += t1 - t0
            if i >= warmup:
                durs[name].append(t1 - t0)
                n = len(durs[name])
                slot = len(kept[name]) if len(kept[name]) < samples else secrets.randbelow(n)
                if slot < samples:
                    item = {"set": j, "seed": seed, "outs": [o.detach().clone() for o in outs]}
                    kept[name][slot:slot + 1] = [item]  # fmt: skip
            del outs
            other += (t0 - r0) + (_PERF() - t1)
    loop = _MONO() - loop0
    out = {}
    for n in names:
        d = sorted(durs[n])
        out[n] = {"median_s": d[len(d) // 2], "all_s": durs[n], "samples": kept[n]}
    out["loop_s"], out["recorded_s"] = loop, spent + other
    return out


def measure_peaks(device: str) -> dict:
    """This process's matmul FLOP/s (best of fp32 and bf16) and copy bandwidth: the roofline."""
    import torch

    n, nbytes = (4096, 1 << 30) if device == "cuda" else (512, 1 << 25)
    best_f = 0.0
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device).to(dt)
        for _ in range(4):
            _sync(device)
            t0 = _PERF()
            a @ a
            _sync(device)
            best_f = max(best_f, 2 * n**3 / max(_PERF() - t0, 1e-9))
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    best_b = 0.0
    for _ in range(4):
        _sync(device)
        t0 = _PERF()
        dst.copy_(src)
        _sync(device)
        best_b = max(best_b, 2 * nbytes / max(_PERF() - t0, 1e-9))
    return {"flops": best_f, "bytes_per_s": best_b}


def _snapshot(job: dict) -> dict:
    import importlib

    import torch

    from wanka.ops import registry

    mod, fn = job["reference"].split(":")
    items = {
        "time.perf_counter": time.perf_counter, "time.monotonic": time.monotonic,
        "time.perf_counter_ns": time.perf_counter_ns, "time.time": time.time,
        "torch.cuda.synchronize": torch.cuda.synchronize, "torch.cuda.Event": torch.cuda.Event,
        "torch.autograd.backward": torch.autograd.backward,
        "torch.Tensor.backward": torch.Tensor.backward, "torch.no_grad": torch.no_grad,
        # the baseline runs beside the candidate: torch must stay what it was
        "torch": {k: v for k, v in vars(torch).items() if callable(v)},
        "torch.Tensor": {k: v for k, v in vars(torch.Tensor).items() if callable(v)},
        "torch.nn.functional": {k: v for k, v in vars(torch.nn.functional).items() if callable(v)},
        "reference": getattr(importlib.import_module(mod), fn),
        "registry": {k: b.fn for k, b in registry._REGISTRY.get(job["op"], {}).items()},
        "worker": {k: v for k, v in globals().items() if callable(v)},
        "threads": torch.get_num_threads(),
    }  # fmt: skip
    return items


# Audit events a candidate has no business raising (defence in depth behind the policy).
_DENIED_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
    "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
    "ctypes.call_function", "os.kill", "os.killpg", "os.remove", "os.rename", "os.rmdir",
    "os.mkdir", "os.truncate", "os.link", "os.symlink", "os.chmod", "os.chown", "os.utime",
    "os.chdir", "os.putenv", "os.unsetenv", "resource.setrlimit", "resource.prlimit",
    "sys.settrace", "sys.setprofile", "socket.connect", "socket.bind", "shutil.rmtree",
    "shutil.move", "shutil.copyfile", "mmap.__new__", "pty.spawn",
})  # fmt: skip
_PATH_EVENTS = frozenset({"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.truncate",
                          "os.link", "os.symlink", "os.chmod", "os.utime", "shutil.rmtree",
                          "shutil.move", "shutil.copyfile"})  # fmt: skip
# CUDA tasks: Triton compiles on first call (ptxas, a C launcher built with cc) and writes its
# cache, so those executables and writes outside the job folder stay allowed there.
_COMPILERS = frozenset({"ptxas", "gcc", "cc", "clang", "nvcc", "ld", "ldconfig", "cuobjdump",
                        "nvdisasm", "x86_64-linux-gnu-gcc"})  # fmt: skip


def _lockdown(jobdir: Path, compilers: bool) -> None:
    """Before the candidate is imported: no processes, signals, dlopen, file writes (the files
    this process writes are open already), thread-count changes. Audit hooks cannot be removed
    once installed; torch.set_num_threads / set_num_interop_threads become raising stubs."""
    import os

    import torch

    write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    jail = os.path.realpath(jobdir)

    def outside_job(path) -> bool:
        if not isinstance(path, str | bytes | os.PathLike):
            return False  # a file descriptor: could be one of the job's files
        p = os.path.realpath(os.fsdecode(path))
        return compilers and p != jail and not p.startswith(jail + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
            if (flags & write or any(c in mode for c in "wax+")) and not outside_job(args[0]):
                raise PermissionError(f"lab candidate: opening {args[0]!r} for writing")
        elif event in _DENIED_EVENTS:
            if compilers and event in ("subprocess.Popen", "os.posix_spawn"):
                exe, argv = args[0], args[1]
                if exe is None and argv:
                    exe = argv if isinstance(argv, str | bytes) else argv[0]
                if isinstance(exe, str | bytes | os.PathLike):
                    if os.path.basename(os.fsdecode(exe)) in _COMPILERS:
                        return
            if compilers and event in ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"):
                return
            if compilers and event in _PATH_EVENTS and args and outside_job(args[0]):
                if event != "os.rename" or outside_job(args[1]):
                    return
            raise PermissionError(f"lab candidate: {event} is not allowed")

    def no_threads(*_a, **_k):
        raise PermissionError("lab candidate: the thread count is fixed by the task")

    torch.set_num_threads = no_threads
    torch.set_num_interop_threads = no_threads
    sys.addaudithook(hook)


def _tampered(before: dict, after: dict) -> list[str]:
    return [k for k in before if not _eq(before[k], after[k])]


def _eq(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
    return a is b if callable(a) else a == b


def run(jobdir: Path) -> dict:
    """One job. The result dict is returned for the caller to write to the already-open
    result file; outputs.pt is opened before the lock-down too."""
    import torch

    job = json.loads((jobdir / "job.json").read_text())
    torch.set_num_threads(job["threads"])
    data = torch.load(jobdir / "inputs.pt", weights_only=True)
    (jobdir / "inputs.pt").unlink()
    dev = job["device"]
    for s in data["check"] + data["timing"]:
        s["inputs"] = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
                       for k, v in s["inputs"].items()}  # fmt: skip
        s["grad_out"] = [g.to(dev) if g is not None else None for g in s.get("grad_out", [])]
    res: dict = {"flags": []}
    baseline = _load(jobdir / "baseline.py", "lab_baseline").kernel
    if data["timing"]:
        res["peaks"] = measure_peaks(dev)
        res["baseline_pre"] = time_fns(
            {"b": (baseline, 0)}, data["timing"], job, repeats=job["baseline_repeats"], warmup=1
        )["b"]["median_s"]
        if job["time_reference"]:
            import importlib

            mod, fn = job["reference"].split(":")
            ref = getattr(importlib.import_module(mod), fn)
            res["reference_s"] = time_fns(
                {"r": (ref, 0)}, data["timing"], job, repeats=job["baseline_repeats"], warmup=1
            )["r"]["median_s"]
    out_file = open(jobdir / "outputs.pt", "wb")  # noqa: SIM115  (before the lock-down)
    _lockdown(jobdir, compilers=dev == "cuda")
    before = _snapshot(job)
    threads0 = threading.active_count()
    try:
        cand = _load(jobdir / "candidate.py", "lab_candidate").kernel
    except BaseException as e:  # noqa: BLE001  (a candidate may raise anything at import)
        return {**res, "status": "import_error", "message": f"{type(e).__name__}: {e}",
                "traceback": _trim(traceback.format_exc())}  # fmt: skip
    outputs: dict = {"check": [], "samples": []}
    try:
        for s in data["check"]:
            _poison(s["out_shapes"])
            outputs["check"].append(checked_call(cand, s["inputs"], job, s["grad_out"], threads0))
        if data["timing"]:
            t = time_fns({"candidate": (cand, job["verify_samples"]), "baseline": (baseline, 0)},
                         data["timing"], job)  # fmt: skip
            outputs["samples"] = t["candidate"].pop("samples")
            res["candidate"] = {
                **t["candidate"],
                "loop_s": t["loop_s"],
                "recorded_s": t["recorded_s"],
            }
            res["baseline_side"] = t["baseline"]["median_s"]
            res["baseline_all"] = t["baseline"]["all_s"]
            if threading.active_count() > threads0:
                raise Rejected("thread", "the candidate left threads running")
    except Rejected as e:
        return {**res, "status": "rejected", "flags": [e.flag], "message": str(e)}
    except BaseException as e:  # noqa: BLE001
        return {**res, "status": "error", "message": f"{type(e).__name__}: {e}",
                "traceback": _trim(traceback.format_exc())}  # fmt: skip
    tampered = _tampered(before, _snapshot(job))
    if tampered:
        return {**res, "status": "rejected", "flags": ["tamper"],
                "message": "the candidate patched " + ", ".join(tampered)}  # fmt: skip
    torch.save(outputs, out_file)
    out_file.close()
    return {**res, "status": "ran"}


def _trim(tb: str, lines: int = 14) -> str:
    """The end of a traceback (where the candidate failed), not the evaluator's frames."""
    return "\n".join(tb.rstrip().splitlines()[-lines:])


def child_main(jobdir: str, memory_bytes: int, cpu_s: int, threads: int) -> None:
    """Entry of a forked candidate process: own output files, resource limits, one job."""
    import os
    import resource

    d = Path(jobdir)
    for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
        f = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    os.environ["WANKA_OPS_POISON"] = "1"
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 5))
    _run_to(d)
    sys.stdout.flush()
    sys.stderr.flush()


def _run_to(d: Path) -> None:
    """run(d) with result.json opened first (no file can be opened for writing afterwards).
    It stays empty unless the job finishes: the parent treats empty as no result."""
    with open(d / "result.json", "w") as f:
        text = json.dumps(run(d))
        f.write(text)


if __name__ == "__main__":  # one job in this process (debugging): python -m wanka.lab.worker DIR
    _run_to(Path(sys.argv[1]))

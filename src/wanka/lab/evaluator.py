"""The evaluator: one candidate, a verdict the candidate's process cannot fool.

Everything that decides a verdict happens in this process: the static policy; inputs drawn
from a seed kept here; the reference outputs of the correctness sets; the clock; the check of
every timed call's outputs; the CPU time the candidate's process used; the roofline bound.
The candidate runs in a kernel server of its own (worker.py, forked by zygote.py), isolated
by sandbox.py where the OS allows it, which only ever answers "call" messages: it reads the
inputs this process wrote into its shared memory and replies with where its outputs are;
this process copies them out of the server's memory (and writes the upstream gradients of
a backward) itself. The baseline (and the reference, where it differs) runs in a second, trusted server
under the same conditions, timed interleaved with the candidate (alternating order), on the
same freshly drawn inputs; the speed-up is the median of the per-round ratios.

What the candidate's process says is never believed: its timings do not exist (the clock is
here, from the request until the outputs are copied), its outputs are compared with the
trusted server's for every call including warm-up, every input (indices too) is drawn anew from a
fresh seed before every call (a cache never hits), its inputs must be unchanged, and its CPU time is read from the host's /proc: work done outside the timed calls or on more threads
than the task allows is rejected.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from wanka.lab import worker
from wanka.lab.policy import check_source
from wanka.lab.servers import ForkServerDied, Server, Zygote, python_path
from wanka.lab.shm import nbytes_of
from wanka.lab.task import Shape, Task
from wanka.lab.verdict import Feedback, Verdict, reject


@dataclass(frozen=True)
class EvalConfig:
    timeout_s: float = 300.0
    memory_gib: float = 8.0
    warmup: int = 2  # >= rotation: every set is seen once before the clock runs
    repeats: int = 5
    check_sets: int = 2  # fresh random input sets per shape
    rotation: int = 2  # timing input sets cycled through
    static_policy: bool = True
    roofline_slack: float = 2.0  # reject when faster than roofline bound / slack
    timing: bool = True
    isolate: bool | None = None  # None: the sandbox where it works, else rlimits + audit hook
    hide: tuple[str, ...] = ()  # more paths the candidate must not see (the lab history's dir)
    cpu_slack: float = 1.15  # CPU time allowed per timed wall second and thread


def _names(task: Task, n_out: int) -> list[str]:
    outs = ["out"] if n_out == 1 else [f"out{i}" for i in range(n_out)]
    return outs + ([f"grad_{g}" for g in task.grad_inputs] if task.mode == "fwd_bwd" else [])


def compare(ref, cand, names: list[str], atol: float, rtol: float) -> tuple[bool, str, float]:
    """Default comparison -> (ok, message, max abs error over finite reference elements)."""
    if len(ref) != len(cand):
        return False, f"expected {len(ref)} results, got {len(cand)}", float("inf")
    worst = 0.0
    for n, r, c in zip(names, ref, cand):
        r, c = r.detach().cpu(), c.detach().cpu()
        if c.shape != r.shape or c.dtype != r.dtype:
            return False, f"{n}: {c.dtype} {tuple(c.shape)}, expected {r.dtype} {tuple(r.shape)}", float("inf")  # fmt: skip
        if not r.is_floating_point():
            bad = int((c != r).sum())
            if bad:
                return False, f"{n}: {bad} of {r.numel()} elements differ", float("inf")
            continue
        if bool(c.isnan().any()):
            return False, f"{n}: {int(c.isnan().sum())} NaN elements (NaN never passes)", float("inf")  # fmt: skip
        fin = torch.isfinite(r)
        if not bool(fin.all()):  # masked outputs: infinities must sit exactly where they are
            if not torch.equal(c[~fin], r[~fin]) or not bool(torch.isfinite(c[fin]).all()):
                return False, f"{n}: infinities differ from the reference", float("inf")
            c, r = c[fin], r[fin]
        elif not bool(torch.isfinite(c).all()):
            return False, f"{n}: infinite elements where the reference is finite", float("inf")
        err = (c - r).abs()
        over = err > atol + rtol * r.abs()
        if err.numel():
            worst = max(worst, float(err.max()))
        if bool(over.any()):
            return False, (f"{n}: max abs error {float(err.max()):.3g} over tolerance (atol {atol:g}, "
                           f"rtol {rtol:g}) at {int(over.sum())} elements"), worst  # fmt: skip
    return True, "", worst


def _reference(task: Task, inputs: dict, seed: int, pool: torch.Tensor) -> tuple:
    return worker.call(task.reference_fn(), inputs, task.mode, list(task.grad_inputs),
                       lambda o: worker.grad_rule(o, seed, pool))  # fmt: skip


def _compare(task: Task, ref, got, n_out: int, inputs: dict):
    if task.compare is not None:
        return task.compare(ref, got, inputs, task.tolerance)
    return compare(ref, got, _names(task, n_out), task.tolerance.atol, task.tolerance.rtol)


def _to(inputs: dict, device: str) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _largest(inputs: dict) -> int:
    return max((v.numel() for v in inputs.values() if isinstance(v, torch.Tensor)), default=0)


def _input_bytes(inputs: dict) -> int:
    return sum(nbytes_of(v) for v in inputs.values() if isinstance(v, torch.Tensor))


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


_SYSTEM = {"/", "/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc", "/dev", "/proc", "/sys", "/var",
           "/opt", "/run"}  # fmt: skip


def _paths(cfg: EvalConfig, jobdir: Path) -> tuple[list[str], list[str]]:
    """What the sandbox hides (the caller's folders, home, the project, the history) and
    exposes again (the interpreter and the import path), never re-exposing a hidden secret."""
    import wanka

    pkg = Path(wanka.__file__).resolve().parent
    secret = {os.getcwd(), str(jobdir), *cfg.hide}
    hide = secret | {os.path.expanduser("~"), "/root", "/home"}
    if (pkg.parents[1] / "pyproject.toml").exists():
        hide.add(str(pkg.parents[1]))
    hide = {os.path.realpath(p) for p in hide} - _SYSTEM  # a cwd of / must not hide the OS
    secret = {os.path.realpath(p) for p in secret}
    expose = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(pkg), *python_path()}
    expose = {os.path.realpath(p) for p in expose}
    keep = sorted(e for e in expose if os.path.exists(e) and not any(_within(s, e) for s in secret))
    return sorted(hide), keep


def _cpus(threads: int) -> list[int]:
    """The cores both servers run on: the last `threads` this process may use (interrupts
    and stray system work tend to land on the first)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-threads:] if threads < len(cpus) else cpus


def _isolation(cfg: EvalConfig) -> tuple[bool, str | None]:
    """(use the sandbox, why it is unavailable)."""
    if cfg.isolate is False:
        return False, "disabled by the configuration"
    why = Zygote.isolation_unavailable()
    return why is None, why


def evaluate(task: Task, source: str, cfg: EvalConfig = EvalConfig(),
             shapes: tuple[Shape, ...] | None = None, timing_shape: Shape | None = None,
             seed: int | None = None) -> Feedback:  # fmt: skip
    """Check (and time) one candidate source for `task`. Visible shapes unless given."""
    if cfg.static_policy:
        bad = check_source(source)
        if bad:
            return Feedback("policy", "; ".join(bad[:5]))
    why = task.unavailable()
    interpret = (
        why is not None and task.device == "cuda" and os.environ.get("TRITON_INTERPRET") == "1"
    )
    if why and not interpret:
        return Feedback("unavailable", why)
    isolate, no_sandbox = _isolation(cfg)
    if cfg.isolate and not isolate:
        return Feedback("unavailable", f"OS isolation of the candidate is unavailable here: {no_sandbox}")  # fmt: skip
    device = "cpu" if interpret else task.device
    shapes = task.shapes if shapes is None else shapes
    timing_shape = timing_shape or task.timing_shape
    gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    drawn = [(s.name, task.make_inputs(s.dims, gen), int(torch.randint(0, 2**62, (1,), generator=gen)))
             for s in shapes for _ in range(cfg.check_sets)]  # fmt: skip
    sets = []
    if cfg.timing and not why:
        sets = [task.make_inputs(timing_shape.dims, gen) for _ in range(cfg.rotation)]
    every = [d[1] for d in drawn] + sets
    # Upstream gradients are windows of one pool of normals, drawn once, not in every timed
    # call (see worker.grad_rule); at least as long as the largest input.
    pool = torch.randn(max(_largest(i) for i in every) + 4096, generator=gen)
    checks = []
    for name, inputs, gseed in drawn:
        ref = tuple(r.detach().cpu() for r in _reference(task, _to(inputs, device), gseed, pool))
        n_out = len(ref) - (len(task.grad_inputs) if task.mode == "fwd_bwd" else 0)
        checks.append((name, inputs, gseed, ref, n_out))
    # A server's buffer holds a call's inputs and upstream gradients; it also bounds the
    # bytes the outputs of one reply may hold.
    nbytes = nbytes_of(pool) + 4 * max(_input_bytes(i) for i in every) + (16 << 20)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    jobdir = Path(tempfile.mkdtemp(prefix="wanka-lab-", dir=shm))
    job = _Job(task, cfg, device, jobdir, nbytes, isolate, pool)
    info = {"isolation": "sandbox" if isolate else f"none ({no_sandbox})"}
    try:
        (jobdir / "candidate.py").write_text(source)
        (jobdir / "baseline.py").write_text(task.baseline)
        fb = job.run(checks, sets, timing_shape)
    except Verdict as v:
        fb = v.fb
    except ForkServerDied:
        raise  # the lab itself is broken: no candidate's verdict
    except Exception as e:  # noqa: BLE001  (what a hostile reply provoked ends this one only)
        import traceback

        fb = Feedback("error", f"the evaluation failed: {type(e).__name__}: {e}"[:2000],
                      details={"traceback": traceback.format_exc()[-4000:]})  # fmt: skip
    finally:
        job.close()
        shutil.rmtree(jobdir, ignore_errors=True)
    fb.details.update(info)
    return fb


class _Job:
    """The servers of one evaluation and the rules that judge them."""

    def __init__(self, task: Task, cfg: EvalConfig, device: str, jobdir: Path, nbytes: int,
                 isolate: bool, pool: torch.Tensor):  # fmt: skip
        self.pool = pool
        self.task, self.cfg, self.device, self.jobdir = task, cfg, device, jobdir
        self.deadline = time.monotonic() + cfg.timeout_s
        hide, expose = _paths(cfg, jobdir) if isolate else ([], [])
        mem = int(cfg.memory_gib * 2**30) if device == "cpu" else 0
        # No seccomp on CUDA: Triton compiles with ptxas and a C compiler (exec).
        self.spec = {"jobdir": str(jobdir), "nbytes": nbytes, "threads": task.threads,
                     "device": device, "mode": task.mode, "grad_inputs": list(task.grad_inputs),
                     "memory_bytes": mem, "cpu_s": int(cfg.timeout_s * 2) + 5,
                     "isolate": isolate, "hide": hide, "expose": expose,
                     "seccomp": device == "cpu", "cpus": _cpus(task.threads)}  # fmt: skip
        self.servers: list[Server] = []

    def spawn(self, role: str, kernels: dict) -> Server:
        srv = Server(role, {**self.spec, "role": role, "kernels": kernels}, self.jobdir,
                      self.deadline, self.cfg.timeout_s)  # fmt: skip
        self.servers.append(srv)
        srv.pool = self.pool
        srv.n_outputs = getattr(self, "n_outputs", None)
        return srv

    def close(self) -> None:
        for srv in self.servers:
            try:
                srv.reap()
            except ForkServerDied:  # it took the servers with it
                pass

    def compare(self, ref, got, n_out: int, inputs: dict):
        if self.task.compare is not None:
            return self.task.compare(ref, got, inputs, self.task.tolerance)
        tol = self.task.tolerance
        return compare(ref, got, _names(self.task, n_out), tol.atol, tol.rtol)

    def run(self, checks: list, sets: list, timing_shape: Shape) -> Feedback:
        # (forward outputs, all outputs) of every call: a reply describing any other number
        # is refused before anything it names is read (the reference computed them here).
        self.n_outputs = (checks[0][4], len(checks[0][3])) if checks else None
        cand = self.spawn("candidate", {"candidate": {"file": str(self.jobdir / "candidate.py"), "trusted": False}})  # fmt: skip
        ready = cand.start()
        if ready.get("ready") is not True:
            return Feedback("import_error", str(ready.get("message", ""))[:2000],
                            details={"traceback": str(ready.get("traceback", ""))[:4000]})  # fmt: skip
        fb = Feedback("correct", details={"max_err": {}})
        for i, (shape, inputs, gseed, ref, n_out) in enumerate(checks):
            _, _, outs = cand.call("candidate", inputs, gseed, poison=[list(r.shape) for r in ref])
            ok, msg, err = self.compare(ref, outs, n_out, inputs)
            fb.details["max_err"][shape] = max(err, fb.details["max_err"].get(shape, 0.0))
            if not ok:
                return Feedback("incorrect", f"shape {shape} (set {i}): {msg}", details=fb.details)
        if not sets:
            fb.message = "checked (not timed)"
            return fb
        return self.time(cand, fb, sets, timing_shape)

    def time(self, cand: Server, fb: Feedback, sets: list, timing_shape: Shape) -> Feedback:
        task, cfg = self.task, self.cfg
        kernels = {"baseline": {"file": str(self.jobdir / "baseline.py"), "trusted": True}}
        if not task.baseline_is_reference:
            kernels["reference"] = {"ref": task.reference}
        base = self.spawn("baseline", kernels)
        if base.start().get("ready") is not True:
            raise Verdict(Feedback("error", "the baseline's server did not start"))
        peaks = base.ask({"op": "peaks"})
        roles = [("baseline", base), ("candidate", cand)]
        if not task.baseline_is_reference:
            roles.append(("reference", base))
        # Single-thread CPU tasks are timed by the CPU time the server used during the call
        # (read from outside, ns resolution): a machine shared with other jobs delays both
        # sides' wall time unevenly, their CPU time hardly. Otherwise: wall time.
        by_cpu = self.device == "cpu" and task.threads == 1
        times: dict[str, list[float]] = {name: [] for name, _ in roles}
        warmup = max(cfg.warmup, cfg.rotation)
        cpu0, wall, in_calls = cand.cpu_s(), 0.0, 0.0
        for i in range(warmup + cfg.repeats):
            j, seed = i % len(sets), secrets.randbits(62)
            # A whole new input set every round, the structural inputs (indices, routing,
            # document ids) too: with only the floats redrawn, a kernel kept what it derived
            # from the indices across calls (sparse attention's chunk plans: credited
            # 2.05-2.10x for a kernel that measures 1.52-1.64x without that cache), which no
            # training step allows: its indices change every step.
            sets[j] = task.make_inputs(timing_shape.dims, torch.Generator().manual_seed(seed))
            outs = {}
            # Alternating order; with an odd count the extra round has the candidate first,
            # so any cost of a round's first call (new inputs) never favours the candidate.
            for name, srv in roles[::-1] if (i - warmup) % 2 == 0 else roles:
                dt, cpu, outs[name] = srv.call(name, sets[j], seed)
                if name == "candidate":
                    wall, in_calls = wall + dt, in_calls + cpu
                if i >= warmup:
                    times[name].append(cpu if by_cpu else dt)
            truth = outs.get("reference", outs["baseline"])
            n_out = len(truth) - (len(task.grad_inputs) if task.mode == "fwd_bwd" else 0)
            ok, msg, _ = self.compare(truth, outs["candidate"], n_out, sets[j])
            if not ok:
                return Feedback("incorrect", f"timed call {i + 1} ({timing_shape}): {msg}",
                                details=fb.details)  # fmt: skip
        self._check_cpu(fb, cand.cpu_s(), cpu0, wall, in_calls)
        c = times["candidate"]
        fb.time_s = sorted(c)[len(c) // 2]
        fb.baseline_s = fb.time_s * _median_ratio(times["baseline"], c)
        fb.reference_s = (fb.time_s * _median_ratio(times["reference"], c)
                          if "reference" in times else fb.baseline_s)  # fmt: skip
        fb.details.update(times_s=c, baseline_times_s=times["baseline"], shape=str(timing_shape),
                          clock="cpu" if by_cpu else "wall")  # fmt: skip
        d = timing_shape.dims
        try:
            bound = max(task.flops(d) / float(peaks["flops"]), task.bytes(d) / float(peaks["bytes_per_s"]))  # fmt: skip
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise Verdict(Feedback("error", "the baseline's server sent no roofline peaks")) from None  # fmt: skip
        fb.details["roofline_s"] = bound
        if fb.time_s < bound / cfg.roofline_slack:
            raise reject("implausible", f"{fb.time_s * 1e3:.3f} ms is faster than physically "
                         f"plausible (roofline bound {bound * 1e3:.3f} ms / {cfg.roofline_slack:g})",
                         **fb.details)  # fmt: skip
        return fb

    def _check_cpu(self, fb: Feedback, cpu1, cpu0, wall: float, in_calls: float) -> None:
        """The candidate's process may compute only inside its calls, on at most the task's
        thread count: work in between (precomputing, slowing the baseline down) or on extra
        threads shows in its CPU time, which the kernel counts, not the candidate."""
        if cpu0 is None or cpu1 is None:
            raise reject("cpu", "the candidate's process vanished during timing")
        outside, threads = cpu1 - cpu0 - in_calls, self.task.threads
        fb.details.update(cpu_in_calls_s=in_calls, cpu_outside_calls_s=outside, timed_wall_s=wall)
        if outside > 0.02 + 0.05 * in_calls:
            raise reject("cpu", f"the candidate's process used {outside:.3f} s of CPU between its "
                         f"calls (background work)", **fb.details)  # fmt: skip
        if in_calls > self.cfg.cpu_slack * threads * wall + 0.02:
            raise reject("cpu", f"the candidate's process used {in_calls:.3f} s of CPU in "
                         f"{wall:.3f} s of calls: more than the task's {threads} thread(s)",
                         **fb.details)  # fmt: skip


def _median_ratio(num: list[float], den: list[float]) -> float:
    r = sorted(a / max(b, 1e-12) for a, b in zip(num, den))
    return r[len(r) // 2] if r else math.nan

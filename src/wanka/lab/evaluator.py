"""The evaluator: one candidate, one fresh process, a verdict that is hard to fool.

Parent side (this module): the static policy; inputs drawn from a seed this process keeps
(fresh per evaluation unless a test pins it); reference outputs and gradients computed here,
never in the candidate's process; the child's outputs compared with tolerances (NaN never
passes, non-finite positions must match exactly); a few timed calls re-verified (a cached or
pointer-keyed result fails there); timing records checked against the loop's wall time; the
speedup taken from baseline/candidate pairs timed back to back; and speed checked against a
roofline bound (FLOPs and bytes over the peaks measured in the same child).
Child side: worker.py, in a process forked per candidate by zygote.py. Limits: wall time
(SIGKILL), address space (RLIMIT_AS, CPU only: CUDA maps far more virtual memory than it
uses), CPU seconds.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from wanka.lab import worker
from wanka.lab.policy import check_source
from wanka.lab.task import Shape, Task


@dataclass(frozen=True)
class EvalConfig:
    timeout_s: float = 300.0
    memory_gib: float = 8.0
    warmup: int = 2  # >= rotation: every set is seen once before the clock runs
    repeats: int = 5
    baseline_repeats: int = 2  # clean timing before the candidate is imported (drift check)
    check_sets: int = 2  # fresh random input sets per shape
    rotation: int = 2  # timing input sets cycled through
    verify_samples: int = 2  # timed calls re-verified against the reference
    static_policy: bool = True
    roofline_slack: float = 2.0  # reject when faster than roofline bound / slack
    timing: bool = True


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


def _draw_grads(gen: torch.Generator):
    def rule(outs):
        return [torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
                .masked_fill(~torch.isfinite(o.detach()), 0.0) if o.is_floating_point() else None
                for o in outs]  # fmt: skip

    return rule


def _reference(task: Task, inputs: dict, grad_out) -> tuple:
    return worker.call(task.reference_fn(), inputs, task.mode, list(task.grad_inputs), grad_out)


class _Zygote:
    """Parent's handle on the fork server (zygote.py), started on first use."""

    proc: subprocess.Popen | None = None

    @classmethod
    def run(cls, job: dict) -> dict:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen([sys.executable, "-m", "wanka.lab.zygote"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
            atexit.register(cls.close)
        cls.proc.stdin.write(json.dumps(job) + "\n")
        cls.proc.stdin.flush()
        line = cls.proc.stdout.readline()
        if not line:
            cls.close()
            raise RuntimeError("the lab's fork server died")
        return json.loads(line)

    @classmethod
    def close(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.stdin.close()
            cls.proc.wait(timeout=10)
        cls.proc = None


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
    device = "cpu" if interpret else task.device
    timed = cfg.timing and not why
    shapes = task.shapes if shapes is None else shapes
    timing_shape = timing_shape or task.timing_shape
    gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
    check, refs = [], []
    for s in shapes:
        for _ in range(cfg.check_sets):
            inputs = task.make_inputs(s.dims, gen)
            inputs = {
                k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
            }
            grads: list = []
            rule = _draw_grads(gen)
            ref = _reference(task, inputs, lambda o, r=rule, g=grads: g.extend(r(o)) or g)
            n_out = len(ref) - (len(task.grad_inputs) if task.mode == "fwd_bwd" else 0)
            check.append({"shape": s.name, "inputs": inputs, "grad_out": grads,
                          "out_shapes": [tuple(r.shape) for r in ref]})  # fmt: skip
            refs.append((ref, n_out))
    timing = []
    if timed:
        for _ in range(cfg.rotation):
            timing.append({"inputs": task.make_inputs(timing_shape.dims, gen)})
    job = {"mode": task.mode, "grad_inputs": list(task.grad_inputs), "device": device,
           "structural": list(task.structural), "threads": task.threads, "op": task.op,
           "warmup": max(cfg.warmup, cfg.rotation), "repeats": cfg.repeats,
           "baseline_repeats": cfg.baseline_repeats,
           "verify_samples": cfg.verify_samples,
           "reference": task.reference, "time_reference": not task.baseline_is_reference}  # fmt: skip
    jobdir = Path(tempfile.mkdtemp(prefix="wanka-lab-"))
    try:
        (jobdir / "job.json").write_text(json.dumps(job))
        (jobdir / "candidate.py").write_text(source)
        (jobdir / "baseline.py").write_text(task.baseline)
        torch.save({"check": check, "timing": timing}, jobdir / "inputs.pt")
        return _run_child(task, cfg, jobdir, device, check, refs, timing, timing_shape)
    finally:
        shutil.rmtree(jobdir, ignore_errors=True)


def _run_child(task, cfg, jobdir, device, check, refs, timing, timing_shape) -> Feedback:
    mem = int(cfg.memory_gib * 2**30) if device == "cpu" else 0
    r = _Zygote.run({"jobdir": str(jobdir), "mem": mem, "cpu": int(cfg.timeout_s * 2),
                     "threads": task.threads, "timeout": cfg.timeout_s})  # fmt: skip
    if r["timeout"]:
        return Feedback("timeout", f"no result within {cfg.timeout_s:g} s (killed)")
    res_file = jobdir / "result.json"
    code = r["exitcode"]
    res = _read_result(res_file)
    if res is None and code != 0:
        err = jobdir / "stderr.txt"
        tail = (
            "\n".join(err.read_text(errors="replace").strip().splitlines()[-12:])
            if err.exists()
            else ""
        )
        code = code or 0
        why = f"signal {-code}" if code < 0 else f"exit code {code}"
        if "MemoryError" in tail or "bad_alloc" in tail or "memory" in tail.lower():
            why += f" (memory limit {cfg.memory_gib:g} GiB)"
        return Feedback(
            "crash", f"the candidate's process died: {why}", details={"traceback": tail}
        )
    if res is None or code != 0 or res["status"] not in _CHILD_STATUSES:  # not a clean finish
        return Feedback("rejected", f"result incomplete (exit code {code})", flags=["incomplete"])
    fb = Feedback(res["status"], res.get("message", ""), flags=list(res.get("flags", [])),
                  details={k: res[k] for k in ("traceback", "peaks") if k in res})  # fmt: skip
    if res["status"] != "ran":
        return fb
    try:
        outs = torch.load(jobdir / "outputs.pt", weights_only=True)
    except Exception:  # noqa: BLE001  (missing, truncated or forged)
        return _reject(fb, "incomplete", "result incomplete: no readable outputs")
    if not _complete(res, outs, cfg, len(check), bool(timing)):
        return _reject(fb, "incomplete", "result incomplete: wrong number of results or samples")
    for i, ((ref, n_out), got) in enumerate(zip(refs, outs["check"])):
        ok, msg, err = _compare(task, ref, got, n_out, check[i]["inputs"])
        fb.details.setdefault("max_err", {})[check[i]["shape"]] = err
        if not ok:
            return Feedback("incorrect", f"shape {check[i]['shape']} (set {i}): {msg}", details=fb.details)  # fmt: skip
    if not timing:
        fb.status, fb.message = "correct", "checked (not timed)"
        return fb
    for smp in outs["samples"]:  # replay the sampled timed calls
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v
                  for k, v in timing[smp["set"]]["inputs"].items()}  # fmt: skip
        worker.refresh(inputs, list(task.structural), smp["seed"])
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        ref = _reference(task, inputs, lambda o, s=smp["seed"]: worker.grad_rule(o, s))
        n_out = len(ref) - (len(task.grad_inputs) if task.mode == "fwd_bwd" else 0)
        ok, msg, _ = _compare(task, ref, smp["outs"], n_out, inputs)
        if not ok:
            return _reject(fb, "stale", f"a timed call returned a wrong result (cached or "
                           f"input-keyed?): {msg}")  # fmt: skip
    c = res["candidate"]
    fb.time_s = c["median_s"]
    # Speedup = median over rounds of baseline / candidate, each pair timed back to back, so
    # load changes on a shared machine largely cancel; baseline_s is the equivalent baseline
    # time. The clean pre-import timing only guards against a baseline slowed down by the
    # candidate (then it is used instead: conservative).
    ratios = sorted(b / max(t, 1e-12) for b, t in zip(res["baseline_all"], c["all_s"]))
    fb.baseline_s = fb.time_s * ratios[len(ratios) // 2]
    if res["baseline_side"] > 2.0 * res["baseline_pre"]:
        fb.baseline_s = res["baseline_pre"]
        fb.flags.append("baseline_drift")
    fb.reference_s = res.get("reference_s", fb.baseline_s)
    fb.details.update(times_s=c["all_s"], baseline_pre_s=res["baseline_pre"],
                      baseline_side_s=res["baseline_side"], shape=str(timing_shape))  # fmt: skip
    unaccounted = c["loop_s"] - c["recorded_s"]
    if unaccounted > max(0.25 * c["loop_s"], 0.05) or unaccounted < -0.01 - 0.05 * c["loop_s"]:
        return _reject(fb, "timing", f"timed calls account for {c['recorded_s']:.3f} s of a "
                       f"{c['loop_s']:.3f} s timing loop (timer or records tampered with)")  # fmt: skip
    pk, d = res["peaks"], timing_shape.dims
    bound = max(task.flops(d) / pk["flops"], task.bytes(d) / pk["bytes_per_s"])
    fb.details["roofline_s"] = bound
    if fb.time_s < bound / cfg.roofline_slack:
        return _reject(fb, "implausible", f"{fb.time_s * 1e3:.3f} ms is faster than physically "
                       f"plausible (roofline bound {bound * 1e3:.3f} ms / {cfg.roofline_slack:g})")  # fmt: skip
    fb.status, fb.message = "correct", ""
    return fb


_CHILD_STATUSES = ("ran", "rejected", "import_error", "error")


def _read_result(path: Path) -> dict | None:
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return res if isinstance(res, dict) and isinstance(res.get("status"), str) else None


def _complete(res: dict, outs, cfg: EvalConfig, n_check: int, timed: bool) -> bool:
    """Exactly the results the job asked for: one per check set; when timed, `repeats`
    timings of candidate and baseline and min(verify_samples, repeats) re-verifiable samples."""
    try:
        if not isinstance(outs, dict) or len(outs["check"]) != n_check:
            return False
        if not timed:
            return True
        c = res["candidate"]
        n = cfg.repeats
        return (len(c["all_s"]) == n and len(res["baseline_all"]) == n
                and len(outs["samples"]) == min(cfg.verify_samples, n)
                and all(isinstance(x, int | float) and x > 0 for x in c["all_s"]))  # fmt: skip
    except (KeyError, TypeError):
        return False


def _compare(task: Task, ref, got, n_out: int, inputs: dict):
    if task.compare is not None:
        return task.compare(ref, got, inputs, task.tolerance)
    return compare(ref, got, _names(task, n_out), task.tolerance.atol, task.tolerance.rtol)


def _reject(fb: Feedback, flag: str, msg: str) -> Feedback:
    fb.status, fb.message = "rejected", msg
    fb.flags.append(flag)
    return fb

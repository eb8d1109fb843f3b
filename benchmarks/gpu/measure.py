"""The torch side of benchmarks/gpu/triton_ops.py: problems, timers, errors, one group at a time.

Imported only after triton_ops.py has set TRITON_INTERPRET (Triton reads it once, at import)
and put this checkout's src/ first on sys.path, so it imports torch and wanka at the top.

A *group* is one shape of one op (op, L, k, index pattern); every backend of the op runs on the
same inputs and each gives one row: forward and forward+backward time, peak memory, error vs
an fp32 run of the reference on the same (bf16-rounded) inputs, achieved TFLOP/s from the CPU
benchmark's FLOP formulas (wanka.bench.ops.flops) and the fraction of the measured bf16 matmul
rate.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from wanka import ops  # noqa: F401  (importing it registers every backend)
from wanka.bench.ops import estimate_bytes, flops
from wanka.ops import registry
from wanka.ops.index_patterns import random_indices, realistic_indices
from wanka.ops.lightning_indexer.reference import select_topk
from wanka.ops.sparse_attention.reference import sparse_attention as sparse_reference

MIB = 2**20
GIB = 2**30

# Backends timed per op, fastest candidate first. The cpu backends of sparse attention and the
# indexer are not here: they allocate helper tensors without a device (CPU only).
BACKENDS = {
    "sparse_attention": ("triton", "reference"),
    "dense_attention": ("triton", "sdpa", "reference"),
    "lightning_indexer": ("triton", "reference"),
    "indexer_kl": ("chunked", "reference"),
}
REFERENCE = {op: "reference" for op in BACKENDS}


class DeviceBroken(RuntimeError):
    """The CUDA context is unusable (illegal access, device assert): later cases cannot run."""


# ---------------------------------------------------------------------------------------------
# Timing and memory


class Timer:
    """Median of `repeats` timed calls after `warmup` untimed ones (CUDA events on a GPU, wall
    clock on CPU), and peak allocator memory of one call (GPU only)."""

    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        for _ in range(self.repeats):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peak(self, fn: Callable[[], object]) -> tuple[object, float | None]:
        """(fn's result, MiB the call allocated at its peak above what was allocated before it);
        None on CPU, where the caching allocator's counters do not exist."""
        if not self.cuda:
            return fn(), None
        self.sync()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        result = fn()
        self.sync()
        return result, (torch.cuda.max_memory_allocated(self.device) - base) / MIB


def matmul_peak(timer: Timer, dtype: torch.dtype, n: int, tf32: bool = False) -> dict:
    """Measured dense matmul rate: n x n @ n x n in `dtype`, median of the timer's repeats.
    tf32=True times float32 with TF32 allowed: the ceiling of the Triton kernels, which upcast
    16-bit inputs to float32 and multiply in TF32."""
    if timer.cuda:  # ~0.1 s of products first, so that the clocks are up from idle
        timer = Timer(timer.device, warmup=100, repeats=max(timer.repeats, 20))
    gen = torch.Generator(timer.device).manual_seed(0)
    a = torch.randn(n, n, device=timer.device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=timer.device, generator=gen).to(dtype)
    c = torch.empty(n, n, device=timer.device, dtype=dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        ms = timer.median_ms(lambda: torch.mm(a, b, out=c))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    label = "tf32" if tf32 and timer.cuda else str(dtype).removeprefix("torch.")
    return {"dtype": label, "n": n, "ms": ms, "tflops": 2.0 * n**3 / (ms * 1e-3) / 1e12}


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Group:
    """One shape of one op; every backend in BACKENDS[op] runs on the same inputs."""

    op: str
    L: int
    k: int | None  # top-k (sparse attention, indexer); None for dense ops
    pattern: str | None  # index pattern (sparse attention only)
    H: int
    D: int
    Hi: int
    Di: int

    @property
    def shape_label(self) -> str:
        if self.op == "sparse_attention":
            return str(self.pattern)
        if self.op == "dense_attention":
            return "causal, 1 doc"
        return f"{self.Hi} heads x {self.Di}"

    @property
    def name(self) -> str:
        return f"{self.op} L={self.L} k={self.k or '-'} {self.shape_label}"

    def case(self, backend: str) -> dict:
        """The dict wanka.bench.ops.flops / estimate_bytes take (the CPU benchmark's case)."""
        return dict(op=self.op, backend=backend, L=self.L, k=self.k, H=self.H, D=self.D,
                    Hi=self.Hi, Di=self.Di, pattern=self.pattern)  # fmt: skip


def make_groups(
    ops_: list[str],
    lengths: list[int],
    topks: list[int],
    patterns: list[str],
    H: int,
    D: int,
    Hi: int,
    Di: int,
) -> list[Group]:
    """All ops at each length before the next length, so that a run cut short by its time
    budget still covers every op at the shorter lengths."""
    groups = []
    for L in lengths:
        for op in ops_:
            if op == "sparse_attention":
                ks = [k for k in topks if k <= L]
                groups += [Group(op, L, k, p, H, D, Hi, Di) for k in ks for p in patterns]
            elif op == "lightning_indexer":
                groups += [Group(op, L, k, None, H, D, Hi, Di) for k in topks if k <= L]
            else:
                groups.append(Group(op, L, None, None, H, D, Hi, Di))
    return groups


@dataclass
class Problem:
    """Inputs of one group. call(fn, leaves, consts) -> (differentiable output, selected
    indices or None); leaves get gradients, consts (targets, indices, doc ids) do not."""

    leaves: list[torch.Tensor]
    consts: list[torch.Tensor]
    call: Callable
    setup_s: float  # time to build the inputs (index generation runs on the CPU)


def make_problem(g: Group, device: torch.device, dtype: torch.dtype) -> Problem:
    t0 = time.perf_counter()
    gen = torch.Generator(device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    L, scale = g.L, g.D**-0.5
    doc = torch.zeros(1, L, dtype=torch.int32, device=device)  # one document, as on CPU
    if g.op == "sparse_attention":
        gen_idx = realistic_indices if g.pattern == "realistic" else random_indices
        idx = gen_idx(1, L, g.k, seed=1).to(device)
        leaves, consts = [randn(1, L, g.H, g.D), randn(1, L, g.D), randn(1, L, g.D)], [idx]

        def call(fn, lv, cs):
            return fn(lv[0], lv[1], lv[2], cs[0], scale), None
    elif g.op == "dense_attention":
        leaves, consts = [randn(1, L, g.H, g.D), randn(1, L, g.D), randn(1, L, g.D)], [doc]

        def call(fn, lv, cs):
            return fn(lv[0], lv[1], lv[2], cs[0], scale), None
    elif g.op == "lightning_indexer":
        leaves, consts = [randn(1, L, g.Hi, g.Di), randn(1, L, g.Di), randn(1, L, g.Hi)], [doc]

        def call(fn, lv, cs):
            idx, val = fn(lv[0], lv[1], lv[2], cs[0], g.k)
            return val, idx
    elif g.op == "indexer_kl":
        leaves = [randn(1, L, g.Hi, g.Di), randn(1, L, g.Di), randn(1, L, g.Hi)]
        consts = [randn(1, L, g.H, g.D), randn(1, L, g.D), doc]  # attention q, k: the target

        def call(fn, lv, cs):
            return fn(cs[0], cs[1], lv[0], lv[1], lv[2], cs[2], scale), None
    else:
        raise ValueError(f"unknown op {g.op!r}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Problem(leaves, consts, call, time.perf_counter() - t0)


# How sdpa_dense hands the single KV head to SDPA: as an expanded view (no copy) unless a
# fused kernel refused that once, then as a copy per head. Recorded in the sdpa rows.
SDPA_KV = {"copy": False}


def sdpa_dense(q, k, v, doc_ids, scale):
    """torch's fused causal SDPA (flash / cuDNN / memory-efficient, never the materialising
    math kernel) for one document per row, the single KV head expanded to the H query heads.
    doc_ids is ignored: the benchmark packs one document per row."""
    try:
        return _sdpa(q, k, v, scale, SDPA_KV["copy"])
    except RuntimeError:
        if SDPA_KV["copy"]:
            raise
        SDPA_KV["copy"] = True  # e.g. a kernel that rejects a stride-0 head dimension
        return _sdpa(q, k, v, scale, True)


def _sdpa(q, k, v, scale, copy: bool):
    B, L, H, D = q.shape
    kh, vh = k[:, None].expand(B, H, L, D), v[:, None].expand(B, H, L, D)
    if copy:
        kh, vh = kh.contiguous(), vh.contiguous()
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    with sdpa_kernel(fused):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kh, vh, is_causal=True, scale=scale)
    return out.transpose(1, 2)


def backend_fn(op: str, backend: str) -> Callable:
    """The backend's function itself: called directly, so the registry's device check does
    not stop the cuda-only Triton backends from running on CPU tensors in the interpreter."""
    if backend == "sdpa":
        return sdpa_dense
    return registry.backends(op)[backend].fn


# ---------------------------------------------------------------------------------------------
# The fp32 reference ("truth") and the errors against it


@dataclass
class Truth:
    y: torch.Tensor | None  # fp32 reference output (all rows, or the sampled last rows)
    idx: torch.Tensor | None  # selected indices (indexer), same rows as y
    grads: list[torch.Tensor] | None  # fp32 reference gradients (full reference only)
    rows: int | None  # None: all rows; else the last `rows` query rows only
    note: str


def cotangent(y: torch.Tensor) -> torch.Tensor:
    """Fixed upstream gradient for y: seeded normal values (ones for a scalar), zero where y is
    not finite (the indexer's -inf empty slots)."""
    if y.dim() == 0:
        return torch.ones_like(y)
    gen = torch.Generator(y.device).manual_seed(7)
    g = torch.randn(y.shape, device=y.device, generator=gen)
    return torch.where(torch.isfinite(y), g, 0.0).to(y.dtype)


def _fp32(ts: list[torch.Tensor], grad: bool) -> list[torch.Tensor]:
    return [t.detach().float().requires_grad_(grad) if t.is_floating_point() else t for t in ts]


def full_truth(g: Group, prob: Problem) -> Truth:
    """The reference in float32 on the same inputs, output and gradients. TF32 is switched off
    so that cuBLAS multiplies in full float32."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        leaves = _fp32(prob.leaves, True)
        y, idx = prob.call(backend_fn(g.op, "reference"), leaves, _fp32(prob.consts, False))
        grads = torch.autograd.grad(y, leaves, cotangent(y))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return Truth(y.detach(), idx, [t.detach() for t in grads], None, "all rows, fwd + grads")


def sampled_truth(g: Group, prob: Problem, rows: int, why: str) -> Truth:
    """The reference on the last `rows` query rows only (forward), for shapes whose full
    reference exceeds the memory budget. Exact for per-query ops: sparse attention takes those
    rows' queries and indices; dense attention is sparse attention over every visible key;
    the indexer scores those rows against all keys and selects with the reference's tie rule.
    The KL is one sum over all rows: no sample."""
    note = f"last {rows} query rows, fwd only ({why})"
    if g.op == "indexer_kl":
        return Truth(None, None, None, None, f"not compared ({why})")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lv, cs = _fp32(prob.leaves, False), prob.consts
        L, dev = g.L, lv[0].device
        t = torch.arange(L - rows, L, device=dev)[:, None]  # the sampled query positions
        keys = torch.arange(L, device=dev)[None, :]
        with torch.no_grad():
            if g.op == "sparse_attention":
                y = sparse_reference(lv[0][:, -rows:], lv[1], lv[2], cs[0][:, -rows:], g.D**-0.5)
                return Truth(y, None, None, rows, note)
            if g.op == "dense_attention":
                idx = torch.where(keys <= t, keys, -1)[None]  # [1, rows, L]: all visible keys
                y = sparse_reference(lv[0][:, -rows:], lv[1], lv[2], idx, g.D**-0.5)
                return Truth(y, None, None, rows, note)
            # lightning_indexer: the reference's formula restricted to the sampled rows
            s = torch.einsum("rhd,sd->rhs", lv[0][0, -rows:], lv[1][0]).relu()
            s = torch.einsum("rhs,rh->rs", s, lv[2][0, -rows:]).masked_fill(keys > t, float("-inf"))
            idx = select_topk(s, g.k)
            val = s.gather(-1, idx)
            idx = torch.where(torch.isfinite(val), idx, -1)
            return Truth(val[None], idx[None], None, rows, note)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the finite entries; NaN when a and b are not finite at the same
    places (a kernel's NaN must not hide behind the finite mask)."""
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("nan")
    if not bool(fa.any()):
        return 0.0
    return float((a.float() - b.float())[fa].abs().max())


def index_agreement(mine: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of the reference's selected keys (>= 0) that `mine` selected too, per row of
    [..., K] index tensors (order within a row does not matter)."""
    K = ref.shape[-1]
    ref_sorted = ref.reshape(-1, K).sort(-1).values.contiguous()
    m = mine.reshape(-1, K).contiguous()
    pos = torch.searchsorted(ref_sorted, m).clamp(max=K - 1)
    hit = (ref_sorted.gather(-1, pos) == m) & (m >= 0)
    n_ref = int((ref >= 0).sum())
    return float(hit.sum()) / n_ref if n_ref else 1.0


def errors(y, idx, grads, truth: Truth) -> dict:
    """Errors of one backend's forward output (and gradients, when the full reference ran)."""
    out: dict = {"err_scope": truth.note}
    if truth.y is None:
        return out
    ys = y if truth.rows is None else y[:, -truth.rows :]
    out["max_abs_err"] = max_abs_err(ys.detach(), truth.y)
    if idx is not None and truth.idx is not None:
        mine = idx if truth.rows is None else idx[:, -truth.rows :]
        out["index_agreement"] = index_agreement(mine, truth.idx)
        if out["index_agreement"] < 1.0 and truth.grads is not None:
            out["grad_note"] = "not compared: selections differ from the reference's"
            return out
    if truth.grads is not None:
        abs_errs = [max_abs_err(a, b) for a, b in zip(grads, truth.grads, strict=True)]
        scales = [float(b.abs().max()) or 1.0 for b in truth.grads]
        out["max_abs_err_grad"] = max(abs_errs)
        out["max_rel_err_grad"] = max(e / s for e, s in zip(abs_errs, scales, strict=True))
    return out


# ---------------------------------------------------------------------------------------------
# One group


@dataclass
class Settings:
    ref_budget_gib: float
    sample_rows: int
    peak_tflops: float  # measured bf16 matmul rate
    peak_tf32_tflops: float


def run_group(g: Group, device: torch.device, dtype: torch.dtype, timer: Timer,
              cfg: Settings) -> list[dict]:  # fmt: skip
    """Every backend of the group's op on the same inputs -> one row per backend."""
    t_group = time.perf_counter()
    prob = make_problem(g, device, dtype)
    est = estimate_bytes(g.case("reference"))
    over = est > cfg.ref_budget_gib * GIB
    why = f"reference est. {est / GIB:.3g} GiB > budget {cfg.ref_budget_gib:g} GiB"
    truth = _guarded_truth(g, prob, over, why, cfg, timer)
    rows = []
    for backend in BACKENDS[g.op]:
        row = {"group": g.name, **g.case(backend), "dtype": str(dtype).removeprefix("torch."),
               "setup_s": prob.setup_s}  # fmt: skip
        if backend == "reference" and over:
            row["skipped"] = why
        else:
            row.update(_run_backend(g, backend, prob, truth, timer, cfg))
        rows.append(row)
        _free(timer)
    del prob, truth
    _free(timer)
    for r in rows:
        r["group_s"] = time.perf_counter() - t_group
    return rows


def _guarded_truth(g, prob, over, why, cfg, timer) -> Truth:
    try:
        if over:
            return sampled_truth(g, prob, min(cfg.sample_rows, g.L), why)
        return full_truth(g, prob)
    except torch.cuda.OutOfMemoryError:
        _free(timer)
        return Truth(None, None, None, None, "not compared: the fp32 reference ran out of memory")
    except Exception as e:  # noqa: BLE001  (recorded in the rows, the run goes on)
        _check_device(timer, e)
        return Truth(None, None, None, None, f"not compared: reference failed: {_short(e)}")


def _run_backend(g, backend, prob, truth, timer, cfg) -> dict:
    fn = backend_fn(g.op, backend)
    try:
        with torch.no_grad():
            y0, _ = prob.call(fn, prob.leaves, prob.consts)
        gy = cotangent(y0)  # same values for every backend (seeded), masked like this output
        del y0
        leaves = [t.detach().requires_grad_(True) for t in prob.leaves]

        def fwd():
            with torch.no_grad():
                return prob.call(fn, prob.leaves, prob.consts)

        def fwd_bwd():
            y, idx = prob.call(fn, leaves, prob.consts)
            return y, idx, torch.autograd.grad(y, leaves, gy)

        row = {"fwd_ms": timer.median_ms(fwd), "fwd_bwd_ms": timer.median_ms(fwd_bwd)}
        row["peak_fwd_mib"] = timer.peak(fwd)[1] if timer.cuda else None  # no call on CPU
        (y, idx, grads), row["peak_fwd_bwd_mib"] = timer.peak(fwd_bwd)
        row.update(errors(y, idx, grads, truth))
        if backend == "sdpa":
            row["sdpa_kv"] = "copied per head" if SDPA_KV["copy"] else "expanded view"
    except torch.cuda.OutOfMemoryError as e:
        _free(timer)
        return {"error": f"out of memory: {_short(e)}"}
    except Exception as e:  # noqa: BLE001  (recorded in the row, the run goes on)
        _check_device(timer, e)
        return {"error": _short(e)}
    f, fb = flops(g.case(backend))
    row["tflops_fwd"] = f / (row["fwd_ms"] * 1e-3) / 1e12
    row["tflops_fwd_bwd"] = fb / (row["fwd_bwd_ms"] * 1e-3) / 1e12
    row["frac_bf16_peak_fwd"] = row["tflops_fwd"] / cfg.peak_tflops
    row["frac_bf16_peak_fwd_bwd"] = row["tflops_fwd_bwd"] / cfg.peak_tflops
    row["frac_tf32_peak_fwd_bwd"] = row["tflops_fwd_bwd"] / cfg.peak_tf32_tflops
    return row


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _check_device(timer: Timer, e: BaseException) -> None:
    """After a failure, raise DeviceBroken if the CUDA context no longer works."""
    if not timer.cuda:
        return
    try:
        torch.cuda.synchronize(timer.device)
        torch.zeros(1, device=timer.device).add_(1).item()
    except Exception as again:  # noqa: BLE001
        raise DeviceBroken(f"{_short(e)}; then {_short(again)}") from e


def _free(timer: Timer) -> None:
    gc.collect()
    if timer.cuda:
        torch.cuda.empty_cache()

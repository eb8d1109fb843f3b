"""benchmarks/gpu/triton_ops.py end to end in its smoke mode: tiny shapes, the Triton kernels
in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), in a subprocess (Triton reads the
variable once, at import, so it cannot be switched inside this process).

The reference memory budget is set between the two smoke lengths, so L = 48 is checked
against the full float32 reference (output and gradients) and L = 96 against the sampled last
query rows (the reference itself not run). Tolerance: float32 on both sides, different
summation order (measured errors are ~5e-7).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wanka.bench.ops import estimate_bytes, flops

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "triton_ops.py"
TOL = 1e-4
ROWS = 32  # --sample-rows
BACKENDS = {
    "sparse_attention": {"triton", "reference"},
    "dense_attention": {"triton", "sdpa", "reference"},
    "lightning_indexer": {"triton", "reference"},
    "indexer_kl": {"chunked", "reference"},
}
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench") / "smoke.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["TRITON_INTERPRET"] = "1"
    # No time budget: completeness is the subject, and a loaded machine ran past the default.
    cmd = [sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(out),
           "--ref-budget-gib", "0.00025", "--sample-rows", str(ROWS),
           "--budget-s", "100000"]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(out.read_text()), out.with_suffix(".md").read_text(), r.stdout


@needs_triton
def test_every_op_and_backend_ran(smoke):
    doc, _, _ = smoke
    assert doc["complete"] and not doc["not_run"] and doc["triton_interpret"]
    assert not doc["timing_valid"] and "meaningless" in doc["note"]
    assert doc["matmul_peak"]["tflops"] > 0 and doc["matmul_peak_tf32"]["tflops"] > 0
    seen = {(r["op"], r["backend"], r["L"], r.get("pattern")) for r in doc["cases"]}
    for op, backends in BACKENDS.items():
        patterns = ["realistic", "random"] if op == "sparse_attention" else [None]
        for b in backends:
            for L in (48, 96):
                assert all((op, b, L, p) in seen for p in patterns), (op, b, L)
    for r in doc["cases"]:
        assert "error" not in r, r
        if r["L"] == 96 and r["backend"] == "reference":
            assert "budget" in r["skipped"]  # over the memory budget: not run, and said so
            continue
        assert "skipped" not in r, r
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["tflops_fwd_bwd"] > 0
        assert r["frac_bf16_peak_fwd_bwd"] > 0


@needs_triton
def test_errors_are_finite_and_small(smoke):
    doc, _, _ = smoke
    measured = [r for r in doc["cases"] if "skipped" not in r]
    for r in measured:
        if r["L"] == 48:  # the full float32 reference: output and gradients
            assert r["err_scope"].startswith("all rows"), r
            grad = r["max_rel_err_grad"]
        elif r["op"] == "indexer_kl":  # one sum over all rows: no sample to compare
            assert "max_abs_err" not in r and r["err_scope"].startswith("not compared"), r
            continue
        else:
            assert r["err_scope"].startswith(f"last {ROWS} query rows"), r
            grad = 0.0
        err = r["max_abs_err"]
        assert isinstance(err, float) and math.isfinite(err) and err < TOL, r
        assert isinstance(grad, float) and math.isfinite(grad) and grad < TOL, r
        if r["op"] == "lightning_indexer":
            assert r["index_agreement"] == 1.0, r


@needs_triton
def test_table_and_progress_lines(smoke):
    doc, table, stdout = smoke
    assert "| op | L | k |" in table and "% of bf16 peak" in table
    assert "meaningless" in table and "meaningless" in stdout
    body = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(body) == 1 + len(doc["cases"])  # header + one line per row
    assert sum("skipped: reference est." in line for line in body) == 5


def test_refuses_interpreter_on_cuda():
    """Timing the interpreter on a GPU would be meaningless: it says so instead (no import)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick"], env=env, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "TRITON_INTERPRET=1 is set" in r.stderr


def test_indexer_kl_flops_and_reference_memory():
    """The bench/ops.py branches the GPU script added for indexer_kl."""
    case = dict(op="indexer_kl", backend="reference", L=1024, H=16, D=64, Hi=4, Di=32)
    f, fb = flops(case)
    pairs = 1024 * 1025 / 2
    assert f == 2 * pairs * (16 * 64 + 4 * 32) and fb == f + 4 * pairs * 4 * 32
    assert estimate_bytes({**case, "L": 2048}) == 4 * estimate_bytes(case) > 0

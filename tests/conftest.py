import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; triton reads this
# once, when first imported, so it is set before any test module imports wanka.ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_op_choices():
    """The op registry caches which backend each op uses (fixed in a real process); tests fake
    vendor libraries and availability, so every test starts and ends with a fresh choice."""
    from wanka.ops import registry

    registry.reset_choices()
    yield
    registry.reset_choices()


# Tests that measure time or CPU, or use machine-wide state (the cluster's namespaces, a
# whole-job supervisor with injected faults, /dev/shm limits): `make test` runs them one at a
# time, after the rest ran two at a time (pytest-xdist), so that a neighbour's load never
# decides their outcome. The other CLI tests (train, generate, export) run two at a time.
SERIAL_DIRS = {"cluster", "lab_redteam"}
SERIAL_FILES = {
    "test_resilience_cli.py", "test_run_dir_safety.py", "test_disk_full.py", "test_post_cli.py",
    "test_lab_cli.py", "test_bench_cp_cli.py", "integration/test_bench_post.py",
    "test_fuzz_inputs.py",
    "test_bench.py", "test_bench_comm.py", "test_bench_cp.py", "test_bench_moe.py",
    "test_bench_ops.py", "test_bench_variants.py", "test_chaos_disk.py", "test_drill_cleanup.py",
    "test_gpu_train_smoke.py", "test_hang_grace.py",
    "test_lab_cheats.py", "test_lab_evaluator.py", "test_lab_integrity.py", "test_lab_llm.py",
    "test_lab_redteam.py", "test_lab_sandbox.py", "test_lab_search.py",
    "test_lab_store_report.py", "test_memory_estimate.py", "test_resilience.py",
    "test_run_lock.py", "test_snapshot_full_shm.py", "test_preflight_live.py", "test_snapshot.py",
    "test_cluster_edges.py",
}  # fmt: skip
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.path.resolve().relative_to(TESTS)
        named = rel.name in SERIAL_FILES or "/".join(rel.parts[-2:]) in SERIAL_FILES
        if SERIAL_DIRS.intersection(rel.parts[:-1]) or named:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """A test (or code it runs in-process, e.g. a CLI's main) that leaves autograd off would
    break whichever test runs next on its worker: name the leaking test instead."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("autograd was left disabled (use torch.no_grad() as a context)")

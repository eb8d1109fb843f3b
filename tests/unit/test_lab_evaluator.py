"""The lab evaluator: structured feedback for every way a candidate can fail, and a correct
verdict with side-by-side timings for an honest one."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from wanka.lab.evaluator import EvalConfig, compare, evaluate
from wanka.lab.task import Shape
from wanka.lab.tasks import get_task

FAST = EvalConfig(timeout_s=60, repeats=3)


def small_rmsnorm(mode: str = "fwd_bwd"):
    t = get_task("rmsnorm-cpu")
    return dataclasses.replace(
        t, mode=mode, grad_inputs=t.grad_inputs if mode == "fwd_bwd" else (),
        shapes=(Shape("a", {"N": 16, "D": 64}), Shape("b", {"N": 7, "D": 40})),
        timing_shape=Shape("t", {"N": 512, "D": 256}),
        held_out=(Shape("h", {"N": 5, "D": 24}),), held_out_timing=Shape("ht", {"N": 300, "D": 200}),
    )  # fmt: skip


REF = "from wanka.lab.tasks.rmsnorm import reference\n"


def test_honest_candidate_is_correct_and_timed_against_the_baseline():
    task = small_rmsnorm()
    fb = evaluate(task, task.space.render({"impl": "native", "backward": "manual", "rows": 0,
                                           "inv": "rsqrt"}), FAST)  # fmt: skip
    assert fb.status == "correct", fb.message
    assert (
        fb.time_s > 0
        and fb.baseline_s > 0
        and fb.speedup == pytest.approx(fb.baseline_s / fb.time_s)
    )
    assert len(fb.details["times_s"]) == FAST.repeats
    assert fb.details["roofline_s"] < fb.time_s


def test_wrong_result_names_the_output_and_the_error():
    src = REF + "def kernel(x, weight, eps):\n    return reference(x, weight, eps) * 1.01\n"
    fb = evaluate(small_rmsnorm(), src, FAST)
    assert fb.status == "incorrect" and "out: max abs error" in fb.message


def test_wrong_gradient_is_caught():
    src = (
        REF
        + """import torch
def kernel(x, weight, eps):
    y = reference(x, weight, eps)
    return y + (x - x.detach()) * 0.5  # same values, wrong dx
"""
    )
    fb = evaluate(small_rmsnorm(), src, FAST)
    assert fb.status == "incorrect" and "grad_x" in fb.message


def test_nan_never_passes_even_where_tolerance_would():
    src = (
        REF
        + """def kernel(x, weight, eps):
    y = reference(x, weight, eps)
    y[0, 0] = float('nan')
    return y
"""
    )
    fb = evaluate(small_rmsnorm("fwd"), src, FAST)
    assert fb.status == "incorrect" and "NaN" in fb.message


def test_detached_output_is_rejected_when_backward_is_in_scope():
    src = REF + "def kernel(x, weight, eps):\n    return reference(x, weight, eps).detach()\n"
    fb = evaluate(small_rmsnorm(), src, FAST)
    assert fb.status == "rejected" and fb.flags == ["no_graph"]


def test_import_error_and_exception_come_back_with_a_trimmed_traceback():
    fb = evaluate(small_rmsnorm(), "import torch\nraise ImportError('no such thing')\n",
                  dataclasses.replace(FAST, static_policy=False))  # fmt: skip
    assert fb.status == "import_error" and "no such thing" in fb.message
    assert "candidate.py" in fb.details["traceback"]
    fb = evaluate(
        small_rmsnorm(), "def kernel(x, weight, eps):\n    return x.reshape(3, -1, 7)\n", FAST
    )
    assert fb.status == "error" and "RuntimeError" in fb.message


def test_syntax_error_is_reported_by_the_policy_or_the_import():
    fb = evaluate(small_rmsnorm(), "def kernel(x:\n", FAST)
    assert fb.status == "policy" and "syntax error" in fb.message
    fb = evaluate(
        small_rmsnorm(), "def kernel(x:\n", dataclasses.replace(FAST, static_policy=False)
    )
    assert fb.status == "import_error" and "SyntaxError" in fb.message


def test_time_out_kills_the_candidate():
    src = "def kernel(x, weight, eps):\n    while True:\n        pass\n"
    fb = evaluate(small_rmsnorm(), src, dataclasses.replace(FAST, timeout_s=3))
    assert fb.status == "timeout" and "3 s" in fb.message


def test_crash_of_the_candidate_process_is_feedback_not_an_exception():
    src = "import ctypes\ndef kernel(x, weight, eps):\n    return ctypes.string_at(0)\n"
    assert evaluate(small_rmsnorm(), src, FAST).status == "policy"
    fb = evaluate(small_rmsnorm(), src, dataclasses.replace(FAST, static_policy=False))
    assert fb.status == "crash" and "signal" in fb.message


def test_memory_limit_applies_to_the_candidate():
    src = "import torch\ndef kernel(x, weight, eps):\n    return torch.ones(1 << 31, 4)\n"
    fb = evaluate(small_rmsnorm(), src, dataclasses.replace(FAST, memory_gib=3))
    assert not fb.correct
    assert "memory" in (fb.message + fb.details.get("traceback", "")).lower()


def test_cpu_spent_between_calls_is_rejected():
    """A helper thread that burns CPU while the candidate is not being called (precomputing,
    or slowing the baseline down on a shared core) shows in the process's CPU clock."""
    src = REF + (
        "import _thread\n"
        "def _burn():\n"
        "    x = 0\n"
        "    while True:\n"
        "        x += 1\n"
        "_thread.start_new_thread(_burn, ())\n"
        "def kernel(x, weight, eps):\n"
        "    return reference(x, weight, eps)\n"
    )
    fb = evaluate(small_rmsnorm("fwd"), src, dataclasses.replace(FAST, static_policy=False))
    assert fb.status == "rejected" and "cpu" in fb.flags, fb.summary()


def test_honest_verdict_records_how_it_was_measured():
    """Every verdict says whether the candidate was isolated; a timed one which clock it
    used and how much CPU the candidate's process spent inside and outside its calls."""
    from wanka.lab import sandbox

    fb = evaluate(small_rmsnorm("fwd"), REF + "kernel = reference\n", FAST)
    assert fb.correct, fb.summary()
    iso = fb.details["isolation"]
    assert iso == "sandbox" if sandbox.unavailable_reason() is None else iso.startswith("none")
    assert fb.details["clock"] == "cpu"  # single-thread CPU task
    assert 0 < fb.details["cpu_in_calls_s"] <= 1.15 * fb.details["timed_wall_s"] + 0.02
    assert abs(fb.details["cpu_outside_calls_s"]) < 0.02


def test_isolate_true_without_a_sandbox_is_unavailable(monkeypatch):
    from wanka.lab import servers

    monkeypatch.setattr(servers.Zygote, "isolation_unavailable", classmethod(lambda c: "no root"))
    fb = evaluate(small_rmsnorm("fwd"), REF + "kernel = reference\n",
                  dataclasses.replace(FAST, isolate=True))  # fmt: skip
    assert fb.status == "unavailable" and "no root" in fb.message
    fb = evaluate(small_rmsnorm("fwd"), REF + "kernel = reference\n", FAST)  # auto: falls back
    assert fb.correct and fb.details["isolation"] == "none (no root)"


def test_compare_rules():
    r = torch.tensor([1.0, float("-inf"), 2.0])
    ok, _, err = compare((r,), (r.clone(),), ["out"], 1e-5, 1e-5)
    assert ok and err == 0.0
    ok, msg, _ = compare((r,), (torch.tensor([1.0, 0.0, 2.0]),), ["out"], 1e-5, 1e-5)
    assert not ok and "infinities" in msg
    ok, msg, _ = compare(
        (r,), (torch.tensor([1.0, float("-inf"), float("nan")]),), ["out"], 1e9, 1e9
    )
    assert not ok and "NaN" in msg
    ok, msg, _ = compare((r,), (r.double(),), ["out"], 1e-5, 1e-5)
    assert not ok and "expected torch.float32" in msg
    i = torch.tensor([3, -1])
    assert not compare((i,), (torch.tensor([3, 0]),), ["idx"], 1, 1)[0]


TINY = {
    "sparse_attention-triton": Shape("t", {"B": 1, "L": 24, "K": 8, "H": 2, "D": 16}),
    "dense_attention-triton": Shape("t", {"B": 1, "L": 40, "H": 2, "D": 16, "docs": 2}),
    "rmsnorm-triton": Shape("t", {"N": 10, "D": 48}),
}


def test_indexer_scores_must_stay_with_their_keys():
    """The indexer's KL pairs each selected key with its score: indices re-sorted by key with
    the scores left in score order select the right set and the right multiset of scores, and
    are wrong (found by an attacker: it passed as correct, held-out included)."""
    from wanka.lab.task import Tolerance

    task = get_task("lightning_indexer-cpu")
    gen = torch.Generator().manual_seed(0)
    inputs = task.make_inputs({"B": 1, "L": 24, "Hi": 2, "Di": 8, "K": 6, "docs": 2}, gen)
    ref = task.reference_fn()(*inputs.values())
    tol = Tolerance(1e-5, 1e-5)
    assert task.compare(ref, ref, inputs, tol)[0]
    unpaired = (ref[0].sort(-1).values, ref[1])
    ok, msg, _ = task.compare(ref, unpaired, inputs, tol)
    assert not ok and "scores" in msg
    ties = (ref[0].flip(-1), ref[1].flip(-1))  # pairs kept, not in descending score order
    ok, msg, _ = task.compare(ref, ties, inputs, tol)
    assert not ok and "descending" in msg


@pytest.mark.parametrize("name", sorted(TINY))
def test_triton_templates_are_correct_under_the_interpreter(name, monkeypatch):
    """Without a GPU the Triton tasks cannot be timed, but their candidates are checked on
    CPU tensors in Triton's interpreter (conftest sets TRITON_INTERPRET=1)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the Triton tasks are timed for real there")
    task = get_task(name)
    assert task.unavailable() is not None  # `wanka lab run` refuses to time it here
    src = task.space.render(dict(task.space.baseline))
    fb = evaluate(task, src, EvalConfig(timing=False, check_sets=1), shapes=(TINY[name],))
    assert fb.status == "correct" and "not timed" in fb.message, fb.message
    wrong = src.replace("def kernel(", "def _real_kernel(")
    wrong += "\n\ndef kernel(*args):\n    return _real_kernel(*args) * 1.5\n"
    fb = evaluate(task, wrong, EvalConfig(timing=False, check_sets=1), shapes=(TINY[name],))
    assert fb.status == "incorrect"


def test_a_reply_describing_one_region_many_times_is_refused_before_it_is_read(tmp_path):
    """A forged reply naming one region K times made the evaluator copy it K times (4.3 GiB
    at K = 40, found by an attacker): the count must be the task's and all outputs together
    may hold no more bytes than the server's buffer. Addresses the server has not mapped, and
    malformed ones, are refused; a good reply is read out of the server's memory."""
    from types import SimpleNamespace

    from wanka.lab.servers import Server
    from wanka.lab.shm import Buffer
    from wanka.lab.verdict import Verdict

    srv = SimpleNamespace(buf=Buffer(tmp_path / "b.shm", 4096, create=True), role="candidate",
                          host_pid=os.getpid(), pidfd=None)  # fmt: skip
    data = torch.arange(1024, dtype=torch.int32).to(torch.uint8)
    whole = {"dtype": "uint8", "shape": [1024], "ptr": data.data_ptr()}
    half = {**whole, "shape": [512], "ptr": data.data_ptr() + 512}
    for outs, count, why in (([whole] * 40, None, "more than the 4096 a reply may hold"),
                             ([whole], 2, "1 outputs, the task has 2"),
                             ([], None, "0 outputs"),
                             ([whole] * 65, None, "at most 64"),
                             ([{**whole, "ptr": 8}], 1, "cannot read"),
                             ([{**whole, "ptr": -5}], 1, "malformed address"),
                             ([{**whole, "ptr": 2**64 - 1}], 1, "malformed address"),
                             ([{**whole, "ptr": "0x10"}], 1, "malformed address"),
                             ([{**whole, "offset": 0}], 1, "malformed tensor description"),
                             ([{**whole, "dtype": ["x"]}], 1, "malformed")):  # fmt: skip
        with pytest.raises(Verdict) as e:
            Server._read(srv, {"outs": outs}, count)
        assert why in e.value.fb.message, e.value.fb.message
    got = Server._read(srv, {"outs": [whole, half]}, 2)
    assert torch.equal(got[0], data) and torch.equal(got[1], data[512:])
    assert got[0].data_ptr() != data.data_ptr()  # a copy, not a view of the server's memory


def test_an_evaluator_that_cannot_read_its_servers_says_so_not_a_cheat(tmp_path):
    """Outputs are read out of the servers' memory: without CAP_SYS_PTRACE over a sandboxed
    server (a container given CAP_SYS_ADMIN only), every candidate, honest ones included,
    was rejected as a protocol breach. The evaluator probes the read first and says the
    environment lacks it ("unavailable")."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("capsh") is None:
        pytest.skip("needs root and capsh to drop CAP_SYS_PTRACE")
    script = tmp_path / "ev.py"
    script.write_text(
        "import dataclasses\n"
        "from wanka.lab.evaluator import EvalConfig, evaluate\n"
        "from wanka.lab.task import Shape\n"
        "from wanka.lab.tasks import get_task\n"
        "t = dataclasses.replace(get_task('rmsnorm-cpu'), shapes=(Shape('a', {'N': 8, 'D': 32}),))\n"
        f"fb = evaluate(t, {REF!r} + 'kernel = reference\\n', EvalConfig(timeout_s=60, timing=False))\n"
        "print(fb.status, '|', fb.message)\n"
    )  # fmt: skip
    r = subprocess.run(["capsh", "--drop=cap_sys_ptrace", "--", "-c",
                        f"{sys.executable} {script}"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    out = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:]
    if "isolation" in out and "unavailable" in out and "CAP_SYS_PTRACE" not in out:
        pytest.skip(f"no sandbox here: {out}")
    assert out.startswith("unavailable |") and "CAP_SYS_PTRACE" in out, out

"""`wanka chaos drill`: one schedule of faults against wanka and against the baseline.

Three runs of the same job and seed, one after the other on this machine:
  reference  wanka, no faults: the final state digest every faulty run must reproduce;
  wanka      under the supervisor, with the schedule injected;
  baseline   what a user has without wanka's resilience: plain torchrun --max-restarts with
             periodic DCP checkpoints (no heartbeats, no snapshots, no NaN guard). Nothing
             detects a hang there: an "operator" kills the job after `operator_timeout_s`
             without progress and resubmits it, as a person watching the job would.
A job that stops on request (SIGTERM, exit 75) is resubmitted at once, in both set-ups.
Per fault: detected, detection latency, time from the fault to the first new productive
step, steps lost; per run: goodput and whether the final state equals the reference.
With `ckpt_fs_mb`, each run's checkpoints live on a tmpfs of that size (mounted for the run,
gone after it), so a disk_full fault fills that and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

from wanka.process_exit import end_with_parent
from wanka.resilience.chaos import (
    ChaosDriver,
    check_fill_allowed,
    fill_cap_bytes,
    parse_schedule,
    remove_ballast,
    small_filesystem,
)
from wanka.resilience.goodput import TimelineWriter, compute_goodput, read_timeline
from wanka.resilience.heartbeat import read_all

DEFAULT_SCHEDULE = ("kill@step=8,rank=1;stop@step=16,rank=0;nan@step=22,rank=1;"
                    "sigterm@step=28;corrupt_ckpt@step=33;node_kill@step=36")  # fmt: skip
EXIT_PREEMPTED = 75
# Faults that show only when the checkpoints are next touched (read after damage, written on
# a full disk): their detection may come after later faults, and only as this cause.
SHOWS_LATER = {"corrupt_ckpt": "checkpoint_corrupt", "truncate_ckpt": "checkpoint_corrupt",
               "disk_full": "checkpoint_write_failed"}  # fmt: skip


def _wanka(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "wanka.cli", *args]


def _summary(run_dir: Path) -> dict:
    p = run_dir / "summary.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def run_wanka(config: str | None, overrides: list[str], nproc: int, run_dir: Path,
              schedule: str, log, cluster_state: str | None = None) -> dict:  # fmt: skip
    """`cluster_state`: run across the nodes of the cluster-in-a-box ("" = the default one),
    `nproc` ranks on each."""
    sets = [*overrides, f'run.dir="{run_dir}"']
    where = [] if cluster_state is None else ["--cluster", *(["--cluster-state", cluster_state] if cluster_state else [])]  # fmt: skip
    argv = _wanka(["train", *([config] if config else []), "--nproc", str(nproc), *where,
                   *sum((["--set", s] for s in sets), []), *(["--chaos", schedule] if schedule else [])])  # fmt: skip
    t0 = time.time()
    submissions = 0
    while True:
        submissions += 1
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        if rc != EXIT_PREEMPTED:
            break
    return {"rc": rc, "wall_s": time.time() - t0, "submissions": submissions}


def run_baseline(config: str | None, overrides: list[str], nproc: int, run_dir: Path,
                 schedule: str, operator_timeout_s: float, max_restarts: int, log,
                 cluster_state: str | None = None) -> dict:  # fmt: skip
    """torchrun --max-restarts, ranks without supervision; faults injected from here. With
    `cluster_state`, one torchrun per node of the cluster-in-a-box at a c10d rendezvous."""
    from wanka.resilience.supervisor import job_id

    sets = [*overrides, f'run.dir="{run_dir}"', "resilience.supervise=false",
            "resilience.snapshot_every=0", "resilience.nan_guard=false",
            "resilience.last_gasp=false"]  # fmt: skip
    hb_dir = run_dir / "resilience" / "hb"
    # torchrun has no hot spares: it runs on the nodes a supervised job with them starts on.
    from wanka.config import load_config

    spare_nodes = load_config(config, overrides).resilience.spare_nodes
    timeline = TimelineWriter(run_dir / "resilience" / "timeline.jsonl", attempt=0)
    driver = None
    t_job, submissions, rc = time.time(), 0, 1
    timeline.event("job", t_job, None)
    while True:
        submissions += 1
        target = ["-m", "wanka.cli", "train", *([config] if config else []),
                  *sum((["--set", s] for s in sets), [])]  # fmt: skip
        # A plain training script dies on a failed checkpoint write (torchrun then restarts it).
        env = {**os.environ, "WANKA_HB_DIR": str(hb_dir), "WANKA_TIMELINE": "1",
               "OMP_NUM_THREADS": "1", "WANKA_CHECKPOINT_FAILURES": "fatal"}  # fmt: skip
        procs = _submit(target, nproc, max_restarts, env, log, cluster_state, submissions,
                        spare_nodes)  # fmt: skip
        if driver is None:
            driver = ChaosDriver(parse_schedule(schedule), run_dir, job_id(run_dir), "/dev/shm/wanka",
                                 timeline, job_pid=procs[0].pid)  # fmt: skip
            if cluster_state is not None:
                from wanka.cluster.nodes import NodeActions

                driver.cluster = NodeActions(cluster_state or None)
        driver.job_pid, driver.job_pids = procs[0].pid, [p.pid for p in procs]
        try:
            stalled = _drive(procs, driver, hb_dir, operator_timeout_s, timeline)
            codes = [p.wait() for p in procs]
            rc = next((c for c in codes if c), 0)
            # A torchrun killed by a signal (its node went): the job is broken; the operator
            # resubmits it (had the other nodes' torchruns waited, the operator's timeout would).
            stalled = stalled or (any(c < 0 for c in codes) and not _summary(run_dir))
        finally:
            driver.close()  # a full disk never outlives the job that was to suffer it
            _kill_ranks(hb_dir)  # a submission leaves no rank behind, however it ended
        if stalled:
            continue  # the operator resubmits
        if rc != EXIT_PREEMPTED and rc != 1 or _summary(run_dir):
            break
        if rc == 1 and not any(
            e["kind"] == "last_gasp" for e in read_timeline(timeline.path)[-50:]
        ):
            break  # out of restarts: the baseline job failed
    timeline.event("job", t_job, time.time())
    return {"rc": rc, "wall_s": time.time() - t_job, "submissions": submissions}


def _submit(target: list[str], nproc: int, max_restarts: int, env: dict, log,
            cluster_state: str | None, submission: int,
            spare_nodes: int = 0) -> list[subprocess.Popen]:  # fmt: skip
    restarts = f"--max-restarts={max_restarts}"
    if cluster_state is None:
        # --standalone: a fresh c10d rendezvous per restart round, as users run single-node jobs
        # (a static --master-port rendezvous can hang on restart: the old round's store keys).
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                restarts, "--standalone", *target]  # fmt: skip
        return [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True, preexec_fn=end_with_parent())]  # fmt: skip
    import uuid

    from wanka.cluster import nodes as nd
    from wanka.cluster.launch import RDZV_PORT, job_nodes, torchrun_argv
    from wanka.cluster.state import require

    st = require(cluster_state or None)
    nodes = job_nodes(st, spare_nodes)
    rdzv_id, port = f"drill-{uuid.uuid4().hex[:8]}", RDZV_PORT + 50 + submission % 50
    return [nd.popen(n, torchrun_argv(st, i, nproc, target, rdzv_id, port, nodes=nodes,
                                      extra=[restarts]),
                     env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                     preexec_fn=end_with_parent())
            for i, n in enumerate(nodes)]  # fmt: skip


def _drive(procs: list[subprocess.Popen], driver: ChaosDriver, hb_dir: Path,
           operator_timeout_s: float, timeline: TimelineWriter) -> bool:  # fmt: skip
    """Inject faults while the baseline runs; kill it if it makes no progress for too long
    (a node whose torchrun died leaves the others waiting at the rendezvous: that too)."""
    last_step, last_change = None, time.time()
    while any(p.poll() is None for p in procs):
        time.sleep(0.05)
        now = time.time()
        beats = read_all(hb_dir)
        newest = max(beats.values(), key=lambda b: b.attempt, default=None)
        beats = {r: b for r, b in beats.items() if newest and b.attempt == newest.attempt}
        driver.poll(beats, now, newest.attempt if newest else 0)
        key = tuple(sorted((b.rank, b.step, b.phase) for b in beats.values()))
        if key != last_step:
            last_step, last_change = key, now
        elif now - last_change > operator_timeout_s:
            timeline.event("fault", last_change, now, cause="hang", detail="operator gave up waiting",
                           injected=True)  # fmt: skip
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _kill_ranks(hb_dir)
            return True
    return False


def _kill_ranks(hb_dir: Path) -> None:
    """SIGKILL every process of this drill's baseline still alive: those whose environment
    carries its WANKA_HB_DIR. torchrun's workers live in sessions of their own, so killing
    torchrun's group can orphan them, and a worker stuck before its first heartbeat is named
    by no heartbeat file."""
    mine = f"WANKA_HB_DIR={hb_dir}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if mine in environ and int(proc.name) != os.getpid():
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def drill(config: str | None, overrides: list[str], nproc: int, schedule: str, out_dir: Path,
          baseline: bool = True, operator_timeout_s: float = 60.0,
          reference: Path | None = None, wanka: bool = True,
          ckpt_fs_mb: int | None = None, cluster_state: str | None = None) -> dict:  # fmt: skip
    """`reference`: a finished fault-free run of the same config to compare with, instead of
    running one (its resolved config must match, or the comparison means nothing).
    `ckpt_fs_mb`: each run's checkpoints on a tmpfs of that many MiB (root on Linux).
    `cluster_state`: every run across the nodes of the cluster-in-a-box ("" = the default
    cluster), `nproc` ranks per node."""
    faults = parse_schedule(schedule)  # bad schedules fail here, in one line
    if not ckpt_fs_mb:  # refuse a disk_full that would fill this disk now, not in a later run
        for f in faults:
            if f.kind == "disk_full":
                check_fill_allowed(out_dir, fill_cap_bytes(f))
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "drill.log", "a")  # noqa: SIM115
    runs: dict[str, dict] = {}
    cs = cluster_state
    if cs is not None:
        from wanka.cluster.state import require

        require(cs or None)  # no cluster up: say so now, in one line
    plan = [("wanka", lambda d: run_wanka(config, overrides, nproc, d, schedule, log, cs))][
        : int(wanka)
    ]
    if reference is None:
        plan.insert(0, ("reference", lambda d: run_wanka(config, overrides, nproc, d, "", log, cs)))
    else:
        _check_reference(Path(reference), config, overrides)
        runs["reference"] = {"digest": _summary(Path(reference)).get("state_digest"),
                             "dir": str(reference)}  # fmt: skip
    if baseline:
        plan.append(("baseline", lambda d: run_baseline(config, overrides, nproc, d, schedule,
                                                        operator_timeout_s, 5, log, cs)))  # fmt: skip
    for name, fn in plan:
        run_dir = out_dir / name
        if run_dir.exists():
            raise ValueError(f"{run_dir} exists: give the drill a fresh --out directory")
        print(f"drill: {name} run in {run_dir}", flush=True)
        ckpt_fs = (
            small_filesystem(run_dir / "checkpoints", ckpt_fs_mb) if ckpt_fs_mb else nullcontext()
        )
        with ckpt_fs:
            try:
                res = fn(run_dir)
            finally:
                remove_ballast(run_dir / "checkpoints")  # whatever happened to the job
        res["digest"] = _summary(run_dir).get("state_digest")
        res["val_loss"] = _summary(run_dir).get("val_loss")
        tl = run_dir / "resilience" / "timeline.jsonl"
        if tl.is_file():
            events = read_timeline(tl)
            g = compute_goodput(events)
            res.update(goodput=g.goodput, wall_timeline_s=g.wall_s, steps_lost=g.steps_lost,
                       breakdown=g.breakdown,
                       injected=injected_faults(events, schedule, run_dir / "resilience" / "chaos"))  # fmt: skip
            # Of the detections judged by a hang limit (a hang, a silent node; not a crash,
            # seen at once from the process's state), how many came within it.
            judged = [r for r in res["injected"] if r["within_limit"] is not None]
            res["within_limit"] = f"{sum(r['within_limit'] for r in judged)}/{len(judged)}"
        runs[name] = res
    ref = runs["reference"]["digest"]
    for res in runs.values():
        res["state_equal"] = res["digest"] is not None and res["digest"] == ref
    result = {"schedule": schedule, "nproc": nproc, "overrides": overrides, "runs": runs,
              "cluster": cs is not None,
              "time": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    (out_dir / "drill.json").write_text(json.dumps(result, indent=1, default=str))
    return result


LIMIT_SLACK_S = 1.0  # the polls (0.05-0.5 s) between a limit passing and the look that sees it


def injected_faults(events: list[dict], schedule: str, marks: Path) -> list[dict]:
    """Per injected fault, from the timeline alone (the same rules for wanka and baseline):
    detected = a fault event (detection) before the next injection; time to productive = from
    the injection to the end of the first step at or past the step it interrupted, in a later
    run of the job; steps lost = steps done before the injection that had to be done again."""
    # A disk_full also logs its release (the fill's window); that is not another injection.
    chaos = [e for e in events if e["kind"] == "chaos" and not e.get("released")]
    injections = [(e["t0"], e["fault"].split("@")[0], e.get("node")) for e in chaos]
    # A node fault that struck a hot spare (no rank of the attempt on it) stops nothing.
    idle = {(e["t0"], e.get("node")) for e in chaos if e.get("training") is False}
    # Faults injected inside a rank (nan, slow) leave a mark file when they fire.
    kinds = {f.id: f.kind for f in parse_schedule(schedule)}
    for p in marks.glob("*.fired") if marks.is_dir() else ():
        if kinds.get(int(p.stem)) in ("nan", "slow"):
            injections.append((p.stat().st_mtime, kinds[int(p.stem)], None))
    injections.sort()
    detections = sorted(
        (e for e in events if e["kind"] == "fault"), key=lambda e: e["t1"] or e["t0"]
    )
    steps = sorted(
        (e for e in events if e["kind"] == "step" and e.get("t1")), key=lambda e: e["t0"]
    )
    rows = []
    # What a fault caused is looked for until the next fault that could cause anything.
    real = [t for t, _, n in injections if (t, n) not in idle]
    for t_inj, kind, node in injections:
        if (t_inj, node) in idle:
            rows.append({"kind": kind, "t": t_inj, "detected": False, "detect_s": None,
                         "limit_s": None, "within_limit": None, "detected_as": None,
                         "node": node, "named_node": None, "training": False,
                         "to_productive_s": None, "steps_lost": 0})  # fmt: skip
            continue
        t_next = next((t for t in real if t > t_inj), float("inf"))
        cause = SHOWS_LATER.get(kind)
        until = float("inf") if cause else t_next
        det = next((d for d in detections if t_inj <= (d["t1"] or d["t0"]) < until
                    and (cause is None or d.get("cause") == cause)), None)  # fmt: skip
        before = [e["step"] for e in steps if e["t0"] < t_inj]
        interrupted = max(before) if before else 0
        after = [e for e in steps if e["t0"] >= t_inj and e["t0"] < t_next]
        done = next((e for e in after if e["step"] >= interrupted), None)
        to_productive = done["t1"] - t_inj if done else None
        if kind == "disk_full" and det is not None:
            # Training never stopped; what counts is how soon it went on after the failed
            # write: the end of the first step begun after the detection.
            t_det = det["t1"] or det["t0"]
            nxt = next((e for e in steps if e["t0"] >= t_det), None)
            to_productive = nxt["t1"] - t_det if nxt else None
        redone = {e["step"] for e in after if e["step"] < interrupted}
        detect_s = (det["t1"] or det["t0"]) - t_inj if det else None
        limit = det.get("limit_s") if det else None
        rows.append({"kind": kind, "t": t_inj, "detected": det is not None,
                     "detect_s": detect_s, "limit_s": limit,
                     # The monitor looks every poll: a hang is named one poll past its limit.
                     "within_limit": None if limit is None or detect_s is None
                     else detect_s <= limit + LIMIT_SLACK_S,
                     "detected_as": det.get("cause") if det else None, "node": node,
                     "named_node": det.get("node") if det else None,
                     "training": True,
                     "to_productive_s": to_productive, "steps_lost": len(redone)})  # fmt: skip
    return rows


def _check_reference(ref: Path, config: str | None, overrides: list[str]) -> None:
    from wanka.config import ConfigError, dump_toml, load_config

    if not _summary(ref).get("state_digest"):
        raise ValueError(f"--reference {ref}: no finished run there (summary.json with a digest)")
    # Both read as configs: a field added since the reference ran takes its default on both
    # sides, so only a value that differs makes the reference unusable.
    try:
        saved = dump_toml(load_config(str(ref / "config.toml"), [f'run.dir="{ref}"'])).splitlines()
    except ConfigError as e:
        raise ValueError(f"--reference {ref}: its config.toml does not read with this wanka ({e}); "
                         "drop --reference to run a new one") from None  # fmt: skip
    want = dump_toml(load_config(config, [*overrides, f'run.dir="{ref}"'])).splitlines()
    diff = [a for a, b in zip(saved, want) if a != b]
    if diff or len(saved) != len(want):
        raise ValueError(f"--reference {ref} was run with another config ({'; '.join(diff[:3])}): "
                         "use the same config and --set values, or drop --reference")  # fmt: skip


def format_drill(result: dict) -> str:
    lines = [f"schedule: {result['schedule']}"]
    for name, r in result["runs"].items():
        if name == "reference":
            continue
        lines.append(f"\n== {name}: goodput {100 * r.get('goodput', 0):.1f}% | wall {r['wall_s']:.1f} s"
                     f" | submissions {r['submissions']} | final state "
                     f"{'== reference' if r['state_equal'] else '!= reference'} | exit {r['rc']}")  # fmt: skip
        nodes = result.get("cluster")  # where the fault struck, and where it was said to be
        lines.append(f"  {'fault':<14}{'node':>5}{'detected':>9}{'as':>25}{'on':>5}{'detect s':>10}"
                     f"{'limit s':>9}{'to productive s':>17}{'steps lost':>12}" if nodes else
                     f"  {'fault':<14}{'detected':>9}{'as':>25}{'detect s':>10}"
                     f"{'limit s':>9}{'to productive s':>17}{'steps lost':>12}")  # fmt: skip
        for f in r.get("injected", []):
            lat, rec, lim = f["detect_s"], f["to_productive_s"], f.get("limit_s")
            where = f"{f.get('node') or '-':>5}" if nodes else ""
            on = f"{f.get('named_node') or '-':>5}" if nodes else ""
            seen = "yes" if f["detected"] else "no" if f.get("training", True) else "spare"
            lines.append(f"  {f['kind']:<14}{where}{seen:>9}"
                         f"{str(f['detected_as'] or '-'):>25}{on}{'-' if lat is None else f'{lat:.2f}':>10}"
                         f"{'-' if lim is None else f'{lim:.1f}':>9}"
                         f"{'-' if rec is None else f'{rec:.2f}':>17}{f['steps_lost']:>12}")  # fmt: skip
        if any(not f.get("training", True) for f in r.get("injected", [])):
            lines.append("  (spare: the node was a hot spare then, training no rank: nothing to "
                         "detect)")  # fmt: skip
    return "\n".join(lines)

"""Cost of one in-memory snapshot (resilience/snapshot.py) on CPU, in-process.

Builds the demo model on 1 gloo rank, runs two training steps (so AdamW state exists), then
times `capture` (a view of the live state) and `SnapshotStore.save` (copy into the mapped slot
and commit), median of repeats, and a training step with and without a snapshot after it.

    .venv/bin/python benchmarks/snapshot_cpu.py [--config configs/demo.toml] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/demo.toml")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    import torch

    torch.set_num_threads(1)
    from wanka.config import load_config
    from wanka.resilience.snapshot import SnapshotStore
    from wanka.train import trainer

    tmp = tempfile.mkdtemp(prefix="wanka-snapbench-")
    shm = tempfile.mkdtemp(prefix="wanka-snapbench-", dir="/dev/shm")
    try:
        cfg = load_config(
            args.config, ["parallel.ep=1", f'run.dir="{tmp}"', "run.tensorboard=false"]
        )
        job = trainer.setup(cfg)
        for step in range(2):
            trainer.train_step(job, step)
        store = SnapshotStore(shm, "bench", "n0", 0, 1, 1, False, "bench")
        state = trainer._snapshot_state(job)
        n_params = sum(p.numel() for p in job.model.parameters())
        result = {
            "params": n_params,
            "capture_ms": _median_ms(lambda: trainer._snapshot_state(job), args.repeats),
            "save_ms": _median_ms(lambda: store.save(3, state), args.repeats),
            "step_s": _median_ms(lambda: trainer.train_step(job, 2), 3) / 1e3,
            "step_plus_snapshot_s": _median_ms(
                lambda: (trainer.train_step(job, 2), store.save(4, trainer._snapshot_state(job))),
                3,
            )
            / 1e3,
        }
        store.close(discard=True)
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()

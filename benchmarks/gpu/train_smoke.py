"""GPU training smoke (issue 12): `wanka train` on one CUDA GPU, bf16, the registry's default
(Triton) backends, 30 steps; tokens/s and MFU against the measured bf16 matmul rate.

On a machine with a CUDA GPU, from the repository root (no install: this checkout's src/ is
put first on sys.path, as benchmarks/gpu/triton_ops.py does):

    python3 benchmarks/gpu/train_smoke.py                 # small, seq 4096, 30 steps
    python3 benchmarks/gpu/train_smoke.py --ac full --seq-len 8192

Without a GPU (CI), the same path on the CPU with the tiny flavor, to keep the script honest:

    .venv/bin/python benchmarks/gpu/train_smoke.py --device cpu --flavor tiny --steps 3

It runs the real trainer in this process (world of one: process group, meshes, FSDP2, the
op registry), so a failure is the trainer's, with its traceback. Measured: bf16 dense matmul
FLOP/s (n = 8192, CUDA events, median of repeats; fp32 on CPU), then the job. Tokens/s is
the median over the steps after the first WARMUP (compilation, autotuning and allocator
warm-up are excluded); MFU = model FLOPs per token (wanka.bench.flops, forward + backward) x
tokens/s / the measured matmul rate. Writes train_smoke.json and train_smoke.md to $OUT when
it is set (the folder the device tool brings back), else to runs/bench/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

WARMUP = 5


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 20) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--flavor", default="small")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ac", default="off", choices=("off", "full", "selective"))
    p.add_argument("--compile", action="store_true")
    p.add_argument("--out", default=None, help="JSON path (default $OUT or runs/bench)")
    args = p.parse_args(argv)
    out = (
        Path(args.out)
        if args.out
        else Path(os.environ.get("OUT") or "runs/bench") / "train_smoke.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_smoke: no CUDA device visible (use --device cpu for the CPU smoke)")
        return 2

    from wanka.bench.flops import flops_per_token
    from wanka.config import load_config
    from wanka.distributed.launch import single_process_env
    from wanka.train.trainer import run

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = matmul_rate(device, dtype, 8192 if device.type == "cuda" else 1024)
    run_dir = Path(tempfile.mkdtemp(prefix="wanka-gpu-smoke-"))
    seq = args.seq_len if device.type == "cuda" else min(args.seq_len, 128)
    overrides = [
        f'model.flavor="{args.flavor}"', f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 4096)}",
        f"train.micro_batch_size={args.micro_batch}", f"train.steps={args.steps}",
        "train.warmup_steps=2", f"train.eval_every={args.steps + 1}", "data.val_batches=1",
        f'train.mixed_precision="{"bf16" if device.type == "cuda" else "fp32"}"',
        f'train.activation_checkpointing="{args.ac}"', f"train.compile={str(args.compile).lower()}",
        f'run.device="{args.device}"', "run.tensorboard=false", f'run.dir="{run_dir}"',
        "checkpoint.enable=false", "resilience.snapshot_every=0",
    ]  # fmt: skip
    cfg = load_config(None, overrides)
    single_process_env()
    t0 = time.perf_counter()
    summary = run(cfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "train" and r["step"] > WARMUP]
    tps = statistics.median(r["tokens_per_s"] for r in steps) if steps else summary["tokens_per_s"]
    fpt = flops_per_token(cfg.model, seq)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "flavor": args.flavor, "seq_len": seq,
        "micro_batch": args.micro_batch, "steps": args.steps, "ac": args.ac,
        "compile": args.compile, "dtype": str(dtype).removeprefix("torch."),
        "matmul_peak_tflops": peak / 1e12, "tokens_per_s": tps,
        "model_tflops": tps * fpt / 1e12, "mfu": tps * fpt / peak,
        "peak_memory_mb": summary["peak_memory_mb"], "final_loss": summary["train_loss"],
        "first_loss": rows[0]["loss"] if rows else None, "wall_s": wall,
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    table = ["| device | flavor | seq | mb | ac | compile | tokens/s | model TFLOP/s | matmul peak TFLOP/s | MFU | peak MB | loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|",
             f"| {result['device']} | {args.flavor} | {seq} | {args.micro_batch} | {args.ac} | {args.compile} "
             f"| {tps:,.0f} | {result['model_tflops']:.2f} | {peak / 1e12:.1f} | {result['mfu']:.1%} "
             f"| {result['peak_memory_mb']:,.0f} | {result['first_loss']:.3f} -> {result['final_loss']:.3f} |"]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())

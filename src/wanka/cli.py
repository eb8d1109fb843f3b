"""The `wanka` command: parses arguments and calls into the packages. Errors in user input
come out as one line naming what is wrong and how to fix it (exit code 2)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from wanka.bench.comm_cli import add_bench_comm_parser
from wanka.bench.cp_cli import add_bench_cp_parser
from wanka.bench.decode import add_bench_decode_parser
from wanka.bench.post import add_bench_post_parser
from wanka.cluster.cli import add_bench_net_parser, add_cluster_parser
from wanka.distributed.launch import RDZV_FLAGS, rdzv_flag_type
from wanka.infer.cli import add_generate_parser
from wanka.interop.cli import add_interop_parsers
from wanka.lab.cli import add_lab_parser
from wanka.launch.cli import add_launch_parser
from wanka.models.model_cli import add_model_args
from wanka.post.cli import add_post_parsers
from wanka.resilience.chaos_cli import add_chaos_parser
from wanka.resilience.check_cli import add_check_parser
from wanka.resilience.nodes_cli import add_clean_parser, add_nodes_parser

DESCRIPTION = """wanka trains mixture-of-experts language models with DeepSeek sparse attention
(DSA) on PyTorch: FSDP2 x expert parallelism, torchrun launch, distributed checkpoints, a
supervisor that recovers from crashed, hung and slow ranks. Runs on CUDA GPUs, Ascend NPUs
and the CPU. Start with `wanka train configs/demo.toml`; bad input exits 2 with one line."""


def _train(args: argparse.Namespace) -> int:
    from wanka.config import load_config
    from wanka.distributed.launch import inside_torchrun

    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc must be 1 or more (got {args.nproc}): the number of ranks "
                         "to start on this node")  # fmt: skip
    cfg = load_config(args.config, args.set)
    threads = os.environ.get("OMP_NUM_THREADS", "1").strip() or "1"
    if not (threads.isdigit() and int(threads) > 0):  # each rank's set_num_threads reads it
        raise ValueError(f"OMP_NUM_THREADS={threads!r} is not a positive whole number (every "
                         "rank would fail to start): unset it, or set e.g. OMP_NUM_THREADS=1")  # fmt: skip
    if args.nproc is None:  # the smallest world the config's degrees fit on this node
        args.nproc = cfg.parallel.smallest_world()
    if inside_torchrun():  # a rank: the `wanka train` that launched it holds the run directory
        return _train_rank(cfg)
    from wanka.train.run_lock import job_start

    rdzv = {k: getattr(args, k) for k in RDZV_FLAGS}
    # Held until the job ends: a second job on this run directory is refused (exit 2).
    with job_start(cfg, rdzv, getattr(args, "argv", None) or ["train"]):
        return _launch_job(args, cfg, rdzv)


def _launch_job(args: argparse.Namespace, cfg, rdzv: dict) -> int:
    from wanka.distributed.launch import launch, single_process_env
    from wanka.distributed.parallel_dims import ParallelDims

    worker = [
        "train",
        *([args.config] if args.config else []),
        *sum((["--set", s] for s in args.set), []),
    ]
    if args.cluster:  # one job across the cluster-in-a-box nodes, torchrun on each
        if cfg.resilience.supervise:
            from wanka.resilience.chaos import parse_schedule
            from wanka.resilience.supervisor import Supervisor

            chaos = parse_schedule(args.chaos) if args.chaos else None
            return Supervisor(cfg, worker, args.nproc, rdzv, chaos,
                              cluster_state=args.cluster_state or "").run()  # fmt: skip
        from wanka.cluster.launch import launch_on_cluster
        from wanka.train.run_lock import launching

        launching()
        return launch_on_cluster(args.nproc, worker, state_dir=args.cluster_state,
                                 spare_nodes=cfg.resilience.spare_nodes)  # fmt: skip
    nnodes = int(str(args.nnodes or 1).split(":")[-1])
    hosts = nnodes  # hot spares included: a fault's node=N numbers every host
    r = cfg.resilience
    if r.supervise and r.control == "store" and nnodes > 1 and r.spare_nodes:  # hot spares
        if r.spare_nodes >= nnodes:
            raise ValueError(f"resilience.spare_nodes={r.spare_nodes} leaves no host to train on: "
                             f"the job has {nnodes} host(s) (--nnodes); set it below that")  # fmt: skip
        nnodes -= r.spare_nodes  # the hosts that train at once
    elif r.spare_nodes and nnodes > 1:  # said, not silently ignored
        print(f"wanka {worker[0]}: resilience.spare_nodes={r.spare_nodes} is ignored: across hosts "
              'hot spares need resilience.control = "store" (and supervise = true); every host '
              "trains", file=sys.stderr)  # fmt: skip
    try:
        ParallelDims.from_config(cfg.parallel, args.nproc * nnodes)
    except ValueError as e:
        fit = max(cfg.parallel.smallest_world() // nnodes, 1)
        try:  # suggest a rank count only where the degrees fit at all
            ParallelDims.from_config(cfg.parallel, fit * nnodes)
        except ValueError:
            raise ValueError(f"{e}; change [parallel]") from None
        raise ValueError(f"{e}; use --nproc {fit} or change [parallel]") from None
    if args.nnodes is None:  # fail here, once, not in N ranks behind torchrun
        from wanka.train.trainer import check_data

        check_data(cfg, args.nproc)
    if cfg.resilience.supervise:
        from wanka.resilience.chaos import parse_schedule
        from wanka.resilience.supervisor import Supervisor

        chaos = parse_schedule(args.chaos, args.nproc * nnodes, hosts) if args.chaos else None
        return Supervisor(cfg, worker, args.nproc, rdzv, chaos).run()
    if args.chaos:  # the supervisor injects faults: without it they would silently not happen
        raise ValueError("--chaos needs the supervisor: drop resilience.supervise=false")
    from wanka.train.run_lock import launching

    launching()  # (the supervisor replaces the start-up handlers itself)
    if args.nproc > 1 or args.nnodes is not None:
        rc = launch(args.nproc, rdzv, worker)
        if rc not in (0, 2):  # 2: a rank already printed the one-line reason
            print(
                f"wanka train: ranks failed (exit {rc}); see {cfg.run.dir}/logs/rank*.log",
                file=sys.stderr,
            )
        return rc
    single_process_env()
    return _train_rank(cfg)


def _train_rank(cfg) -> int:
    """One rank's job (or the whole job, single-process)."""
    from wanka.resilience.supervisor import EXIT_PREEMPTED
    from wanka.resilience.worker import Preempted
    from wanka.train.trainer import run

    try:
        run(cfg)
    except Preempted as e:
        from wanka.resilience.heartbeat import mark_exit

        mark_exit(EXIT_PREEMPTED)
        if os.environ.get("WANKA_SUPERVISED") != "1":  # else the supervisor says it, once
            print(f"wanka train: {e}; run the same command again to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from wanka.data.prepare import main_prepare

    return main_prepare(
        args.inputs, args.out, args.tokenizer, args.val_fraction, args.seed, args.force
    )


def _report(args: argparse.Namespace) -> int:
    from wanka.report import report_main

    return report_main(args.run_dir)


def _bench(args: argparse.Namespace) -> int:
    from wanka.bench.train import bench_train_main

    return bench_train_main(quick=args.quick, out=Path(args.out), steps=args.steps,
                            flavors=args.flavors, nprocs=args.nprocs, ac=args.ac,
                            compile=args.compile, seq_len=args.seq_len, global_batch=args.global_batch)  # fmt: skip


def _bench_memory(args: argparse.Namespace) -> int:
    from wanka.bench.memory import bench_memory_main

    return bench_memory_main(Path(args.out), args.quick, tuple(args.ac.split(",")), args.cp)


def _bench_moe(args: argparse.Namespace) -> int:
    from wanka.bench.moe import bench_moe_main

    return bench_moe_main(Path(args.out), args.quick)


def _bench_ep(args: argparse.Namespace) -> int:
    from wanka.bench.comm_cases import parse_gbit
    from wanka.bench.ep import bench_ep_main
    from wanka.bench.output import check_out, sigterm_as_exit

    gbits = list(parse_gbit(args.gbit))
    check_out(Path(args.out))  # before the runs, not after them
    with sigterm_as_exit():  # the testbed comes down on SIGTERM too
        return bench_ep_main(Path(args.out), gbits, args.quick)


def _bench_ops(args: argparse.Namespace) -> int:
    from wanka.bench.ops import bench_ops_main

    threads = tuple(int(x) for x in args.threads.split(",")) if args.threads else None
    return bench_ops_main(args.quick, Path(args.out), args.budget_gib, threads=threads)


def build_parser() -> argparse.ArgumentParser:
    from wanka import __version__

    p = argparse.ArgumentParser(prog="wanka", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"wanka {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    t = sub.add_parser("train", help="train a model (N local ranks through torchrun)")
    t.add_argument("config", nargs="?", help="TOML job file (defaults when omitted)")
    t.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    t.add_argument("--nproc", type=int, default=None,
                   help="ranks on this node (on each node with --cluster); default: what "
                        "[parallel] needs (dp_shard, or ep when dp_shard = -1)")  # fmt: skip
    t.add_argument("--cluster", action="store_true", help="span the nodes of `wanka cluster up`")
    t.add_argument("--chaos", default="", metavar="SCHEDULE",
                   help="inject faults, e.g. 'kill@step=30,rank=1;stop@step=60' (see wanka chaos)")  # fmt: skip
    t.add_argument(
        "--cluster-state", default=None, help="cluster state dir (default: the testbed's)"
    )
    for flag in RDZV_FLAGS:
        t.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            default=None,
            type=rdzv_flag_type(flag),
            help="passed to torchrun",
        )
    t.set_defaults(fn=_train)
    add_cluster_parser(sub)
    add_check_parser(sub)
    add_nodes_parser(sub)
    add_clean_parser(sub)
    add_chaos_parser(sub)
    add_lab_parser(sub)
    add_generate_parser(sub)
    add_interop_parsers(sub)
    add_launch_parser(sub)
    add_post_parsers(sub)

    d = sub.add_parser("data", help="data tools").add_subparsers(dest="data_cmd", required=True)
    dp = d.add_parser(
        "prepare", help="text/jsonl files (or 'builtin') -> memory-mapped token shards"
    )
    dp.add_argument("inputs", nargs="+", help=".txt files (one document each), .jsonl files "
                    '({"text": ...} per line), folders of them, or builtin')  # fmt: skip
    dp.add_argument("--out", required=True, help="folder for the prepared dataset (data.path)")
    dp.add_argument(
        "--tokenizer", default=None, help="Hugging Face tokenizer.json (default: bytes)"
    )
    dp.add_argument("--val-fraction", type=float, default=0.01,
                    help="share of documents held out (at least 32 kB of text is)")  # fmt: skip
    dp.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    dp.add_argument("--force", action="store_true",
                    help="rebuild --out when it was prepared from other inputs or options")  # fmt: skip
    dp.set_defaults(fn=_data_prepare)

    r = sub.add_parser("report", help="draw a run's loss curves to PNG and summarise it")
    r.add_argument("run_dir", help="a run directory (run.dir of a job)")
    r.set_defaults(fn=_report)

    m = sub.add_parser("model", help="parameter counts and per-device memory estimate")
    add_model_args(m)  # sets fn=model_main

    b = sub.add_parser("bench", help="benchmarks writing JSON").add_subparsers(
        dest="bench_cmd", required=True
    )
    bt = b.add_parser("train", help="tokens/s, step time, memory, MFU: tiny/small x 1/2 ranks")
    bt.add_argument("--quick", action="store_true", help="fewer steps, smaller shapes")
    bt.add_argument("--steps", type=int, default=None, help="steps per case (default: per flavor)")
    bt.add_argument("--out", default="runs/bench/train.json", help="JSON result file")
    bt.add_argument("--flavors", default=None, help="comma list (default tiny,small)")
    bt.add_argument("--nprocs", default=None, help="comma list of rank counts (default 1,2)")
    bt.add_argument("--ac", default="off",
                    help="activation checkpointing modes, comma list of off,full,selective")  # fmt: skip
    bt.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="torch.compile per block; both = eager and compiled side by side")  # fmt: skip
    bt.add_argument(
        "--seq-len", type=int, default=None, help="override every flavor's sequence length"
    )
    bt.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step over all ranks"
    )
    bt.set_defaults(fn=_bench)
    add_bench_net_parser(b)
    add_bench_cp_parser(b)
    add_bench_comm_parser(b)
    add_bench_decode_parser(b)
    add_bench_post_parser(b)
    bm = b.add_parser("memory", help="memory estimate vs measured peak: tiny/small x 1/2 ranks")
    bm.add_argument("--quick", action="store_true", help="tiny only, fewer cases")
    bm.add_argument(
        "--ac",
        default="off",
        help="activation checkpointing modes, comma-separated: off,full,selective",
    )
    bm.add_argument("--cp", action="store_true",
                    help="context parallelism: cp=4 at a 4x longer sequence vs cp=1 (tiny)")  # fmt: skip
    bm.add_argument("--out", default="runs/bench/memory.json", help="JSON result file")
    bm.set_defaults(fn=_bench_memory)
    bmo = b.add_parser("moe", help="MoE layer fwd+bwd: grouped experts vs the per-expert loop")
    bmo.add_argument("--quick", action="store_true", help="smaller dims")
    bmo.add_argument("--out", default="runs/bench/moe.json", help="JSON result file")
    bmo.set_defaults(fn=_bench_moe)
    be = b.add_parser("ep", help="expert all-to-all: flat vs hierarchical vs overlapped, 2 "
                      "nodes x 2 ranks of the cluster-in-a-box (needs root)")  # fmt: skip
    be.add_argument("--gbit", default="1,10", help="inter-node link speeds, comma list")
    be.add_argument("--quick", action="store_true", help="shorter rows, fewer repeats")
    be.add_argument("--out", default="runs/bench/ep.json", help="JSON result file")
    be.set_defaults(fn=_bench_ep)
    bo = b.add_parser("ops", help="attention operators per backend: time, memory, error, FLOP/s")
    bo.add_argument("--quick", action="store_true", help="short lengths only")
    bo.add_argument(
        "--budget-gib", type=float, default=12.0, help="skip cases estimated above this"
    )
    bo.add_argument("--out", default="runs/bench/ops.json", help="JSON result file")
    bo.add_argument("--threads", default="",
                    help="torch thread counts, e.g. 1,4 (default: 1 and all cores)")  # fmt: skip
    bo.set_defaults(fn=_bench_ops)
    _show_defaults(p)
    return p


class _HelpWithDefaults(argparse.HelpFormatter):
    """Shows an option's default after its help, unless there is none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in text
        return text if quiet or not action.option_strings else text + " (default: %(default)s)"


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's help shows each option's default."""
    parser.formatter_class = _HelpWithDefaults
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _show_defaults(child)


def _log_to_files(msg: str, exc_info=None) -> None:
    """Write to the rank's RUN_DIR/logs file (if the job got that far), not to the console."""
    log = logging.getLogger("wanka")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, msg, None, exc_info)
    for h in log.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser


def main(argv: list[str] | None = None) -> int:
    # c10d's C++ warnings (hostname look-ups, "No backend of type 0 found" at shutdown) are
    # noise in normal output; set before torch is imported, inherited by every rank.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None or not hasattr(args, "fn"):  # bare `wanka` or `wanka data`: help
        target = parser if args.cmd is None else _subcommand(parser, args.cmd)
        target.print_help()
        return 0
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the run lock records
    from wanka.config import ConfigError  # no torch import before the input is judged
    from wanka.train.run_lock import StoppedBeforeStart

    try:
        return args.fn(args)
    except StoppedBeforeStart as e:  # SIGTERM between the run lock and the job's own handlers
        print(f"wanka {args.cmd}: {e}", file=sys.stderr, flush=True)
        return 75  # EX_TEMPFAIL, as a job stopped on request: run it again
    except (ConfigError, ValueError, FileNotFoundError) as e:  # ParallelError is a ValueError
        from wanka.resilience.heartbeat import mark_exit

        supervisor_says_it = mark_exit(2, f"{e}")
        _log_to_files(f"{args.cmd}: {e}")
        if not supervisor_says_it:
            print(f"wanka {args.cmd}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_gone():  # `wanka model | head -2`
            from wanka.infer.cli import _stdout_closed

            return _stdout_closed()
        from wanka.resilience.heartbeat import mark_exit

        mark_exit(1)  # died of an error (often a dead peer's), not killed: not the culprit
        # Only rank 0's output reaches the console: keep every rank's traceback in its log.
        _log_to_files(f"{args.cmd} failed", exc_info=sys.exc_info())
        raise
    except KeyboardInterrupt:
        return 130


def _stdout_gone() -> bool:
    """Whether stdout is a pipe nobody reads any more (then a broken pipe is the reader's
    choice, not a failure; another pipe's is)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (OSError, ValueError):
        return False


def entry() -> None:
    """The `wanka` script: main(), then an exit without the interpreter's teardown (see
    wanka/process_exit.py; ~1 s with torch imported, after every command's work is done)."""
    from wanka.process_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()

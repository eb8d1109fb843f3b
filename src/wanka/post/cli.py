"""`wanka distill|rl|sft|draft CONFIG`: post-training from a trained run directory,
on N local ranks through torchrun (or across nodes with torchrun's rendezvous flags)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from wanka.distributed.launch import RDZV_FLAGS, rdzv_flag_type

HELP = {
    "distill": "on-policy distillation from one teacher per prompt domain (MOPD, GKD knobs)",
    "rl": "GRPO policy optimisation with a verifiable reward (e.g. Python that parses)",
    "sft": "supervised fine-tuning on tagged prompts: corpus continuations or teacher samples",
    "draft": "tune the MTP module(s) to draft for their own (frozen) main model: speculative "
    "decoding keeps more drafts",
}


def add_post_parsers(sub) -> None:
    for name, text in HELP.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="TOML job file with a [post] section (see "
                       "docs/POST_TRAINING.md)")  # fmt: skip
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. post.init=runs/base")  # fmt: skip
        p.add_argument("--nproc", type=int, default=1, help="ranks on this node")
        p.add_argument("--chaos", default="", metavar="SCHEDULE",
                       help="inject faults, e.g. 'kill@step=3,rank=1' (see wanka chaos)")  # fmt: skip
        for flag in RDZV_FLAGS:
            p.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None, type=rdzv_flag_type(flag),
                           help="passed to torchrun")  # fmt: skip
        p.set_defaults(fn=_post)


def _post(args: argparse.Namespace) -> int:
    from wanka.config import load_config
    from wanka.distributed.launch import inside_torchrun
    from wanka.distributed.parallel_dims import ParallelDims
    from wanka.post.checks import with_policy_model

    _check_overrides(args.cmd, args.set)
    # Validated once post.init's [model] is in: parallel.ep is judged against its experts.
    cfg = with_policy_model(load_config(args.config, args.set, check=False))
    getattr(_module(args.cmd), f"check_{args.cmd}")(cfg)
    if not inside_torchrun():  # once, and only for a config that is valid (an error: one line)
        _say_unused(args.cmd, args.set)
    if inside_torchrun():
        return _rank(args.cmd, cfg)
    if args.nproc < 1:
        raise ValueError(f"--nproc must be 1 or more (got {args.nproc})")
    nnodes = int(str(args.nnodes or 1).split(":")[-1])
    ParallelDims.from_config(cfg.parallel, args.nproc * nnodes)  # a bad layout: one line, here
    from wanka.resilience.chaos import parse_schedule
    from wanka.train.run_lock import job_start

    chaos = parse_schedule(args.chaos, args.nproc * nnodes, nnodes) if args.chaos else None
    rdzv = {k: getattr(args, k) for k in RDZV_FLAGS}
    # Held until the job ends: a second job on this run directory is refused (exit 2).
    with job_start(cfg, rdzv, getattr(args, "argv", None) or [args.cmd]):
        return _launch(args, cfg, rdzv, chaos)


# [post] keys only some commands read: set for another, they would change nothing.
_ONLY_FOR = {"teachers": ("distill", "sft"), "divergence": ("distill",), "estimator": ("distill",),
             "beta": ("distill",), "on_policy_fraction": ("distill",), "sft_source": ("sft",),
             "samples_per_prompt": ("rl",), "reward": ("rl",), "clip_eps": ("rl",),
             "updates_per_batch": ("rl",), "kl_coef": ("rl",), "speculate": ("draft",),
             "draft_steps": ("draft",)}  # fmt: skip


def _check_overrides(cmd: str, overrides: list[str]) -> None:
    """--set of what this command takes from elsewhere or never reads: said, not dropped
    silently (`wanka sft --set model.dim=64` trained post.init's model; `wanka distill --set
    post.samples_per_prompt=3` changed nothing)."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key.startswith(("model.", "data.")):
            raise ValueError(f"--set {key}: post-training takes [model] and [data] from "
                             "post.init's run (the policy is that model); drop it")  # fmt: skip


def _say_unused(cmd: str, overrides: list[str]) -> None:
    for item in overrides:
        key = item.partition("=")[0].strip()
        name = key.removeprefix("post.")
        if key.startswith("post.") and cmd not in _ONLY_FOR.get(name, (cmd,)):
            print(f"wanka {cmd}: --set {key} changes nothing here (it is for `wanka "
                  f"{' / '.join(_ONLY_FOR[name])}`)", file=sys.stderr)  # fmt: skip


def _launch(args: argparse.Namespace, cfg, rdzv: dict, chaos) -> int:
    from wanka.distributed.launch import launch, single_process_env

    worker = [args.cmd, args.config, *sum((["--set", s] for s in args.set), [])]
    if cfg.resilience.supervise:  # as `wanka train`: restarts, hang detection, drills
        from wanka.resilience.supervisor import Supervisor

        return Supervisor(cfg, worker, args.nproc, rdzv, chaos).run()
    if chaos:
        raise ValueError("--chaos needs the supervisor: drop resilience.supervise=false")
    from wanka.train.run_lock import launching

    launching()  # stop requests are the launcher's (or the job's) from here on
    if args.nproc > 1 or args.nnodes is not None:
        rc = launch(args.nproc, rdzv, worker)
        if rc not in (0, 2):  # 2: a rank already printed the one-line reason
            print(f"wanka {args.cmd}: ranks failed (exit {rc}); see {cfg.run.dir}/logs",
                  file=sys.stderr)  # fmt: skip
        return rc
    single_process_env()
    return _rank(args.cmd, cfg)


def _module(cmd: str):
    if cmd == "distill":
        from wanka.post import distill

        return distill
    if cmd == "sft":
        from wanka.post import sft

        return sft
    if cmd == "draft":
        from wanka.post import draft

        return draft
    from wanka.post import rl

    return rl


def _rank(cmd: str, cfg) -> int:
    import torch.distributed as dist

    from wanka.resilience.heartbeat import mark_exit
    from wanka.resilience.supervisor import EXIT_PREEMPTED
    from wanka.resilience.worker import Preempted

    try:
        result = _module(cmd).main(cfg)
    except Preempted as e:
        mark_exit(EXIT_PREEMPTED)
        if os.environ.get("WANKA_SUPERVISED") != "1":  # else the supervisor says it, once
            print(f"wanka {cmd}: {e}; run the same command again to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    if dist.get_rank() == 0:
        print(json.dumps({"command": cmd, "run_dir": cfg.run.dir, **result}, sort_keys=True))
    dist.destroy_process_group()
    return 0

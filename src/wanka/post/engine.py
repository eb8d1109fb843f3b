"""The models of a post-training job.

The policy trains sharded exactly as in pre-training (FSDP2 x EP through `parallelize`).
Teachers and the RL reference are frozen and sharded the same way (eval mode): they only run
forwards, so FSDP gathers each block's weights for the moment it computes. Generation runs on
a *rollout copy*: one unsharded model per rank that the policy's weights are synced into
before each round of sampling (as RL systems sync a trainer into an inference engine), driven
by wanka/infer's Generator, the same decoder `wanka generate` uses.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from wanka.config.loader import load_config
from wanka.config.schema import JobConfig, ModelConfig
from wanka.distributed.parallel_dims import ParallelDims
from wanka.distributed.parallelize import parallelize
from wanka.infer.load import find_checkpoint, run_tokenizer
from wanka.models.attention import make_ropes
from wanka.models.transformer import Transformer
from wanka.train.checkpoint import complete_checkpoints, model_diff, same_model


def run_config(run_dir: str | Path, role: str) -> JobConfig:
    """The config a run directory was trained with; `role` names it in errors ("teacher for
    code", "post.init")."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise ValueError(f"{role}: {run_dir} is not a run directory (no config.toml): pass the "
                         "run.dir of a finished `wanka train` (or `wanka import`)")  # fmt: skip
    try:
        cfg = load_config(path)
    except ValueError as e:  # else it reads as this job's own config error
        raise ValueError(f"{role}: {path}: {e}: fix that run's config.toml or pick another "
                         "run") from None  # fmt: skip
    tokenizer = run_tokenizer(Path(run_dir), cfg.data.tokenizer)  # found after a move too
    if tokenizer != cfg.data.tokenizer:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    return cfg


def check_has_checkpoint(run_dir: str | Path, role: str) -> None:
    """Before any rank starts: the run directory holds at least one complete checkpoint (its
    files are verified against their checksums when it is loaded)."""
    if not complete_checkpoints(Path(run_dir) / "checkpoints"):
        raise ValueError(f"{role}: {run_dir} has no complete checkpoint: pass a run directory "
                         "with a sound checkpoint (train it first)")  # fmt: skip


def build_sharded(model_cfg: ModelConfig, dims: ParallelDims, device: torch.device,
                  seed: int, param_dtype: torch.dtype | None = None) -> Transformer:  # fmt: skip
    """Meta -> storage -> init -> shard, as pre-training builds its model."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.to_empty(device=device)
    model.init_weights(seed)
    parallelize(model, dims, param_dtype=param_dtype)
    return model


# The checkpoint each run directory (post.init, a teacher) was read from in this job. A job
# reads post.init more than once (rl: the policy, then the KL reference) and every rank reads
# it: each read used to pick the newest checkpoint *then*, so a post.init still training (or
# pruning old checkpoints) in between gave a policy and a reference of different steps, or
# ranks holding shards of different checkpoints, silently. Rank 0 now picks once per job (as
# Checkpointer.newest_sound does for pre-training's init) and every rank and read keeps it.
_chosen: dict[str, Path] = {}


def forget_checkpoints() -> None:
    """A new job (setup()): run directories are looked at afresh."""
    _chosen.clear()


def chosen_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest sound checkpoint of `run_dir` as rank 0 found it at the job's first read
    (a collective: every rank calls it, in the same order, as for the DCP load after it);
    None when there is none. The run's origin record (origin.py) names this one too."""
    key = str(Path(run_dir).resolve())
    if key in _chosen:
        return _chosen[key]
    box: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box = [str(find_checkpoint(Path(run_dir)))]
        except ValueError:  # said by load_weights, on every rank
            box = [None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] is None:
        return None
    _chosen[key] = Path(box[0])
    return _chosen[key]


def load_weights(model: Transformer, run_dir: str | Path, role: str) -> Path:
    """Load the newest sound checkpoint of `run_dir` into a sharded model (DCP reshards from
    whatever layout saved it; optimizer state is not read). Returns the checkpoint's path: the
    same one for every read of `run_dir` in a job, on every rank (chosen_checkpoint)."""
    path = chosen_checkpoint(run_dir)
    if path is None:  # its hint (--checkpoint) is for `wanka generate`, not for here
        found = complete_checkpoints(Path(run_dir) / "checkpoints")
        what = (
            "only damaged checkpoints (checksums do not match)"
            if found
            else "no complete checkpoint"
        )
        raise ValueError(f"{role}: {run_dir} has {what}: pass a run directory with a sound "
                         "checkpoint (train it first)") from None  # fmt: skip
    state = {"model": get_model_state_dict(model), "train": {"model_config": ""}}
    try:
        with warnings.catch_warnings():  # single-process runs: "assuming the intent is ..."
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path))
    # DCP wraps shape / key mismatches in several exception types, CheckpointException (a
    # BaseException, not an Exception) among them: a teacher of another shape, a config.toml
    # edited after training.
    except (Exception, CheckpointException) as e:
        lines = [x.strip() for x in str(e).strip().splitlines() if x.strip()]
        last = lines[-1][:200] if lines else type(e).__name__
        raise ValueError(f"{role}: checkpoint {path} does not fit the model of "
                         f"{run_dir}/config.toml ({last})") from None  # fmt: skip
    saved = state["train"]["model_config"]
    now = json.dumps(dataclasses.asdict(model.cfg), sort_keys=True)
    if saved and not same_model(saved, now):
        raise ValueError(f"{role}: checkpoint {path} was saved with another [model] config than "
                         f"{run_dir}/config.toml ({model_diff(saved, now)})")  # fmt: skip
    set_model_state_dict(model, state["model"])
    return path


def frozen(model: Transformer) -> Transformer:
    """Eval mode, no gradients: a teacher or the RL reference."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class Rollout:
    """One unsharded copy of the policy on this rank, for sampling."""

    def __init__(self, model_cfg: ModelConfig, device: torch.device) -> None:
        with torch.device("meta"):
            self.model = Transformer(model_cfg)
        self.model.to_empty(device=device)
        with torch.no_grad():
            for b in self.model.buffers():
                b.zero_()
            for name, table in make_ropes(model_cfg, device=device).items():
                getattr(self.model, f"rope_{name}").copy_(table)
        self.model.eval()

    @torch.no_grad()
    def sync(self, policy: Transformer) -> None:
        """Copy the policy's current weights in (an all-gather over the policy's meshes, so
        every rank calls it)."""
        full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
        self.model.load_state_dict(full)


def zero_routing_counts(model: Transformer) -> None:
    """Forwards count expert loads for pre-training's bias balancing; post-training keeps the
    router biases it was given, so the counts are dropped."""
    for m in model.moe_layers():
        m.load.zero_()


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

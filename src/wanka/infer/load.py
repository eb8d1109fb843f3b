"""A trained model for inference: the run directory's config and its newest sound checkpoint,
loaded into one unsharded model (DCP reshards whatever FSDP / EP layout saved it)."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from wanka.config.loader import load_config
from wanka.config.schema import JobConfig
from wanka.models.attention import make_ropes
from wanka.models.transformer import Transformer
from wanka.train.checkpoint import (
    Checkpointer,
    _last_line,
    complete_checkpoints,
    model_diff,
    same_model,
    verify,
)


def find_checkpoint(run_dir: Path, checkpoint: str = "latest") -> Path:
    """`checkpoint`: "latest" (the newest one whose files match their manifest) or a path."""
    if checkpoint != "latest":
        path = Path(checkpoint)
        if not path.exists() and (run_dir / "checkpoints" / checkpoint).is_dir():
            path = run_dir / "checkpoints" / checkpoint  # a name as `ls RUN/checkpoints` shows it
        if not path.is_dir():
            why = "a file, not a checkpoint folder" if path.exists() else "no such directory"
            raise ValueError(f"checkpoint {path} is not usable ({why}): pass one of "
                             f"{run_dir / 'checkpoints'}'s step-N folders, or 'latest'")  # fmt: skip
        if (problem := verify(path)) is not None:
            raise ValueError(f"checkpoint {path} is not usable ({problem or 'no such directory'})"
                             ": pass another --checkpoint, or 'latest'")  # fmt: skip
        return path
    found = complete_checkpoints(run_dir / "checkpoints")
    skipped = False
    for path in reversed(found):
        if (problem := verify(path)) is None:
            if skipped:  # which one is used instead, and whose (a teacher's, say)
                print(f"[{run_dir}: using {path.name} instead]", file=sys.stderr)
            return path
        print(f"[{run_dir}: skipping damaged checkpoint {problem}]", file=sys.stderr)
        skipped = True
    what = "only damaged checkpoints" if found else "no complete checkpoint"
    raise ValueError(f"{run_dir} has {what}: train it first (wanka train), or pass --checkpoint")


def run_tokenizer(run_dir: Path, spec: str) -> str:
    """The tokenizer a run trained with: its own copy where it has one (`wanka train` and
    `wanka import` keep RUN_DIR/tokenizer.json, checked against the data's tokenizer), so an
    original moved, deleted or edited since changes nothing; else the file its config names,
    as written (relative to the current folder) or relative to the run directory. Unfound: as
    written, for the loader's own error."""
    if spec == "byte":
        return spec
    own = run_dir / "tokenizer.json"
    if own.is_file():
        return str(own)
    given = Path(spec)
    if not given.exists() and not given.is_absolute() and (run_dir / given).exists():
        return str(run_dir / given)
    return spec


def load_trained(run_dir: str | Path, checkpoint: str = "latest",
                 device: str | torch.device = "cpu") -> tuple[Transformer, JobConfig, Path]:  # fmt: skip
    """-> (model in eval mode, the run's config, the checkpoint loaded)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.toml): pass the run.dir "
                         "of a training job")  # fmt: skip
    cfg = load_config(run_dir / "config.toml")
    tokenizer = run_tokenizer(run_dir, cfg.data.tokenizer)
    if tokenizer != cfg.data.tokenizer:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
    path = find_checkpoint(run_dir, checkpoint)
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    with torch.no_grad():  # buffers: RoPE tables, zeros; weights and expert biases are loaded
        for b in model.buffers():
            b.zero_()
        for name, table in make_ropes(cfg.model, device=device).items():
            getattr(model, f"rope_{name}").copy_(table)
    # The recorded [model] config first: a checkpoint of another model shape is then named by
    # its config difference, not by the first tensor that does not fit.
    now = json.dumps(dataclasses.asdict(cfg.model), sort_keys=True)
    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # a .metadata another torch wrote, or a damaged one
        raise ValueError(f"checkpoint {path}: cannot read its metadata ({_last_line(e)}): "
                         "pass another --checkpoint") from None  # fmt: skip
    if "train.model_config" in keys:
        saved = _load(path, {"train": {"model_config": ""}}, run_dir)["train"]["model_config"]
        if saved and not same_model(saved, now):
            raise ValueError(f"checkpoint {path} was saved with another [model] config than "
                             f"{run_dir}/config.toml ({model_diff(saved, now)})")  # fmt: skip
    _load(path, {"model": model.state_dict()}, run_dir)
    if _in_dense_warmup(cfg, Checkpointer.step_of(path)):
        # The indexer has not been trained to select yet: attend densely at every length.
        for module in model.modules():
            if hasattr(module, "indexer"):
                module.topk = cfg.model.max_seq_len
        print(f"[{path} is from the dense warm-up: decoding with dense attention]", file=sys.stderr)
    return model.eval(), cfg, path


def _load(path: Path, state: dict, run_dir: Path) -> dict:
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        if (stop := _interruption(e)) is not None:
            raise stop from None  # Ctrl-C is the user's, not a checkpoint that does not fit
        raise ValueError(f"checkpoint {path} does not fit the model in {run_dir}/config.toml "
                         f"({_last_line(e)})") from None  # fmt: skip
    return state


def _interruption(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit inside a CheckpointException: DCP wraps whatever
    its read step raises, Ctrl-C included."""
    if not isinstance(e, CheckpointException):
        return None
    for failure, _ in e.failures.values():
        if isinstance(failure, (KeyboardInterrupt, SystemExit)):
            return failure
        if (inner := _interruption(failure)) is not None:
            return inner
    return None


def _in_dense_warmup(cfg: JobConfig, step: int) -> bool:
    t = cfg.train
    return t.phase == "dense_warmup" or step < t.dense_warmup_steps

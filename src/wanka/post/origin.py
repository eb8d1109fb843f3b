"""What a post-training run starts from and is measured against: post.init, the teachers,
the reward, the prompts and the objective's settings. Recorded with every checkpoint (and
in-memory snapshot) of the run; a resume that names another is refused in one line. Without
this, a resume took the new value silently: RL's KL reference and the teachers are reloaded
from their run directories at every start, and `wanka report`'s "gap closed" kept measuring
against the step-0 teacher_eval of the old teachers."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from wanka.config.schema import JobConfig
from wanka.post.checks import parse_teachers
from wanka.train.checkpoint import MARKER, complete_checkpoints

# One recorded setting: [as shown to the user, what it is (compared)].
Entry = list[str]


# Which checkpoint of a run directory a job reads (None: none it can read). A job passes the
# one its loads use (engine.chosen_checkpoint), so that the record names exactly what was
# loaded; without it, the newest complete one.
CheckpointOf = Callable[[str], Path | None]


def newest_complete(run_dir: str) -> Path | None:
    found = complete_checkpoints(Path(run_dir) / "checkpoints")
    return found[-1] if found else None


def run_identity(run_dir: str, checkpoint_of: CheckpointOf = newest_complete) -> Entry:
    """A run directory as the checkpoint it gives (`checkpoint_of`), by content (its
    manifest's checksums): a moved or copied run is the same one; another run, or this one
    trained on since, is not."""
    found = checkpoint_of(run_dir)
    if found is None:
        return [run_dir, str(Path(run_dir).resolve())]
    found = Path(found)
    shown = f"{run_dir} ({found.name})"
    try:
        files = json.loads((found / MARKER).read_text())["files"]
        return [shown, "sha256:" + _sha256(json.dumps(files, sort_keys=True).encode())]
    except (OSError, ValueError, KeyError, TypeError):  # no manifest to go by: its location
        return [shown, str(found.resolve())]


def file_identity(path: str) -> Entry:
    """A prompts file, by content (an edit in place is another prompt set)."""
    try:
        return [path, "sha256:" + _sha256(Path(path).read_bytes())]
    except OSError:
        return [path, str(Path(path).resolve())]


def reward_code_identity(spec: str) -> Entry | None:
    """A user reward ``package.module:function`` by the content of its module's source file
    (found without importing it); None for a built-in, or a module without a readable file."""
    module_name, sep, _ = spec.partition(":")
    if not sep or not module_name:
        return None
    try:
        found = importlib.util.find_spec(module_name)
        path = Path(found.origin) if found and found.origin else None
        data = path.read_bytes() if path and path.suffix == ".py" else None
    except (Exception, SystemExit):  # its parent package failed to import, ...: the reward's
        # own loader names that, as before
        return None
    if data is None:
        return None
    return [f"{spec} (code in {path})", "sha256:" + _sha256(data)]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _plain(value: object) -> Entry:
    return [str(value), str(value)]


def origin(cfg: JobConfig, command: str, used: list[str],
           checkpoint_of: CheckpointOf = newest_complete) -> dict[str, Entry]:  # fmt: skip
    """The record of a `wanka <command>` job whose prompts have the domains `used`; post.init
    (rl) and the teachers as the checkpoint `checkpoint_of` gives (a job: the one it loads).
    Ordered so that a change is named by its cause (post.prompts before the seed of built-in
    prompts, post.divergence before beta)."""
    p = cfg.post
    # RL reads post.init again at every start (its KL reference): by content. The other
    # commands start from it once: by location, so that its run training on meanwhile (a
    # newer checkpoint there) does not stop this one's resume.
    init = (run_identity(p.init, checkpoint_of) if command == "rl"
            else [p.init, str(Path(p.init).resolve())])  # fmt: skip
    out = {"post.init": init}
    if p.prompts == "builtin":
        seed = cfg.train.seed if p.prompt_seed < 0 else p.prompt_seed
        out["post.prompts"] = _plain("builtin")
        out["post.prompt_seed"] = [f"{seed} (train.seed)" if p.prompt_seed < 0 else str(seed),
                                   str(seed)]  # fmt: skip
        out["post.prompt_chars"] = _plain(p.prompt_chars)
    else:
        out["post.prompts"] = file_identity(p.prompts)
    out["post.domains"] = _plain(",".join(sorted(used)))
    # Which prompts are held out (a JSONL file's last ones per domain; built-in training
    # prompts never repeat a held-out one): another count moves prompts between the sets.
    out["post.eval_prompts"] = _plain(p.eval_prompts)
    if command == "distill" or (command == "sft" and p.sft_source == "teachers"):
        out |= _teachers(p.teachers, used, checkpoint_of)
    if command == "distill":
        out["post.divergence"] = _plain(p.divergence)
        out["post.estimator"] = _plain(p.estimator)
        if p.divergence == "jsd":
            out["post.beta"] = _plain(p.beta)
        out["post.on_policy_fraction"] = _plain(p.on_policy_fraction)
    if command == "rl":
        out["post.reward"] = _plain(p.reward)
        code = reward_code_identity(p.reward)
        if code is not None:  # a user's reward: an edit to its module changes what is rewarded
            out["post.reward:code"] = code
        out["post.kl_coef"] = _plain(p.kl_coef)
        # The group: what each sample's reward is compared with (its advantage's baseline).
        out["post.samples_per_prompt"] = _plain(p.samples_per_prompt)
    if command == "sft":
        out["post.sft_source"] = _plain(p.sft_source)
    if command == "draft":  # the drafts per round trained (0 = post.speculate)
        out["post.draft_steps"] = _plain(p.draft_steps or p.speculate)
    return out


def _teachers(spec: str, used: list[str], checkpoint_of: CheckpointOf) -> dict[str, Entry]:
    """One entry per teacher the job loads (keyed post.teachers:DOMAIN), in the order
    distill.Teachers loads them (checkpoint_of may be a collective)."""
    out = {}
    for domain, run_dir in sorted(parse_teachers(spec).items()):
        if domain in used:  # a spare teacher is never loaded
            shown, ident = run_identity(run_dir, checkpoint_of)
            out[f"post.teachers:{domain}"] = [f"{domain}={shown}", ident]
    return out


def origin_change(saved: str | None, now: dict[str, Entry]) -> str | None:
    """One line when a setting of `now` is not what the checkpoint's record `saved` says the
    run started from; None when they agree, or for a checkpoint saved before records (it
    resumes as it did)."""
    try:
        old = json.loads(saved) if saved else {}
    except ValueError:
        old = {}
    for key, (shown, ident) in now.items():
        if not isinstance(old.get(key), list) or len(old[key]) != 2 or old[key][1] == ident:
            continue  # not recorded (an older record, or not used then): nothing to compare
        name, was = key.split(":")[0], old[key][0]
        if was == shown:  # the same name now holds something else
            return (f"{name}={shown} holds other content than when the run started: use a new "
                    "run.dir, or restore it")  # fmt: skip
        return (f"{name} changed from {was} to {shown} since the run started: use a new run.dir, "
                "or set it back")  # fmt: skip
    return None

"""`wanka export RUN_DIR --format hf --out DIR` and `wanka import HF_DIR --out RUN_DIR`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path

SHARD_BYTES = 4 << 30  # safetensors shard size, as transformers' save_pretrained defaults to


def add_interop_parsers(sub) -> None:
    e = sub.add_parser("export", help="write a run's model as a Hugging Face deepseek_v32 "
                       "checkpoint (safetensors + config.json + tokenizer)")  # fmt: skip
    e.add_argument("run_dir", help="a training run's directory")
    e.add_argument("--format", choices=["hf"], default="hf", help="output format")
    e.add_argument("--out", required=True, help="directory to write (must be new or empty)")
    e.add_argument("--checkpoint", default="latest", help="a checkpoint directory, or latest")
    e.add_argument("--force", action="store_true", help="replace a non-empty --out")
    e.set_defaults(fn=_export)
    i = sub.add_parser("import", help="a Hugging Face deepseek_v32 checkpoint as a wanka run "
                       "directory (then: wanka generate / train / export it)")  # fmt: skip
    i.add_argument("hf_dir", help="directory with config.json and model.safetensors")
    i.add_argument("--out", required=True, help="run directory to create")
    i.add_argument("--force", action="store_true", help="replace a non-empty --out")
    i.set_defaults(fn=_import)


def _fresh_dir(path: Path, force: bool) -> None:
    if path.exists() and any(path.iterdir()):
        if not force:
            raise ValueError(
                f"{path} is not empty: pick a new --out, or pass --force to replace it"
            )
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)


def _export(args: argparse.Namespace) -> int:
    from wanka.config.loader import load_config
    from wanka.infer.load import load_trained
    from wanka.interop.hf import check_exportable

    run_dir, out = Path(args.run_dir), Path(args.out)
    if (run_dir / "config.toml").is_file():  # refuse before loading weights
        check_exportable(load_config(run_dir / "config.toml").model)
    model, cfg, ckpt = load_trained(run_dir, args.checkpoint)
    check_exportable(cfg.model)
    _fresh_dir(out, args.force)
    n, note = write_hf(model.state_dict(), cfg.model, cfg.data.tokenizer, out)
    print(f"wrote {out}: {n} tensors from {ckpt}{note}")
    return 0


def write_hf(state_dict: dict, model_cfg, tokenizer: str, out: Path) -> tuple[int, str]:
    """A deepseek_v32 checkpoint of these weights in `out` -> (tensors written, a note)."""
    from wanka.interop.hf import hf_config, to_hf

    tensors = to_hf(state_dict, model_cfg)
    _write_safetensors(tensors, out)
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg), indent=2) + "\n")
    return len(tensors), _write_tokenizer(tokenizer, out)


def _write_safetensors(tensors: dict, out: Path) -> None:
    from safetensors.torch import save_file

    shards, size = [{}], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(spec: str, out: Path) -> str:
    """Byte tokenizer: a byte-level BPE with no merges (token id = byte value), which
    `AutoTokenizer` loads; a Hugging Face tokenizer.json: copied."""
    if spec != "byte":
        shutil.copy(spec, out / "tokenizer.json")
        (out / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}) + "\n"
        )
        return ""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return " (no tokenizer files: `pip install tokenizers` to write the byte tokenizer)"
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30}) + "\n")  # fmt: skip
    return ""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _import(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    from wanka.config.loader import dump_toml
    from wanka.config.schema import DataConfig, JobConfig, RunConfig
    from wanka.interop.hf import from_hf, model_config, read_tensors
    from wanka.models.transformer import Transformer
    from wanka.train.checkpoint import step_dir, write_manifest

    hf_dir, out = Path(args.hf_dir), Path(args.out)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json: pass a Hugging Face checkpoint directory")
    cfg = model_config(json.loads((hf_dir / "config.json").read_text()))
    sd = from_hf(read_tensors(hf_dir), cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        detail = " ".join(str(e).split())[:300]
        raise ValueError(f"{hf_dir} does not match its config.json ({first}: {detail})") from None
    tokenizer = "byte"
    if (hf_dir / "tokenizer.json").is_file() and not _is_byte_tokenizer(hf_dir / "tokenizer.json"):
        tokenizer = str((out / "tokenizer.json").resolve())
    _fresh_dir(out, args.force)
    if tokenizer != "byte":
        shutil.copy(hf_dir / "tokenizer.json", out / "tokenizer.json")
    job = JobConfig(model=cfg, data=DataConfig(tokenizer=tokenizer), run=RunConfig(dir=str(out)))
    (out / "config.toml").write_text(dump_toml(job))
    ck = step_dir(out / "checkpoints", 0)
    model_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    state = {"model": model.state_dict(),
             "train": {"step": 0, "rng": torch.get_rng_state(), "model_config": model_json}}  # fmt: skip
    dcp.save(state, checkpoint_id=str(ck), no_dist=True)
    write_manifest(ck, 0)
    print(f"wrote run directory {out} (model only, step 0): wanka generate {out} --prompt ...")
    return 0


def _is_byte_tokenizer(path: Path) -> bool:
    """Our own export's byte-level tokenizer: 256 tokens, id = byte value, no merges."""
    try:
        model = json.loads(path.read_text())["model"]
        vocab = model["vocab"]
    except (ValueError, KeyError, TypeError):
        return False
    table = _bytes_to_unicode()
    return not model.get("merges") and vocab == {table[b]: b for b in range(256)}

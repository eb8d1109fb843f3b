"""`wanka export RUN_DIR --format hf --out DIR` and `wanka import HF_DIR --out RUN_DIR`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

from wanka.interop.staging import as_os_error, is_staging, staged

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


# What `wanka export` writes: the only files `--force` replaces in an export directory.
_EXPORT_FILES = re.compile(r"config\.json|model(-\d{5}-of-\d{5})?\.safetensors|"
                           r"model\.safetensors\.index\.json|tokenizer(_config)?\.json")  # fmt: skip


def _check_out(out: Path, force: bool, source: Path, kind: str) -> None:
    """Refuse, before anything is read or written, an --out that would lose data: the source
    itself or a folder holding it, a file, or (even with --force) a non-empty folder that is
    not what this command writes (an earlier export; for import, a run directory not in use)."""
    o, src = out.resolve(), source.resolve()
    if o == src or o in src.parents:
        what = "is" if o == src else "holds"
        raise ValueError(
            f"--out {out} {what} {source}, which this command reads: pick another --out"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory: pick a new directory path")
    try:
        names = [p.name for p in out.iterdir()] if out.is_dir() else []
        entries = sorted(n for n in names if not is_staging(n))
    except OSError as e:
        raise ValueError(f"cannot read --out {out}: {e.strerror}") from None
    if not entries:
        return
    if not force:
        raise ValueError(f"{out} is not empty: pick a new --out, or pass --force to replace it")
    if kind == "export":
        other = [n for n in entries if not _EXPORT_FILES.fullmatch(n)]
        if other:
            raise ValueError(f"--force replaces an earlier export only, and {out} also holds "
                             f"{other[0]!r}: pick another --out, or empty it yourself")  # fmt: skip
        return
    _check_replaceable_run(out, entries)


# What wanka writes at the top of a run directory (train, post-training, reports, the
# supervisor, import): the only entries `import --force` replaces, as a run directory's.
_RUN_ENTRIES = re.compile(r"config\.toml|\.config\.toml\.tmp\d+|checkpoints|logs|resilience|"
                          r"tb|metrics\.jsonl|summary\.json|(loss_curve|timeline|post_curves)\.png|"
                          r"post_command|tokenizer\.json|wanka\.lock")  # fmt: skip


def _check_replaceable_run(out: Path, entries: list[str]) -> None:
    """`import --force` deletes --out's entries: only a wanka run directory's (a project folder
    with a config.toml of its own must never go), and only when no job is using it."""
    from wanka.config.loader import load_config
    from wanka.train.run_lock import is_live

    other = [n for n in entries if not _RUN_ENTRIES.fullmatch(n)]
    if other:
        raise ValueError(f"--force replaces a wanka run directory only, and {out} also holds "
                         f"{other[0]!r}, which wanka does not write there: pick another --out, "
                         "or empty it yourself")  # fmt: skip
    if "config.toml" not in entries:
        raise ValueError(f"--force replaces a run directory only, and {out} has no config.toml "
                         f"(it holds {entries[0]!r}): pick another --out, or empty it yourself")  # fmt: skip
    try:
        load_config(out / "config.toml")
    except Exception as e:  # ConfigError, or whatever a foreign TOML file makes _build raise
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"--force replaces a wanka run directory only, and {out}/config.toml "
                         f"is not a wanka config ({detail}): pick another --out, or empty it "
                         "yourself") from None  # fmt: skip
    if is_live(out):
        raise ValueError(f"{out} is in use by a running job (its wanka.lock is held): pick "
                         "another --out")  # fmt: skip


def _export(args: argparse.Namespace) -> int:
    from wanka.config.loader import load_config
    from wanka.infer.load import load_trained
    from wanka.interop.hf import check_exportable

    run_dir, out = Path(args.run_dir), Path(args.out)
    if (run_dir / "config.toml").is_file():  # refuse before loading weights
        check_exportable(load_config(run_dir / "config.toml").model)
    _check_out(out, args.force, run_dir, "export")
    model, cfg, ckpt = load_trained(run_dir, args.checkpoint)
    check_exportable(cfg.model)
    _check_tokenizer(cfg.data.tokenizer, run_dir)
    _check_finite(model.state_dict(), run_dir, ckpt)
    model_cfg, note = _as_decoded(model, cfg.model)
    with staged(out, recheck=lambda: _check_out(out, args.force, run_dir, "export")) as tmp:
        n, more = write_hf(model.state_dict(), model_cfg, cfg.data.tokenizer, tmp)
    print(f"wrote {out}: {n} tensors from {ckpt}{note}{more}")
    _few_index_heads_note(model_cfg)
    return 0


def _check_finite(state_dict: dict, run_dir: Path, ckpt: Path) -> None:
    """A diverged run's NaN/Inf weights are refused before anything is written: the export
    would be useless, and `wanka import` refuses it."""
    from wanka.train.checkpoint import complete_checkpoints

    for name, t in state_dict.items():
        if t.is_floating_point() and not bool(t.isfinite().all()):
            earlier = [p for p in complete_checkpoints(run_dir / "checkpoints")
                       if p.name < ckpt.name]  # fmt: skip
            pick = str(earlier[-1]) if earlier else "DIR (a checkpoint of an earlier step)"
            raise ValueError(f"{ckpt} holds NaN or Inf values in {name!r} (the run diverged?): "
                             f"export an earlier checkpoint with --checkpoint {pick}")  # fmt: skip


# Below this many index heads, ReLU zeros make ties at the indexer's k-th score common.
FEW_INDEX_HEADS = 8


def _few_index_heads_note(model_cfg) -> None:
    """With few index heads transformers' top-k may keep other keys than wanka's at a tie
    (wanka keeps the most recent key): said, as its logits past index_topk can differ."""
    if model_cfg.n_index_heads >= FEW_INDEX_HEADS:
        return
    if model_cfg.index_topk >= model_cfg.max_seq_len:  # every key attended: no top-k to tie
        return
    print(f"[note: n_index_heads is {model_cfg.n_index_heads}: with so few index heads, ties at "
          "the indexer's top-k score are common and transformers breaks them differently from "
          f"wanka (the most recent key), so its logits past index_topk {model_cfg.index_topk} "
          "tokens can differ; see docs/INFERENCE.md, Limits]", file=sys.stderr)  # fmt: skip


def _as_decoded(model, model_cfg) -> tuple:
    """The [model] config of what the loaded model computes, and a note when it is not the
    run's: load_trained decodes a dense-warm-up checkpoint with every key (its indexer is not
    trained to select yet), so the export says index_topk = max_seq_len. Top-k of all keys is
    exactly dense attention in wanka (sparse only above index_topk) and in transformers
    (it keeps min(index_topk, keys) keys)."""
    topk = max((m.topk for m in model.modules() if getattr(m, "indexer", None) is not None),
               default=model_cfg.index_topk)  # fmt: skip
    if topk == model_cfg.index_topk:
        return model_cfg, ""
    note = (f" (a dense warm-up checkpoint: config.json has index_topk {topk}, every key "
            f"attended, not the run's {model_cfg.index_topk})")  # fmt: skip
    return dataclasses.replace(model_cfg, index_topk=topk), note


def _tokenizer_file(spec: str) -> Path:
    """data.tokenizer names a tokenizer.json or its folder (as load_tokenizer reads it)."""
    return Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)


def _check_tokenizer(spec: str, run_dir: Path) -> None:
    """A moved or deleted tokenizer.json is named before anything is written."""
    if spec != "byte" and not _tokenizer_file(spec).is_file():
        raise ValueError(f"{run_dir}'s data.tokenizer {spec} is not a file (moved or deleted?): "
                         f"set data.tokenizer in {run_dir / 'config.toml'} to the run's "
                         "tokenizer.json")  # fmt: skip


def write_hf(state_dict: dict, model_cfg, tokenizer: str, out: Path) -> tuple[int, str]:
    """A deepseek_v32 checkpoint of these weights in `out` -> (tensors written, a note)."""
    from wanka.interop.hf import hf_config, to_hf

    tensors = to_hf(state_dict, model_cfg)
    _write_safetensors(tensors, out)
    (out / "config.json").write_text(json.dumps(hf_config(model_cfg), indent=2) + "\n")
    return len(tensors), _write_tokenizer(tokenizer, out)


def _save_file(tensors: dict, path: Path) -> None:
    """save_file, with its I/O errors (safetensors' own SafetensorError, which a full disk
    raises) as OSErrors, and the file readable as config.json is: save_file makes it 0600,
    which a serving account of another user cannot read."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as e:
        if (err := as_os_error(e)) is None:
            raise
        raise err from None
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it: put it back at once
    os.umask(mask)
    return mask


def _write_safetensors(tensors: dict, out: Path) -> None:
    shards, size = [{}], 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    if len(shards) == 1:
        _save_file(shards[0], out / "model.safetensors")
        return
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _save_file(shard, out / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(spec: str, out: Path) -> str:
    """Byte tokenizer: a byte-level BPE with no merges (token id = byte value), which
    `AutoTokenizer` loads; a Hugging Face tokenizer.json: copied."""
    if spec != "byte":
        # copyfile, not copy: the run's file may be 0600, the export is read by others
        shutil.copyfile(_tokenizer_file(spec), out / "tokenizer.json")
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
    try:
        tok.save(str(out / "tokenizer.json"))
    except Exception as e:  # tokenizers' Rust I/O error (a full disk) is a bare Exception
        if (err := as_os_error(e)) is None:
            raise
        raise err from None
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
    from wanka.interop.hf import check_tensors, from_hf, import_seq_len, model_config, read_tensors
    from wanka.models.transformer import Transformer
    from wanka.train.checkpoint import step_dir, write_manifest

    hf_dir, out = Path(args.hf_dir), Path(args.out)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json: pass a Hugging Face checkpoint directory")
    _check_out(out, args.force, hf_dir, "import")
    try:
        hf = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{hf_dir / 'config.json'} is not readable JSON ({e}): re-download "
                         "or re-export it") from None  # fmt: skip
    try:
        cfg = model_config(hf)
    except ValueError as e:
        raise ValueError(f"{hf_dir}: {e}") from None
    tokenizer = _import_tokenizer(hf_dir, out, cfg.vocab_size)
    tensors = read_tensors(hf_dir)
    cfg = _mtp_present(tensors, cfg)
    try:
        check_tensors(tensors, cfg)
    except ValueError as e:
        hint = _defaults_hint(hf) if str(e).startswith("does not match") else ""
        raise ValueError(f"{hf_dir} {e}{hint}") from None
    sd = from_hf(tensors, cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        detail = " ".join(str(e).split())[:300]
        raise ValueError(f"{hf_dir} does not match its config.json ({first}: {detail})") from None
    job = JobConfig(model=cfg, data=DataConfig(tokenizer=tokenizer, seq_len=import_seq_len(cfg)),
                    run=RunConfig(dir=str(out)))  # fmt: skip
    model_json = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    state = {"model": model.state_dict(),
             "train": {"step": 0, "rng": torch.get_rng_state(), "model_config": model_json}}  # fmt: skip
    with staged(out, recheck=lambda: _check_out(out, args.force, hf_dir, "import")) as tmp:
        if tokenizer != "byte":
            shutil.copy(hf_dir / "tokenizer.json", tmp / "tokenizer.json")
        (tmp / "config.toml").write_text(dump_toml(job))
        ck = step_dir(tmp / "checkpoints", 0)
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(ck), no_dist=True)
        write_manifest(ck, 0)
    print(f"wrote run directory {out} (model only, step 0): wanka generate {out} --prompt ...")
    return 0


def _import_tokenizer(hf_dir: Path, out: Path, vocab_size: int) -> str:
    """The imported run's data.tokenizer: "byte", or its copy of the folder's tokenizer.json.
    Refused: a tokenizer with more tokens than the model has rows (generate would feed it ids
    past the embedding), and no tokenizer.json for a model that is not byte-level (the byte
    tokenizer's 256 ids would mean nothing to it)."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        if vocab_size != 256:
            raise ValueError(f"{hf_dir} has no tokenizer.json, and the byte tokenizer wanka "
                             "would use fits vocab_size 256 only (config.json's is "
                             f"{vocab_size}): put the model's tokenizer.json there")  # fmt: skip
        return "byte"
    byte = _is_byte_tokenizer(path)
    n = 256 if byte else _tokenizer_size(path)
    if n is not None and n > vocab_size:
        raise ValueError(f"{path} has {n} tokens and the model's vocab_size is {vocab_size}: "
                         "this tokenizer is not the model's; put the model's own "
                         "tokenizer.json there")  # fmt: skip
    return "byte" if byte else str((out / "tokenizer.json").resolve())


def _tokenizer_size(path: Path) -> int | None:
    """How many token ids a tokenizer.json uses (its largest id + 1, added tokens included);
    None without the tokenizers package (`wanka generate` then asks for it)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        vocab = Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
    except Exception as e:  # the tokenizers library raises a bare Exception
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        raise ValueError(f"{path} is not a readable tokenizer.json ({detail}): re-download "
                         "it") from None  # fmt: skip
    return max(len(vocab), max(vocab.values(), default=-1) + 1)


def _mtp_present(tensors: dict, cfg):
    """cfg, without the MTP layers config.json names when the file holds none of them
    (transformers' save_pretrained drops them): imported without MTP, said in one line."""
    from wanka.interop.hf import without_absent_mtp

    kept = without_absent_mtp(tensors, cfg)
    if kept.mtp_depth != cfg.mtp_depth:
        print(f"[config.json has num_nextn_predict_layers {cfg.mtp_depth} but the weights hold "
              "no MTP layer (transformers' save_pretrained drops it): importing without MTP]",
              file=sys.stderr)  # fmt: skip
    return kept


def _defaults_hint(hf: dict) -> str:
    """For a tensor error: the keys config.json leaves out, which took transformers' defaults
    (the 671B model's sizes, most likely not this checkpoint's)."""
    from wanka.interop.hf import defaulted_keys

    keys = [k for k in defaulted_keys(hf) if k != "num_nextn_predict_layers"]
    if not keys:
        return ""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return (f" (config.json lacks {', '.join(keys[:3])}{more}: transformers' defaults were "
            "used; give them in config.json)")  # fmt: skip


def _is_byte_tokenizer(path: Path) -> bool:
    """Our own export's byte-level tokenizer: 256 tokens, id = byte value, no merges."""
    try:
        model = json.loads(path.read_text())["model"]
        vocab = model["vocab"]
    except (ValueError, KeyError, TypeError):
        return False
    table = _bytes_to_unicode()
    return not model.get("merges") and vocab == {table[b]: b for b in range(256)}

"""`wanka generate RUN_DIR`: complete prompts with a trained model (KV cache, DSA sparse
attention over the cache, optional MTP speculation), streaming one prompt's text as it comes."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="complete prompts with a trained run (KV cache, "
                       "sparse attention, MTP speculative decoding)")  # fmt: skip
    g.add_argument("run_dir", help="a training run's directory (its config.toml + checkpoints)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE",
                     help="prompts, one per line, or JSONL with a 'prompt' field")  # fmt: skip
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to add per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--speculate", type=int, default=0, metavar="N",
                   help="MTP drafts per step (0 = plain decoding)")  # fmt: skip
    g.add_argument("--eos", type=int, default=None, help="token id that ends a completion")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--checkpoint", default="latest", help="a checkpoint directory, or latest")
    g.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.set_defaults(fn=_generate)


def read_prompts(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no prompts file {p}: pass a text file (one prompt per line)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = p.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{p}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}): save the "
                         "prompts as UTF-8") from None  # fmt: skip
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                prompt = json.loads(line)["prompt"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{p}:{n}: a JSON line needs a 'prompt' field, e.g. "
                                 '{"prompt": "def main("}') from None  # fmt: skip
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{p}:{n}: 'prompt' is {json.dumps(prompt)}: it must be a "
                                 'non-empty string, e.g. {"prompt": "def main("}')  # fmt: skip
            prompts.append(prompt)
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"{p} holds no prompt: one per line")
    return prompts


def _generate(args: argparse.Namespace) -> int:
    for flag in ("max_new_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be 1 or more")
    if args.speculate < 0:
        raise ValueError("--speculate must be 0 (off) or a number of draft tokens")
    import torch

    from wanka.data.tokenizer import load_tokenizer
    from wanka.infer.generate import Generator
    from wanka.infer.load import load_trained
    from wanka.infer.sampling import Sampling

    if args.prompt is not None and not args.prompt:
        raise ValueError('--prompt is empty: give the text to complete, e.g. --prompt "def main("')
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    sampling = Sampling(args.temperature, args.top_p)
    model, cfg, ckpt = load_trained(args.run_dir, args.checkpoint)
    tok = load_tokenizer(cfg.data.tokenizer)
    if args.eos is not None and not 0 <= args.eos < cfg.model.vocab_size:
        raise ValueError(
            f"--eos {args.eos} is not a token id of this model (0..{cfg.model.vocab_size - 1})"
        )
    try:
        encoded = [[int(t) for t in tok.encode(p)] for p in prompts]
    except UnicodeError as e:  # e.g. a --prompt argument that is not valid UTF-8
        raise ValueError(f"a prompt is not valid text ({e.reason}): pass UTF-8 text") from None
    # Every prompt checked before any text is printed: not a failure after half the batches.
    check = Generator(model, sampling, args.speculate, args.seed, args.eos)
    for n, ids in enumerate(encoded):
        try:
            check.check([ids], args.max_new_tokens)
        except ValueError as e:
            where = f"{args.prompts}: prompt {n + 1}" if args.prompts else "--prompt"
            raise ValueError(f"{where}: {e}") from None
    # no_grad as a context, not set_grad_enabled(False): an in-process caller keeps autograd.
    with torch.no_grad():
        return _decode(args, prompts, encoded, model, tok, sampling, ckpt)


def _decode(args, prompts: list[str], encoded: list[list[int]], model, tok, sampling,
            ckpt) -> int:  # fmt: skip
    """Every batch of prompts, streamed or printed; a summary line on stderr."""
    from wanka.infer.generate import Generator

    stream = len(prompts) == 1 and not args.json
    print(f"[{ckpt}]", file=sys.stderr)
    total_tokens, t0, stats = 0, time.perf_counter(), []
    for first in range(0, len(prompts), args.batch_size):
        batch = prompts[first : first + args.batch_size]
        ids = encoded[first : first + args.batch_size]
        gen = Generator(model, sampling, args.speculate, args.seed + first, args.eos)
        printer = _Streamer(tok) if stream else None
        if printer is not None:
            sys.stdout.write(batch[0])
        out = gen.generate(ids, args.max_new_tokens, printer)
        if printer is not None:
            printer.flush()
        for prompt, completion in zip(batch, out):
            text = tok.decode(completion)
            if args.json:
                print(json.dumps({"prompt": prompt, "completion": text, "tokens": len(completion)}))
            elif not stream:
                print(f"{prompt}{text}\n---")
        total_tokens += gen.stats.tokens
        stats.append(gen.stats)
    dt = time.perf_counter() - t0
    line = f"{total_tokens} tokens in {dt:.1f} s ({total_tokens / dt:.1f} tokens/s)"
    if args.speculate:
        rounds = sum(s.rounds for s in stats)
        acc = sum(sum(s.accepted) for s in stats)
        line += f", mean acceptance length {1 + acc / max(rounds, 1):.2f}"
    print(line, file=sys.stderr)
    return 0


class _Streamer:
    """Writes a row's text as tokens arrive, holding back a cut multi-byte character."""

    def __init__(self, tok) -> None:
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, row: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids)
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        sys.stdout.write(text[self.shown : end])
        sys.stdout.flush()
        self.shown = max(self.shown, end)

    def flush(self) -> None:
        text = self.tok.decode(self.ids)
        sys.stdout.write(text[self.shown :] + "\n")
        sys.stdout.flush()

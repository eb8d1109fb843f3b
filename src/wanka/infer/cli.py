"""`wanka generate RUN_DIR`: complete prompts with a trained model (KV cache, DSA sparse
attention over the cache, optional MTP speculation), streaming one prompt's text as it comes."""

from __future__ import annotations

import argparse
import json
import os
import re
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
                     help="prompts, one per line (\\n a newline, \\\\ a backslash), or JSONL "
                     "lines with a 'prompt' field")  # fmt: skip
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


_ESCAPE = re.compile(r"\\([\\n])")
_BOM = b"\xef\xbb\xbf"


def read_prompts(path: str) -> list[str]:
    """Prompts of a text file: one per line (`\\n` a newline, `\\\\` a backslash), or JSONL
    lines with a 'prompt' field. Lines end at "\\n" only (a trailing "\\r" dropped)."""
    p = Path(path)
    if not p.is_file():
        what = (
            "is a folder"
            if p.is_dir()
            else "is not a regular file"
            if p.exists()
            else "does not exist"
        )
        raise FileNotFoundError(f"prompts file {p} {what}: pass a text file (one prompt per line)")
    data = p.read_bytes()
    data = data[len(_BOM) :] if data.startswith(_BOM) else data  # an editor's BOM is no text
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{p}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}): save the "
                         "prompts as UTF-8") from None  # fmt: skip
    # Not str.splitlines(): it also splits at form feeds, U+2028 and the like, which are text.
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    prompts = [_prompt_of(line, f"{p}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ValueError(f"{p} holds no prompt: one per line")
    return prompts


def _prompt_of(line: str, where: str) -> str:
    """One line's prompt: a JSON object's 'prompt', else the line with its escapes undone."""
    if not line.lstrip().startswith("{"):
        return unescape(line)
    try:
        prompt = json.loads(line)["prompt"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{where}: a JSON line needs a 'prompt' field, e.g. "
                         '{"prompt": "def main("}') from None  # fmt: skip
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{where}: 'prompt' is {json.dumps(prompt)}: it must be a "
                         'non-empty string, e.g. {"prompt": "def main("}')  # fmt: skip
    return prompt


def unescape(line: str) -> str:
    """A text line's two escapes: backslash-n is a newline, two backslashes are one backslash;
    any other backslash is kept as it is (so `C:\\temp` needs no escaping, `C:\\\\new` does)."""
    return _ESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else "\\", line)


def _generate(args: argparse.Namespace) -> int:
    for flag in ("max_new_tokens", "batch_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be 1 or more")
    if args.speculate < 0:
        raise ValueError("--speculate must be 0 (off) or a number of draft tokens")
    if not -(2**63) <= args.seed < 2**63:  # what torch's generators take (negatives too)
        raise ValueError(f"--seed {args.seed} is out of range: use -2**63 .. 2**63 - 1")
    # Drafts past the last token a completion may hold are never kept: not drafted at all.
    args.speculate = min(args.speculate, args.max_new_tokens - 1)
    import torch

    from wanka.data.tokenizer import load_tokenizer
    from wanka.infer.generate import Generator, NonFiniteLogits
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
    check = Generator(model, sampling, args.speculate, args.seed, args.eos, tok.vocab_size)
    for n, ids in enumerate(encoded):
        try:
            check.check([ids], args.max_new_tokens)
        except ValueError as e:
            where = f"{args.prompts}: prompt {n + 1}" if args.prompts else "--prompt"
            raise ValueError(f"{where}: {e}") from None
    # no_grad as a context, not set_grad_enabled(False): an in-process caller keeps autograd.
    try:
        with torch.no_grad():
            code = _decode(args, prompts, encoded, model, tok, sampling, ckpt)
        sys.stdout.flush()  # a closed pipe shows here, not in the exit's flush
    except BrokenPipeError:  # `wanka generate ... | head -1`: the reader has what it wanted
        return _stdout_closed()
    except NonFiniteLogits as e:  # the checkpoint's fault: one line, exit 2
        raise ValueError(str(e)) from None
    return code


def _stdout_closed() -> int:
    """Exit quietly as a Unix tool killed by SIGPIPE does (status 128 + 13), with stdout
    pointed at /dev/null so the exit's own flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no file descriptor (e.g. captured in a test)
        pass
    return 141


def _decode(args, prompts: list[str], encoded: list[list[int]], model, tok, sampling,
            ckpt) -> int:  # fmt: skip
    """Every batch of prompts, streamed or printed; a summary line on stderr."""
    from wanka.infer.generate import Generator, mean_acceptance_length

    stream = len(prompts) == 1 and not args.json
    print(f"[{ckpt}]", file=sys.stderr)
    total_tokens, t0, stats = 0, time.perf_counter(), []
    for first in range(0, len(prompts), args.batch_size):
        batch = prompts[first : first + args.batch_size]
        ids = encoded[first : first + args.batch_size]
        gen = Generator(
            model,
            sampling,
            args.speculate,
            (args.seed + first + 2**63) % 2**64 - 2**63,
            args.eos,
            tok.vocab_size,
        )
        printer = _Streamer(tok, batch[0], ids[0]) if stream else None
        out = gen.generate(ids, args.max_new_tokens, printer)
        if printer is not None:
            printer.flush()
        for prompt, prompt_ids, completion in zip(batch, ids, out):
            text = completion_text(tok, prompt_ids, completion)
            if args.json:
                print(json.dumps({"prompt": prompt, "completion": text, "tokens": len(completion)}))
            elif not stream:
                print(f"{prompt}{text}\n---")
        total_tokens += gen.stats.tokens
        stats.append(gen.stats)
    dt = time.perf_counter() - t0
    line = f"{total_tokens} tokens in {dt:.1f} s ({total_tokens / dt:.1f} tokens/s)"
    if args.speculate:
        line += f", mean acceptance length {mean_acceptance_length(stats) or 1.0:.2f}"
    print(line, file=sys.stderr)
    return 0


# Prompt tokens decoded ahead of a completion (completion_text): enough for a decoder to see
# that the completion does not start the text.
_CONTEXT_TOKENS = 8


def completion_text(tok, prompt_ids: list[int], ids: list[int]) -> str:
    """The text `ids` add after the prompt. Not tok.decode(ids): decoders that strip the
    leading space of what they decode (SentencePiece's Metaspace, Llama's Strip) would drop
    the completion's first space ("Hello" + "▁world" -> "Helloworld"). Decoded after the
    prompt's last tokens instead, minus their own text."""
    context = list(prompt_ids[-_CONTEXT_TOKENS:])
    head, full = tok.decode(context), tok.decode(context + list(ids))
    return full[len(head) :] if full.startswith(head) else tok.decode(ids)


class _Streamer:
    """Writes a row's text as tokens arrive, holding back a cut multi-byte character. The
    prompt comes with the first token: a model that fails at once prints nothing."""

    def __init__(self, tok, prompt: str, prompt_ids: list[int]) -> None:
        self.tok, self.ids, self.shown, self.prompt = tok, [], 0, prompt
        self.prompt_ids = prompt_ids

    def __call__(self, row: int, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = completion_text(self.tok, self.prompt_ids, self.ids)
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        self._write(text[self.shown : end])
        self.shown = max(self.shown, end)

    def flush(self) -> None:
        text = completion_text(self.tok, self.prompt_ids, self.ids)
        self._write(text[self.shown :] + "\n")

    def _write(self, text: str) -> None:
        sys.stdout.write(self.prompt + text)
        sys.stdout.flush()
        self.prompt = ""

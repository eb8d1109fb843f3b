"""`wanka bench decode RUN_DIR`: decoding speed of a trained run, plain vs MTP speculation.

Part 1, side by side in one process: completions of held-out prompts (the built-in corpus's
validation documents, never trained on), greedy or sampled, at batch 1 and 8, plain and with N
drafts, alternating `--repeats` times: tokens/s (median), latency per token, acceptance rate
per draft position, mean acceptance length (tokens per verify forward), and the speed-up as the
median of the plain / speculative pairs' ratios with their range. Part 2: one decode step's time after a context of 4k and 16k
tokens (plain, batch 1): DSA reads top-k keys per query, so beyond k the step grows with the
indexer's cheap scan only, not with full attention.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from wanka.bench.output import check_out, write_out


def add_bench_decode_parser(b) -> None:
    d = b.add_parser("decode", help="decoding tokens/s, latency and MTP acceptance of a "
                     "trained run; decode step time vs context length")  # fmt: skip
    d.add_argument("run_dir", help="a training run's directory (e.g. flavor small)")
    d.add_argument("--speculate", type=int, default=2, help="MTP drafts per step")
    d.add_argument("--batches", default="1,8", help="batch sizes, comma list")
    d.add_argument("--prompts", type=int, default=8, help="held-out prompts")
    d.add_argument("--prompt-tokens", type=int, default=128, help="prompt length")
    d.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    d.add_argument("--contexts", default="4096,16384",
                   help="context lengths for the step-time part, comma list ('' = skip)")  # fmt: skip
    d.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (speculation must give plain's exact output); > 0: sampled, "
                   "drafts kept by speculative sampling's rejection rule")  # fmt: skip
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling")
    d.add_argument("--repeats", type=int, default=3,
                   help="plain / speculative runs per batch size, alternating (ABBA...); the "
                   "speed-up is the median of the pairs' ratios")  # fmt: skip
    d.add_argument("--out", default="runs/bench/decode.json", help="JSON result file")
    d.set_defaults(fn=run_bench_decode)


def heldout_prompts(n: int, length: int) -> list[list[int]]:
    """Byte prompts from the starts of the built-in corpus's validation documents."""
    from wanka.data.corpus import builtin_documents, split_documents

    _, val = split_documents(builtin_documents(), 0.01, 0)  # the split `prepare` makes
    out = []
    for doc in val:
        ids = list(doc.text.encode("utf-8"))
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    raise ValueError(f"the validation split has fewer than {n} documents of {length} bytes: "
                     "lower --prompts or --prompt-tokens")  # fmt: skip


def _decode_chunk(model, prompts, speculate: int, new_tokens: int, sampling, seed: int):
    """One Generator over one batch of prompts -> (seconds, outputs, stats)."""
    from wanka.infer.generate import Generator

    t0 = time.perf_counter()
    gen = Generator(model, sampling, speculate=speculate, seed=seed)
    outs = gen.generate(prompts, new_tokens)
    return time.perf_counter() - t0, outs, gen.stats


def _summarise(chunks: list, batch: int, speculate: int) -> dict:
    from wanka.infer.generate import distinct_4grams, mean_acceptance_length

    dt = sum(c[0] for c in chunks)
    outs = [o for c in chunks for o in c[1]]
    stats = [c[2] for c in chunks]
    tokens = sum(s.tokens for s in stats)
    mean_length = mean_acceptance_length(stats)
    drafted = [sum(s.drafted[j] for s in stats) for j in range(speculate)]
    accepted = [sum(s.accepted[j] for s in stats) for j in range(speculate)]
    return {
        "batch": batch,
        "speculate": speculate,
        "seconds": round(dt, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / dt, 2),
        # A row's tokens arrive one forward apart: wall time over the tokens of one row.
        "latency_ms_per_token": round(1e3 * dt / (tokens / batch), 2),
        "acceptance_rate": [round(a / d, 4) if d else None for a, d in zip(accepted, drafted)],
        "mean_acceptance_length": round(mean_length, 3) if mean_length is not None else None,
        "distinct_4grams": distinct_4grams(outs),
        "outputs": outs,
    }


def _decode_pair(model, prompts, batch: int, speculate: int, new_tokens: int, sampling,
                 repeats: int) -> tuple[list[dict], list[dict]]:  # fmt: skip
    """`repeats` runs of every prompt, plain and speculative, interleaved batch by batch in
    alternating order (plain first, then speculative first, ...): a drift in the shared
    machine's speed hits both alike. -> (plain runs, speculative runs), one dict per repeat."""
    plain, sped = [], []
    for r in range(repeats):
        chunks: dict[int, list] = {0: [], speculate: []}
        for n, i in enumerate(range(0, len(prompts), batch)):
            for spec in (0, speculate) if (r + n) % 2 == 0 else (speculate, 0):
                chunks[spec].append(_decode_chunk(model, prompts[i : i + batch], spec,
                                                  new_tokens, sampling, seed=i))  # fmt: skip
        plain.append(_summarise(chunks[0], batch, 0))
        sped.append(_summarise(chunks[speculate], batch, speculate))
    return plain, sped


def _step_time(model, context: int, steps: int = 8) -> dict:
    """Prefill `context` tokens, then time single-token decode steps (median): DSA as trained,
    then the same steps with dense attention over the same cache (the values in the cache do
    not change a step's cost)."""
    import torch

    from wanka.infer.cache import KVCache

    g = torch.Generator().manual_seed(0)
    total = context + 2 * steps
    tokens = torch.randint(32, 127, (1, total), generator=g)
    cache = KVCache(len(model.layers), 1, torch.device("cpu"), capacity=total)
    pos = torch.arange(total)[None]
    t0 = time.perf_counter()
    docs = cache.set_docs(0, torch.zeros(1, context, dtype=torch.long))
    model.decode(tokens[:, :context], pos[:, :context], cache, 0, docs)
    row = {"context": context, "prefill_s": round(time.perf_counter() - t0, 2)}
    attention = [m for m in model.modules() if hasattr(m, "indexer") and hasattr(m, "topk")]
    topk = [m.topk for m in attention]
    for mode, first in (("sparse", context), ("dense", context + steps)):
        if mode == "dense":
            for m in attention:
                m.topk = total  # never more keys than this: dense at every step
        times = []
        for s in range(first, first + steps):
            t0 = time.perf_counter()
            docs = cache.set_docs(s, torch.zeros(1, 1, dtype=torch.long))
            model.decode(tokens[:, s : s + 1], pos[:, s : s + 1], cache, s, docs)
            times.append(time.perf_counter() - t0)
        times.sort()
        row[f"{mode}_step_ms_median"] = round(1e3 * times[len(times) // 2], 2)
        row[f"{mode}_step_ms_min"] = round(1e3 * times[0], 2)
    for m, k in zip(attention, topk):
        m.topk = k
    return row


def run_bench_decode(args: argparse.Namespace) -> int:
    import torch

    from wanka.infer.generate import NonFiniteLogits

    try:
        with torch.no_grad():  # a context: an in-process caller (a test) keeps autograd
            return _bench_decode(args)
    except NonFiniteLogits as e:  # the checkpoint's fault: one line, exit 2
        raise ValueError(str(e)) from None


def _int_list(flag: str, text: str, example: str) -> list[int]:
    """A comma list of positive integers, or one line naming the flag."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not all(x.isdecimal() and int(x) > 0 for x in items):
        raise ValueError(f"{flag} {text!r}: give positive integers separated by commas, e.g. "
                         f"{flag} {example}")  # fmt: skip
    return [int(x) for x in items]


def _check_lengths(args: argparse.Namespace, max_seq_len: int) -> None:
    """The longest row a case decodes (prompt, new tokens, the drafts beyond them) against
    the model, named by the flags that set it."""
    need = args.prompt_tokens + args.new_tokens + args.speculate
    if need > max_seq_len:
        raise ValueError(f"--prompt-tokens ({args.prompt_tokens}) + --new-tokens "
                         f"({args.new_tokens}) + --speculate ({args.speculate}) = {need} exceeds "
                         f"the model's max_seq_len {max_seq_len}: lower --prompt-tokens or "
                         "--new-tokens")  # fmt: skip


def _bench_decode(args: argparse.Namespace) -> int:
    batches = _int_list("--batches", args.batches, "1,8")
    contexts = _int_list("--contexts", args.contexts, "4096,16384")
    if not batches:
        raise ValueError("--batches is empty: give batch sizes, e.g. --batches 1,8")
    for flag in ("speculate", "prompts", "prompt_tokens", "new_tokens", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be 1 or more")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature {args.temperature}: use 0 (greedy) or a positive number")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p {args.top_p}: the nucleus mass is in (0, 1]")
    out = Path(args.out)
    check_out(out)
    import torch

    from wanka.infer.load import load_trained

    model, cfg, ckpt = load_trained(args.run_dir)
    if cfg.data.tokenizer != "byte":
        raise ValueError("bench decode draws byte prompts from the built-in corpus: use a run "
                         "with data.tokenizer = 'byte'")  # fmt: skip
    if contexts and max(contexts) + 16 > cfg.model.max_seq_len:
        raise ValueError(f"--contexts up to {max(contexts)} exceed the model's max_seq_len "
                         f"{cfg.model.max_seq_len}")  # fmt: skip
    _check_lengths(args, cfg.model.max_seq_len)
    prompts = heldout_prompts(args.prompts, args.prompt_tokens)
    result = {"run_dir": str(args.run_dir), "checkpoint": str(ckpt), "flavor": cfg.model.flavor,
              "index_topk": cfg.model.index_topk, "threads": torch.get_num_threads(),
              "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "cases": [], "contexts": []}  # fmt: skip
    from wanka.infer.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_p)
    result.update(temperature=args.temperature, top_p=args.top_p)
    warm_up = min(8, args.new_tokens)
    _decode_pair(model, prompts[:1], 1, args.speculate, warm_up, sampling, 1)
    result["repeats"] = args.repeats
    for batch in batches:
        runs = _decode_pair(model, prompts, batch, args.speculate, args.new_tokens, sampling,
                            args.repeats)  # fmt: skip
        plain, sped = _merge(runs[0]), _merge(runs[1])
        result["cases"] += [plain, sped]
        print(_row(plain), flush=True)
        print(_row(sped), flush=True)
        ratios = sorted(b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(*runs))
        sped["speedup_vs_plain"] = round(_median(ratios), 3)
        sped["speedup_range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
        # Sampled runs draw other random numbers with and without drafts: only greedy output
        # must match token for token (the distribution's equality is tested in the unit tests).
        same = sped["outputs"] == plain["outputs"] if sampling.greedy else None
        sped["same_output_as_plain"] = same
        spread = (
            f" (pairs {sped['speedup_range'][0]}-{sped['speedup_range'][1]}x)"
            if args.repeats > 1
            else ""
        )
        print(f"  batch {batch}: speculation {sped['speedup_vs_plain']}x tokens/s{spread}"
              + (f", same greedy output: {same}" if sampling.greedy else ", sampled"),
              flush=True)  # fmt: skip
    for c in contexts:
        row = _step_time(model, c)
        result["contexts"].append(row)
        print(f"context {c}: decode step {row['sparse_step_ms_median']} ms with DSA, "
              f"{row['dense_step_ms_median']} ms dense (prefill {row['prefill_s']} s)", flush=True)  # fmt: skip
    if len(result["contexts"]) >= 2:
        a, b = result["contexts"][0], result["contexts"][-1]
        result["context_growth"] = round(b["context"] / a["context"], 3)
        for mode in ("sparse", "dense"):
            key = f"{mode}_step_ms_median"
            result[f"{mode}_step_growth"] = round(b[key] / a[key], 3)
        print(f"context x{result['context_growth']}: decode step x{result['sparse_step_growth']} "
              f"with DSA, x{result['dense_step_growth']} dense")  # fmt: skip
    for case in result["cases"]:
        case["outputs"] = [len(o) for o in case.pop("outputs")]  # lengths only in the JSON
    write_out(out, json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _merge(cases: list[dict]) -> dict:
    """One row for the repeats of a case: the outputs and acceptance are the first run's (with
    fixed seeds every run gives the same; `repeats_agree` says whether they did), the timings
    are medians, each run's tokens/s kept."""
    row = dict(cases[0])
    row["repeats_agree"] = all(c["outputs"] == cases[0]["outputs"] for c in cases[1:])
    for key in ("seconds", "tokens_per_s", "latency_ms_per_token"):
        row[key] = round(_median([c[key] for c in cases]), 3 if key == "seconds" else 2)
    row["tokens_per_s_runs"] = [c["tokens_per_s"] for c in cases]
    return row


def _row(c: dict) -> str:
    spec = f"speculate {c['speculate']}" if c["speculate"] else "plain"
    acc = ""
    if c["speculate"]:
        acc = f" | acceptance {c['acceptance_rate']} | mean length {c['mean_acceptance_length']}"
    return (f"batch {c['batch']} {spec:12s} | {c['tokens_per_s']:8.1f} tok/s | "
            f"{c['latency_ms_per_token']:7.1f} ms/token | distinct 4-grams "
            f"{c['distinct_4grams']}{acc}")  # fmt: skip

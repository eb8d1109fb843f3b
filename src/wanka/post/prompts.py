"""Domain-tagged prompts for post-training: built from the built-in corpus, or read from JSONL.

The built-in set has two domains: "code" (Python standard-library sources) and "prose" (the
bundled pydoc topics), so multi-teacher distillation and the Python-syntax reward work with
nothing downloaded.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from wanka.data.corpus import Document, pydoc_documents, split_documents, stdlib_documents
from wanka.post.rewards import python_parses, source_compiles

# Documents are split once, with a fixed seed, whatever ``seed`` picks prompts with: a "val"
# prompt never comes from a document that gives "train" prompts under any seed. Same hash and
# seed as the built-in pretraining split (fraction 0.01, seed 0), so the documents pretraining
# held out are among these val ones; a tenth, not a hundredth, so that prose has val
# documents at all (about 8 of 79 pydoc topics; pretraining's val holds none).
VAL_FRACTION = 0.1
SPLIT_SEED = 0

DOMAINS = ("code", "prose")

_NEWLINE = re.compile("\n")


@dataclass(frozen=True)
class TaggedPrompt:
    """A prompt, the domain whose teacher scores it, and the corpus' own continuation.

    ``reference`` (empty when unknown) serves off-policy/SFT baselines and held-out losses.
    """

    text: str
    domain: str
    reference: str = ""


@functools.cache
def _splits(domain: str) -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    """(train, val) documents of a domain (loading the stdlib takes about a second: cached)."""
    docs = stdlib_documents() if domain == "code" else pydoc_documents()
    train, val = split_documents(docs, VAL_FRACTION, SPLIT_SEED)
    return tuple(train), tuple(val)


def _split_documents(domain: str, split: str) -> tuple[Document, ...]:
    return _splits(domain)[0 if split == "train" else 1]


def _code_prompt(
    text: str, rng: random.Random, prompt_chars: int, cont_chars: int
) -> tuple[str, str] | None:
    """A prompt from a random top-level line, ending at a line boundary where it parses.

    Returns (prompt, reference) or None. The prompt is at most ``prompt_chars`` and at least
    half of it; ``reference`` is the next ``cont_chars`` characters of the document, and the
    end is chosen so that the reference earns ``python_parses``: the reward is then achievable
    on every prompt (by the corpus itself), and RL does not spend rollouts on prompts whose
    natural continuation stops mid-statement (about half of all cut points otherwise).
    """
    # Line starts that are unindented, non-blank, not a comment or closing bracket: where a
    # statement may begin (confirmed by parsing: a docstring's lines can look the same).
    starts = [m.start() for m in re.finditer(r"^[^\s#)\]}]", text, re.MULTILINE)]
    if not starts:
        return None
    start = rng.choice(starts)
    ends = [m.end() for m in _NEWLINE.finditer(text, start, start + prompt_chars)]
    for end in reversed(ends):
        if end - start < prompt_chars // 2:
            break
        if len(text) - end < cont_chars:
            continue
        prompt, reference = text[start:end], text[end : end + cont_chars]
        if source_compiles(prompt) and python_parses(prompt, reference) == 1.0:
            return prompt, reference
    return None


def _prose_prompt(
    text: str, rng: random.Random, prompt_chars: int, cont_chars: int
) -> tuple[str, str] | None:
    """A prompt from a random line start, ending just before a whitespace character."""
    start = rng.choice([0] + [m.end() for m in re.finditer(r"\n(?=\S)", text)])
    end = start + prompt_chars
    while end > start and not text[end : end + 1].isspace():
        end -= 1
    while end > start and text[end - 1].isspace():
        end -= 1  # end on a word: a BPE tokenizer would treat a trailing space oddly
    if end - start < prompt_chars // 2 or len(text) - end < cont_chars:
        return None
    return text[start:end], text[end : end + cont_chars]


def builtin_prompts(
    split: str,
    n_per_domain: int,
    prompt_chars: int,
    continuation_chars: int,
    seed: int,
    only: tuple[str, ...] = DOMAINS,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[TaggedPrompt]:
    """``n_per_domain`` prompts of each built-in domain, interleaved (code, prose, code, ...).

    Interleaved so that any contiguous batch mixes the domains, and each teacher gets work in
    every step. Deterministic for ``seed``; ``split`` "val" draws from held-out documents
    (see ``VAL_FRACTION``). Code prompts start at a top-level line and end at a line boundary
    where the prompt parses with ``ast`` (so ``python_parses`` on a continuation is about the
    continuation); prose prompts end before whitespace. Documents too short for a prompt and
    its ``continuation_chars`` reference are skipped; a small split may give several prompts
    from one document (never the same one twice). A prompt whose text is in ``exclude`` (the
    held-out prompts, when drawing training ones) is passed over: documents of the two splits
    can share text (pydoc topics quote each other), and a held-out prompt that is also trained
    on measures nothing. ValueError when the split cannot supply ``n_per_domain`` distinct
    prompts.
    """
    if split not in ("train", "val"):
        raise ValueError(f"builtin_prompts: split must be 'train' or 'val', got {split!r}")
    if n_per_domain < 1 or prompt_chars < 2 or continuation_chars < 1:
        raise ValueError(
            "builtin_prompts: need n_per_domain >= 1, prompt_chars >= 2, continuation_chars >= 1"
            f" (got {n_per_domain}, {prompt_chars}, {continuation_chars})"
        )
    if not set(only) <= set(DOMAINS) or not only:
        raise ValueError(f"builtin_prompts: domains are {DOMAINS}, got {only!r}")
    per_domain = [
        _sample(domain, split, n_per_domain, prompt_chars, continuation_chars, seed, exclude)
        for domain in DOMAINS
        if domain in only
    ]
    return [p for group in zip(*per_domain) for p in group]


def _sample(
    domain: str,
    split: str,
    n: int,
    prompt_chars: int,
    cont_chars: int,
    seed: int,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> list[TaggedPrompt]:
    rng = random.Random(f"wanka.post.prompts:{seed}:{split}:{domain}")
    min_len = prompt_chars // 2 + cont_chars
    docs = [d for d in _split_documents(domain, split) if len(d.text) >= min_len]
    make = _code_prompt if domain == "code" else _prose_prompt
    out: list[TaggedPrompt] = []
    seen: set[str] = set()
    order: list[Document] = []
    # Visit documents in a seeded order, one attempt each per pass; small splits take several
    # passes. The attempt cap stops a split whose documents cannot give n distinct prompts.
    for _ in range(10 * n + 2 * len(docs)):
        if len(out) == n or not docs:
            break
        if not order:
            order = rng.sample(docs, len(docs))
        made = make(order.pop().text, rng, prompt_chars, cont_chars)
        if made is not None and made[0] not in seen and made[0] not in exclude:
            seen.add(made[0])
            out.append(TaggedPrompt(made[0], domain, made[1]))
    if len(out) < n:
        raise ValueError(
            f"builtin_prompts: the {split} split gives only {len(out)} distinct {domain} prompts"
            f" of {prompt_chars} chars + {cont_chars} continuation, {n} asked; ask for fewer"
            " or shorter prompts"
        )
    return out


def read_prompts_jsonl(path: str | Path) -> list[TaggedPrompt]:
    """Prompts from a JSONL file: {"prompt": str, "domain": str, "reference": str (optional)}.

    Blank lines are skipped and other keys ignored (so files made for other tools load); a
    UTF-8 byte-order mark (as some editors write) is skipped. Every problem is a one-line
    ValueError naming ``file:line``.
    """
    if not str(path).strip() or Path(path).is_dir():
        raise ValueError(f"post.prompts={str(path)!r} is not a file: name a JSONL file of "
                         '{"prompt": ..., "domain": ...} lines, or "builtin"')  # fmt: skip
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read prompts file ({e.strerror}): set post.prompts "
                         'to a JSONL file or "builtin"') from None  # fmt: skip
    raw = raw.removeprefix(b"\xef\xbb\xbf")
    prompts = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        where = f"{path}:{lineno}"
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}: not UTF-8: save the file as UTF-8") from None
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        except RecursionError:  # e.g. thousands of nested brackets
            raise ValueError(f"{where}: not valid JSON here (nested too deeply): expected one "
                             '{"prompt": ..., "domain": ...} object per line') from None  # fmt: skip
        except ValueError as e:  # a number of over 4300 digits (int_max_str_digits), even
            # in a key that is ignored: the one line must still name the file and line
            first = (str(e).strip().splitlines() or [""])[0][:120]
            raise ValueError(f"{where}: not readable JSON ({first})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in ("prompt", "domain"):
            value = obj.get(key)
            if not isinstance(value, str) or not value:
                got = "missing" if key not in obj else f"{type(value).__name__} {value!r:.40}"
                raise ValueError(f'{where}: "{key}" must be a non-empty string ({got})')
        reference = obj.get("reference", "")
        if not isinstance(reference, str):
            raise ValueError(f'{where}: "reference" must be a string if given')
        for key, value in (("prompt", obj["prompt"]), ("domain", obj["domain"]),
                           ("reference", reference)):  # fmt: skip
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:  # "\ud800" in the JSON: a lone surrogate
                raise ValueError(f'{where}: "{key}" holds {value[e.start]!r}, a lone UTF-16 '
                                 "surrogate that no tokenizer can encode: fix the escape") from None  # fmt: skip
        domain = obj["domain"]
        if not domain.strip():  # (a name with "," or "=" is fine where no setting names it: rl)
            raise ValueError(f'{where}: "domain" {domain!r} is blank: name the prompt\'s domain')
        prompts.append(TaggedPrompt(obj["prompt"], domain, reference))
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one JSON object per line)")
    return prompts


def split_jsonl_prompts(path: str | Path, wanted: set[str] | None, eval_prompts: int
                        ) -> tuple[list[TaggedPrompt], list[TaggedPrompt]]:  # fmt: skip
    """(train, held-out) prompts of a JSONL file: only the ``wanted`` domains (None: all), the
    last ``eval_prompts`` distinct prompts of each domain held out (split_held_out). One-line
    ValueErrors naming the key."""
    return split_held_out(jsonl_prompts(path, wanted), eval_prompts, path)


def jsonl_prompts(path: str | Path, wanted: set[str] | None) -> list[TaggedPrompt]:
    """Every prompt of a JSONL file in the ``wanted`` domains (None: all)."""
    every = read_prompts_jsonl(path)
    if wanted is not None:
        missing = sorted(set(wanted) - set(domains(every)))
        if missing:
            raise ValueError(f"post.domains names {missing}, but {path} has the domains "
                             f"{domains(every)}")  # fmt: skip
        every = [x for x in every if x.domain in wanted]
    return every


def split_held_out(every: list[TaggedPrompt], eval_prompts: int, where: str | Path
                   ) -> tuple[list[TaggedPrompt], list[TaggedPrompt]]:  # fmt: skip
    """(train, held-out): per domain, the ``eval_prompts`` distinct prompt texts that come
    last in the file are held out, one row each (the last); every row with a held-out text
    (a repeat, in any domain) is left out of training, so no held-out prompt is trained on.
    Deterministic: file order, domains sorted. Without repeats: the last rows of each domain."""
    held: list[TaggedPrompt] = []
    for d in domains(every):
        rows = [x for x in every if x.domain == d]
        last: dict[str, TaggedPrompt] = {}  # text -> its last row, in order of last appearance
        for x in rows:
            last.pop(x.text, None)
            last[x.text] = x
        if len(last) <= eval_prompts:
            distinct = f" ({len(last)} distinct)" if len(last) < len(rows) else ""
            raise ValueError(f"{where}: domain {d!r} has {len(rows)} prompts{distinct}, post."
                             f"eval_prompts={eval_prompts} are held out: add prompts or "
                             "lower post.eval_prompts")  # fmt: skip
        held += list(last.values())[len(last) - eval_prompts :]
    held_texts = {x.text for x in held}
    train: list[TaggedPrompt] = []
    for d in domains(every):
        kept = [x for x in every if x.domain == d and x.text not in held_texts]
        if not kept:  # its other texts are held out under another domain
            raise ValueError(f"{where}: every prompt of domain {d!r} is also a held-out prompt "
                             "(of another domain): add prompts or lower post.eval_prompts")  # fmt: skip
        train += kept
    return train, held


def domains(prompts: list[TaggedPrompt]) -> list[str]:
    """The distinct domains, sorted (the order teachers are matched in)."""
    return sorted({p.domain for p in prompts})

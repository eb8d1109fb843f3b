"""Domain-tagged prompts: the built-in set (balanced, deterministic, held-out val, code prompts
that parse and whose true continuation earns the reward) and JSONL files."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from wanka.data.corpus import split_documents
from wanka.data.prepare import MIN_VAL_CHARS
from wanka.post import prompts as P
from wanka.post.prompts import TaggedPrompt, builtin_prompts, domains, read_prompts_jsonl
from wanka.post.rewards import python_parses

N, PROMPT_CHARS, CONT_CHARS = 24, 256, 128


@pytest.fixture(scope="module")
def train() -> list[TaggedPrompt]:
    return builtin_prompts("train", N, PROMPT_CHARS, CONT_CHARS, seed=0)


@pytest.fixture(scope="module")
def val() -> list[TaggedPrompt]:
    return builtin_prompts("val", N, PROMPT_CHARS, CONT_CHARS, seed=0)


def test_balanced_and_interleaved(train: list[TaggedPrompt]) -> None:
    assert len(train) == 2 * N
    assert [p.domain for p in train] == ["code", "prose"] * N
    assert domains(train) == ["code", "prose"]
    assert len({p.text for p in train}) == 2 * N  # no duplicates


def test_deterministic_for_a_seed(train: list[TaggedPrompt]) -> None:
    assert builtin_prompts("train", N, PROMPT_CHARS, CONT_CHARS, seed=0) == train
    other = builtin_prompts("train", N, PROMPT_CHARS, CONT_CHARS, seed=1)
    assert len({p.text for p in other} & {p.text for p in train}) < N // 2


def test_lengths_and_references_are_the_true_continuation(train, val) -> None:
    docs = {d: "".join(x.text for x in P._split_documents(d, "train")) for d in P.DOMAINS}
    for p in train + val:
        assert PROMPT_CHARS // 2 <= len(p.text) <= PROMPT_CHARS
        assert len(p.reference) == CONT_CHARS
    for p in train:  # the reference is what follows the prompt in the corpus
        assert p.text + p.reference in docs[p.domain]


def test_val_prompts_come_from_held_out_documents(train, val) -> None:
    for domain in P.DOMAINS:
        train_docs = P._split_documents(domain, "train")
        val_docs = P._split_documents(domain, "val")
        assert train_docs and val_docs
        assert not {d.name for d in train_docs} & {d.name for d in val_docs}
        for prompts, own in ((train, train_docs), (val, val_docs)):
            for p in (p for p in prompts if p.domain == domain):
                # (The stdlib repeats text between files, so "not in the other split" would
                # be too strong; the documents themselves are disjoint, checked above.)
                assert any(p.text + p.reference in d.text for d in own)


def test_val_documents_include_those_pretraining_held_out() -> None:
    docs = [d for domain in P.DOMAINS for part in P._splits(domain) for d in part]
    _, pretrain_val = split_documents(docs, 0.01, 0, MIN_VAL_CHARS)  # as ensure_builtin_dataset
    val_names = {d.name for domain in P.DOMAINS for d in P._split_documents(domain, "val")}
    assert pretrain_val and {d.name for d in pretrain_val} <= val_names


def test_code_prompts_parse_and_prose_prompts_cut_at_whitespace(train, val) -> None:
    for p in train + val:
        if p.domain == "code":
            ast.parse(p.text)
            assert p.text.endswith("\n") and not p.text[0].isspace()
        else:
            assert not p.text[-1].isspace() and p.reference[0].isspace()


def test_the_reward_is_achievable_on_builtin_code_prompts(train, val) -> None:
    # The corpus' own continuation earns python_parses on every code prompt (by choice of the
    # cut point), with the reward's anti-gaming rules on: real code is not mistaken for gaming.
    code = [p for p in train + val if p.domain == "code"]
    assert all(python_parses(p.text, p.reference) == 1.0 for p in code)
    # Control: the reward is not trivially 1 on these prompts: a comment or a dropped line is not.
    assert not any(python_parses(p.text, "# more to come\n") for p in code)
    assert not any(python_parses(p.text, p.reference.split("\n")[0]) for p in code)


def test_too_many_prompts_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match="val split gives only 0 distinct code prompts") as info:
        builtin_prompts("val", 1, 10**7, CONT_CHARS, seed=0)  # no document is that long
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="split must be"):
        builtin_prompts("test", 1, PROMPT_CHARS, CONT_CHARS, seed=0)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_prompts_jsonl(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "def f():\n", "domain": "code", "id": 7}),
            "",
            "   ",
            json.dumps({"prompt": "Once", "domain": "prose", "reference": " upon"}),
        ],
    )
    got = read_prompts_jsonl(path)
    assert got == [TaggedPrompt("def f():\n", "code"), TaggedPrompt("Once", "prose", " upon")]
    assert domains(got + got) == ["code", "prose"]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r":2: not valid JSON"),
        ("[1, 2]", r":2: expected a JSON object, got list"),
        ('{"domain": "code"}', r':2: "prompt" must be a non-empty string \(missing\)'),
        ('{"prompt": "", "domain": "code"}', r':2: "prompt" must be a non-empty string'),
        ('{"prompt": "x", "domain": 3}', r':2: "domain" must be a non-empty string \(int 3\)'),
        ('{"prompt": "x", "domain": "d", "reference": 1}', r':2: "reference" must be a string'),
    ],
)
def test_read_prompts_jsonl_errors_name_file_and_line(
    tmp_path: Path, line: str, match: str
) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "ok", "domain": "code"}), line])
    with pytest.raises(ValueError, match="prompts.jsonl" + match) as info:
        read_prompts_jsonl(path)
    assert "\n" not in str(info.value)


def test_read_prompts_jsonl_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read prompts file"):
        read_prompts_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts_jsonl(_write(tmp_path, ["", ""]))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "ok", "domain": "d"}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not UTF-8"):
        read_prompts_jsonl(bad)


def test_builtin_prompts_of_one_domain_only():
    code = builtin_prompts("val", 3, 80, 40, 0, only=("code",))
    assert [p.domain for p in code] == ["code"] * 3
    assert code == [p for p in builtin_prompts("val", 3, 80, 40, 0) if p.domain == "code"]
    with pytest.raises(ValueError, match="domains"):
        builtin_prompts("val", 3, 80, 40, 0, only=("poetry",))


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("[" * 100_000 + "]" * 100_000, r":2: not valid JSON here \(nested too deeply\)"),
        ('{"prompt": "\\ud800", "domain": "code"}', r':2: "prompt" holds .*lone UTF-16 surrogate'),
        ('{"prompt": "x", "domain": "d", "reference": "\\udfff"}', r':2: "reference" holds'),
        ('{"prompt": "x", "domain": "  "}', r':2: "domain" .* is blank'),
    ],
)
def test_read_prompts_jsonl_hostile_lines_are_one_line(
    tmp_path: Path, line: str, match: str
) -> None:
    """Lines that used to raise RecursionError, or load and fail later (a lone surrogate: the
    tokenizer's UnicodeEncodeError on a rank; a domain no post.teachers spec can name)."""
    path = _write(tmp_path, [json.dumps({"prompt": "ok", "domain": "code"}), line])
    with pytest.raises(ValueError, match="prompts.jsonl" + match) as info:
        read_prompts_jsonl(path)
    assert "\n" not in str(info.value)


def test_read_prompts_jsonl_skips_a_byte_order_mark(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a", "domain": "code"}).encode())
    assert read_prompts_jsonl(path) == [TaggedPrompt("a", "code")]


@pytest.mark.parametrize("spec", ["", "  ", "{tmp}"])
def test_read_prompts_jsonl_refuses_an_empty_name_or_a_directory(tmp_path: Path, spec) -> None:
    with pytest.raises(ValueError, match="is not a file: name a JSONL file"):
        read_prompts_jsonl(spec.format(tmp=tmp_path))


def test_split_jsonl_prompts_holds_out_the_last_of_each_domain(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "domain": d} for i, d in enumerate("abab")]
    path = _write(tmp_path, [json.dumps(r) for r in rows])
    train, held = P.split_jsonl_prompts(path, None, 1)
    assert [x.text for x in train] == ["p0", "p1"] and [x.text for x in held] == ["p2", "p3"]
    assert P.split_jsonl_prompts(path, {"a"}, 0) == ([TaggedPrompt("p0", "a"),
                                                     TaggedPrompt("p2", "a")], [])  # fmt: skip
    with pytest.raises(ValueError, match=r"post.domains names \['c'\]"):
        P.split_jsonl_prompts(path, {"c"}, 1)
    with pytest.raises(ValueError, match="domain 'a' has 2 prompts, post.eval_prompts=2"):
        P.split_jsonl_prompts(path, None, 2)

"""The Python-syntax reward (including the completions a policy could game it with) and
loading user reward functions."""

from __future__ import annotations

import sys
import time

import pytest

from wanka.post.rewards import (
    MAX_CHARS,
    load_reward,
    python_lines,
    python_parses,
    source_compiles,
)

PROMPT = "def f(x):\n"


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("    y = x + 1\n    return y\n", 1.0),
        ("    y = x + 1\n    return y\n    z = (x +", 1.0),  # partial last line dropped
        ("    y = x + 1\n    return y\r\n", 1.0),  # \r\n is a newline to Python too
        ("    y = (x + 1\n    return y\n", 0.0),  # unbalanced paren
        ("    y = x + 1\n  return y\n", 0.0),  # bad dedent
        ("    y = x + 1\n    return y", 0.0),  # the partial line was what made it count
        ("    y = x + 1; return y", 0.0),  # no newline: nothing kept
        ("", 0.0),
        ("\n\n", 0.0),  # the body is missing
        ("    # a\n    # b\n    # c\n", 0.0),  # comment-only
        ("    y = 1\x00\n    return y\n", 0.0),  # null byte (ValueError in ast.parse)
    ],
)
def test_python_parses_known_completions(completion: str, reward: float) -> None:
    assert python_parses(PROMPT, completion) == reward


@pytest.mark.parametrize(
    "completion",
    [
        "    pass\n" * 8,  # trivially parses, repeated
        "    y = 1\n" * 8,  # one real line, repeated
        '    """A docstring\n    spanning lines\n    """\n',  # a string is not code
        "    ...\n    1\n    x\n    'text'\n",  # bare constants and names do nothing
        "    x,\n    a, b\n    x == 1\n    not y\n",  # expressions with no effect
        "    return x\n    return x  \n",  # same text up to whitespace
    ],
)
def test_degenerate_completions_earn_nothing(completion: str) -> None:
    assert python_parses(PROMPT, completion) == 0.0
    # Control: the same completion plus two real lines does earn it (it parsed all along).
    assert python_parses(PROMPT, completion + "    a = x * 2\n    b = a - 1\n") == 1.0


def test_lines_copied_from_the_prompt_do_not_count() -> None:
    prompt = "import os\nx = os.getcwd()\ny = len(x)\n"
    assert python_parses(prompt, "x = os.getcwd()\ny = len(x)\n") == 0.0
    assert python_parses(prompt, "x = os.getcwd()\nz = x + x\n") == 0.0  # only one is new
    assert python_parses(prompt, "z = x + x\nw = z * 2\n") == 1.0


def test_code_python_rejects_at_compile_time_earns_nothing() -> None:
    # ast.parse accepts all of these; the compiler does not.
    for completion in ["return 1\nreturn 2\n", "yield a\nyield b\n", "x = 1\nnonlocal x\n"]:
        assert python_parses("a = b = 0\n", completion) == 0.0
    assert python_parses("a = b = 0\n", "x = 1\ny = 2\n") == 1.0  # control
    assert python_parses("while a:\n", "    a -= 1\n    break\n", min_code_lines=1) == 1.0


def test_min_code_lines() -> None:
    one = "    return x\n"
    assert python_parses(PROMPT, one) == 0.0
    assert python_parses(PROMPT, one, min_code_lines=1) == 1.0
    # With 0 it is a pure syntax check: a parsing prompt plus nothing passes.
    assert python_parses("x = 1\n", "no newline", min_code_lines=0) == 1.0
    assert python_parses(PROMPT, "no newline", min_code_lines=0) == 0.0


def test_a_prompt_ending_mid_line_is_continued() -> None:
    # The completion finishes the prompt's last line; that line belongs to the prompt.
    assert python_parses("x = (1 +", " 2)\n") == 0.0
    assert python_parses("x = (1 +", " 2)\ny = x\nz = y\n") == 1.0


def test_never_raises_and_stays_fast() -> None:
    hostile = [
        "    y = " + "(" * 10_000 + "1" + ")" * 10_000 + "\n    z = 2\n",  # nesting limit
        "    y = " + "[" * 100_000 + "\n",
        "    y = '\\N{NOT A NAME}'\n    z = 1\n",  # bad escape: SyntaxError
        "    y = '\\d'\n    z = 1\n",  # SyntaxWarning only: parses
        "    y = 1\n" + "    z = 1\n" * 20_000,  # over MAX_CHARS
        "\ud800\n\ud800\n",  # lone surrogate
        "\x00" * 100 + "\n",
        "\f\v\n\n",
    ]
    assert len(hostile[4]) > MAX_CHARS
    start = time.perf_counter()
    results = [python_parses(PROMPT, c) for c in hostile]
    assert time.perf_counter() - start < 2.0
    assert results == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert python_parses(None, "x\n") == 0.0  # type: ignore[arg-type]
    assert python_parses(PROMPT, b"    y = 1\n    z = 2\n") == 0.0  # type: ignore[arg-type]


def test_source_compiles() -> None:
    assert source_compiles("def f():\n    return 1\n")
    assert not source_compiles("return 1\n")
    assert not source_compiles("x = (\n")
    assert not source_compiles("x = 1\x00\n")
    assert not source_compiles(None)  # type: ignore[arg-type]


def test_load_builtin_reward() -> None:
    assert load_reward("python_parses") is python_parses
    assert load_reward("python_lines") is python_lines


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("    y = x + 1\n    return y\n", 1.0),
        ("    y = x + 1\n    return y\n    z = (x +", 1.0),  # partial last line dropped
        ("    y = x + 1\n  return y\n", 1.0),  # statements: indentation is not judged
        ("    y = x + 1\n    return y +\n", 0.5),
        ("    y = x + 1\n", 0.5),  # one good line earns at most 1 / min_lines
        ("    y = x + 1\n    foo bar\n    (\n    z = 2\n", 1.5 / 4),  # z = 2 reads nothing: half
        ("    if x:\n        print(x)\n    else:\n        raise ValueError(x)\n", 3.5 / 4),
        ("    try:\n        g = open(x)\n    except OSError as e:\n        print(e)\n", 3.5 / 4),
        ("    @print\n    @len\n    def g(a):\n        return a\n", 3.5 / 4),  # args: the body's
        ("    if x:\n    if x > 1:\n    class A(Exception):\n", 0.0),  # headers with no body
        ("    @print\n    x = 1\n", 0.25),  # a decorator of nothing
        ("    y = z\n    foo()\n", 0.5),  # names that exist nowhere: the syntax half
        ("    y = (x\n    z = y\n    import os, re as r\n    r.sub(os.sep)\n", 2.5 / 4),
        (
            "    for i in x:\n        print(i)\n        y = [j for j in i]\n        f = lambda k: k\n",
            1.0,
        ),
        ("    import os\n    import no_such_module_xyz\n    from . import q\n", 2 / 3),
        ("    # a comment\n\n\n    y = x\n    z = y\n", 1.0),  # comments/blanks not counted
        ("    y = 1\x00\n    z = x\n", 0.5),  # null byte: that line fails, not the call
        ("", 0.0),
        ("no newline at all", 0.0),
    ],
)
def test_python_lines_known_completions(completion: str, reward: float) -> None:
    assert python_lines(PROMPT, completion) == pytest.approx(reward)


@pytest.mark.parametrize(
    ("completion", "alone", "with_two_more"),
    [
        ("    pass\n" * 8, 0.0, 2 / 10),
        ("    y = x\n" * 8, 1 / 8, 3 / 10),  # one real line, repeated: credited once
        ("    ...\n    1\n    x\n    'text'\n    break\n    continue\n", 0.0, 2 / 8),
        ("    # a\n    # b\n\n", 0.0, 1.0),  # not counted at all
        ("def f(x):\n", 0.0, 2 / 3),  # copied from the prompt
        # Dead expressions a policy found first (tuples of names), then comparisons etc.
        ("    it,\n    san,\n    r, x,\n    a == b\n    -y\n    [q]\n", 0.0, 2 / 8),
    ],
)
def test_python_lines_degenerate_completions_earn_little(
    completion: str, alone: float, with_two_more: float
) -> None:
    assert python_lines(PROMPT, completion) == pytest.approx(alone)
    # Control: two new statements more earn credit for exactly those two.
    got = python_lines(PROMPT, completion + "    a = x * 2\n    b = a - 1\n")
    assert got == pytest.approx(with_two_more)


ATTACK_PROMPT = "import os\nimport sys\n\ndef main(argv):\n    path = argv[1]\n"


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        # Copies of a prompt line that differ in text only: spacing, `;`, a comment, a number,
        # full-width letters (the same identifier to Python).
        ("path =argv[1]\npath= argv[1]\n", 0.0),
        ("import os;\nimport sys #\n", 0.0),
        ("    path = argv[2]\n    path = argv[3]\n", 0.0),
        ("\uff50\uff41\uff54\uff48 = argv[1]\n", 0.0),
        ("print(path)\nprint(path)#\nprint(path)  # again\n", 1 / 3),
        ("print(1)\nprint(2)\n", 1 / 2),
        # Dead code behind `;` or an inline body, headers with nothing under them.
        ("path;path\nargv;argv\npass;pass\n", 0.0),
        ("if path: pass\nelse: path\ntry: path\n", 0.0),
        ("if path:\nif argv:\nclass A(object):\n", 0.0),
        ("@print\n@len\n", 0.0),
        # What is left: the syntax half, never the names half.
        ("a=a\nb=b\nfor y in y:\n    f = lambda: f\n", 0.5),  # own assignments do not count
        ("import os as a\nimport sys.path\n", 0.5),  # modules imported again
    ],
)
def test_python_lines_attacks_earn_at_most_the_syntax_half(completion: str, reward: float) -> None:
    assert python_lines(ATTACK_PROMPT, completion) == pytest.approx(reward)


def test_python_lines_never_imports_what_a_completion_names() -> None:
    python_lines(ATTACK_PROMPT, "import json\n")  # the list of installed modules, built once
    before = set(sys.modules)
    got = python_lines(ATTACK_PROMPT, "import distutils\nimport pip\nimport setuptools\n")
    assert set(sys.modules) == before and got > 0.5  # they exist; nothing was imported


def test_python_lines_prompt_ending_mid_line_and_hostile_input() -> None:
    # The prompt's unfinished last line and the completion's first are one line.
    assert python_lines("x = (1 +", " 2)\ny = x\n") == 0.75  # the first line reads no name
    assert python_lines("x = (1 +", "\nprint(x)\n") == 0.5  # nothing added to the prompt's line
    assert python_lines(ATTACK_PROMPT.rstrip("\n"), "\n") == 0.0
    assert python_lines("x = (1 +", " 2\ny = x\n") == 0.5
    hostile = ["    y = " + "(" * 10_000 + "1" + ")" * 10_000 + "\n    z = 2\n",
               "    y = 1\n" + "    z = 1\n" * 20_000, "\ud800\n\ud800\n", "\f\v\n\n"]  # fmt: skip
    start = time.perf_counter()
    assert [python_lines(PROMPT, c) for c in hostile] == [0.25, 0.0, 0.0, 0.0]
    assert time.perf_counter() - start < 2.0
    assert python_lines(None, "x\n") == 0.0  # type: ignore[arg-type]
    # Parses, but thousands of nested operators overflow ast.dump's recursion: 0, no raise.
    deep = "x = " + "-" * 2000 + "1\n"
    assert python_lines(PROMPT, deep + "y = x\n") == 0.0 and python_lines(deep, "y = x\n") == 0.0


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "score.py").write_text(
        "def length(prompt, completion, domain):\n"
        "    return float(len(completion)) if domain == 'prose' else 0.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards_pkg.score"
    for name in [m for m in sys.modules if m.startswith("myrewards_pkg")]:
        del sys.modules[name]


def test_load_user_reward(user_module: str) -> None:
    fn = load_reward(f"{user_module}:length")
    assert fn("p", "abc", "prose") == 3.0
    assert fn("p", "abc", "code") == 0.0


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("python_parse", "not a built-in .*python_parses.*package.module:function"),
        ("no_such_pkg_xyz.mod:fn", "cannot import module 'no_such_pkg_xyz.mod'.*PYTHONPATH"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", "is a int, not a function"),
        ("{mod}:", "package.module:function"),
        (":fn", "package.module:function"),
    ],
)
def test_load_reward_errors_are_one_line(user_module: str, spec: str, match: str) -> None:
    spec = spec.format(mod=user_module)
    with pytest.raises(ValueError, match=match) as info:
        load_reward(spec)
    assert "\n" not in str(info.value) and repr(spec) in str(info.value)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("def f(:\n", "importing module '{mod}' raised SyntaxError"),
        ("raise RuntimeError('no GPU here')\n", "raised RuntimeError: no GPU here; fix the module"),
        ("import sys\nsys.exit(4)\n", "raised SystemExit: 4"),
    ],
)
def test_a_reward_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, source, match):
    name = f"broken_reward_{abs(hash(source))}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=match.format(mod=name)) as info:
        load_reward(f"{name}:fn")
    assert "\n" not in str(info.value)
    sys.modules.pop(name, None)


def test_a_relative_module_name_is_one_line() -> None:
    with pytest.raises(ValueError, match="importing module '.x' raised TypeError"):
        load_reward(".x:fn")


def test_a_reward_of_the_wrong_signature_is_refused_at_load(tmp_path, monkeypatch) -> None:
    (tmp_path / "sig_rewards.py").write_text(
        "def two(prompt, completion):\n    return 1.0\n"
        "def kw(prompt, completion, *, domain):\n    return 1.0\n"
        "def star(*args):\n    return 1.0\n"
        "class NoArgs:\n    def __call__(self, p, c, d):\n        return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for attr in ("two", "kw", "NoArgs"):
            with pytest.raises(ValueError, match=r"cannot be called as \(prompt, completion, "
                               r"domain\).*give it those three arguments"):  # fmt: skip
                load_reward(f"sig_rewards:{attr}")
        assert load_reward("sig_rewards:star")("p", "c", "d") == 1.0
        assert load_reward("builtins:max") is max  # no signature to check: taken as it is
    finally:
        sys.modules.pop("sig_rewards", None)


def _one(value=None, exc=None):
    def reward(prompt, completion, domain):
        if exc is not None:
            raise exc
        return value

    return reward


@pytest.mark.parametrize(
    ("reward", "match"),
    [
        (
            _one(exc=ZeroDivisionError("boom")),
            r"raised ZeroDivisionError: boom on a completion "
            r"of a 'code' prompt",
        ),  # fmt: skip
        (_one(exc=KeyError()), r"raised KeyError on a completion"),
        (_one(exc=SystemExit(3)), r"raised SystemExit: 3"),
        (
            _one(exc=type("FunctionTimedOut", (BaseException,), {})("2 s")),
            r"raised FunctionTimedOut: 2 s",
        ),  # fmt: skip
        (_one("0.5"), r"returned '0.5' \(str\)"),
        (_one(None), r"returned None \(NoneType\)"),
        (_one([1.0]), r"returned \[1.0\] \(list\)"),
        (_one(float("nan")), r"returned nan \(float\)"),
        (
            _one(10**400),
            r"returned 1000.* \(int\) for a completion: a reward must be a finite number",
        ),
        (_one(1e308), r"returned 1e\+308 \(float\).*magnitude at most 1e\+30"),
        (_one(1j), r"returned 1j \(complex\)"),
    ],
)
def test_bad_rewards_stop_the_job_in_one_line(reward, match) -> None:
    from wanka.post.prompts import TaggedPrompt
    from wanka.post.rl import _rewards

    with pytest.raises(ValueError, match=r"post.reward='my:fn' " + match) as info:
        _rewards(reward, [TaggedPrompt("p", "code")], ["c"], "my:fn")
    assert "\n" not in str(info.value)


def test_a_raising_reward_leaves_its_traceback_in_the_log(caplog) -> None:
    from wanka.post.prompts import TaggedPrompt
    from wanka.post.rl import _rewards

    def my_reward(prompt, completion, domain):
        return {"a": 1}[completion]

    with caplog.at_level("ERROR", logger="wanka.post.rl"), pytest.raises(ValueError) as info:
        _rewards(my_reward, [TaggedPrompt("p", "code")], ["def f(): pass"], "my:fn")
    assert "traceback is in RUN_DIR/logs/rank*.log" in str(info.value)
    (rec,) = caplog.records
    text = caplog.text
    assert rec.exc_info is not None and "in my_reward" in text and "KeyError" in text
    assert rec.console is False  # rank 0's console handler skips it: one line there
    assert "'def f(): pass'" in text  # the completion it failed on


def test_numeric_rewards_of_any_number_type_are_taken() -> None:
    import numpy as np
    import torch

    from wanka.post.prompts import TaggedPrompt
    from wanka.post.rl import _rewards

    prompts = [TaggedPrompt("p", "code")] * 4
    values = iter([True, np.float32(0.5), torch.tensor(-2.0), 7])
    got = _rewards(lambda p, c, d: next(values), prompts, ["c"] * 4, "my:fn")
    assert got.tolist() == [1.0, 0.5, -2.0, 7.0]


def test_ctrl_c_inside_a_reward_is_not_the_rewards_fault() -> None:
    from wanka.post.prompts import TaggedPrompt
    from wanka.post.rl import _rewards

    with pytest.raises(KeyboardInterrupt):
        _rewards(_one(exc=KeyboardInterrupt()), [TaggedPrompt("p", "code")], ["x"], "m:f")

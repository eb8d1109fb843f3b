"""The Python-syntax reward (including the completions a policy could game it with) and
loading user reward functions."""

from __future__ import annotations

import sys
import time

import pytest

from wanka.post.rewards import MAX_CHARS, load_reward, python_parses, source_compiles

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

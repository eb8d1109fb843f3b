"""Verifiable rewards for ``wanka rl``: a built-in Python-syntax reward and user functions.

A reward is any ``(prompt, completion, domain) -> float`` callable; ``load_reward`` resolves a
spec (a built-in name or ``package.module:function``) to one.
"""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Callable

Reward = Callable[[str, str, str], float]

# ast.parse is roughly linear in its input, and RL completions are short (at most a few KB: a
# few hundred tokens), so one call takes well under a millisecond. Longer inputs earn nothing
# rather than letting a pathological sample stall the rollout.
MAX_CHARS = 1 << 16

# Statements that do nothing useful: a completion made only of these earns nothing.
_TRIVIAL = (ast.Pass, ast.Break, ast.Continue)


def _is_trivial(node: ast.stmt) -> bool:
    # A bare constant (docstring, ``...``, ``1``) or name as a statement does nothing either.
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant | ast.Name):
        return True
    return isinstance(node, _TRIVIAL)


def python_parses(
    prompt: str, completion: str, domain: str = "code", min_code_lines: int = 2
) -> float:
    """1.0 when the completion continues the Python source ``prompt`` into code that parses.

    The completion is cut after its last newline (a sampled completion stops mid-line when its
    token budget runs out; that partial line is dropped, and a completion with no newline keeps
    nothing). It earns 1.0 when ``prompt + kept`` parses and compiles (``ast.parse``, then
    ``compile``, which also rejects e.g. a top-level ``return``; nothing is executed) and
    ``kept`` starts at least ``min_code_lines`` statements on distinct lines whose text
    (stripped) differs from every other counted line and from every line of the prompt.
    Else 0.0.

    What that rules out (the degenerate completions a policy would otherwise find): blank or
    comment-only lines; docstrings and other bare constants, bare names, ``pass``, ``break``,
    ``continue`` (not counted as statements); one line repeated; lines copied from the prompt;
    an unterminated string or bracket that swallows the rest (no statement starts inside it).
    What it does not catch: any *new* syntactically valid code is accepted, however pointless
    (``x = 1`` / ``y = 2``), and nothing checks names are defined or the code runs: this
    rewards syntax, not meaning. ``domain`` is accepted for the reward interface and ignored.

    Never raises: any input that does not parse (including null bytes, too-deep nesting and
    inputs over ``MAX_CHARS``) or is not a string earns 0.0.
    """
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return 0.0
    try:
        return _python_parses(prompt, completion, min_code_lines)
    except (RecursionError, MemoryError):
        return 0.0


def _compiled_tree(source: str) -> ast.Module | None:
    """The AST when ``source`` parses *and* compiles, else None.

    Compiling too catches what ``ast.parse`` lets through but Python rejects: ``return`` or
    ``yield`` outside a function, ``break`` outside a loop, a late ``from __future__``... Nothing
    is executed.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning on e.g. "\d" would flood the logs
            tree = ast.parse(source)
            compile(tree, "<completion>", "exec", dont_inherit=True)
    except Exception:  # SyntaxError, ValueError (null bytes), and whatever else the parser has
        return None
    return tree


def source_compiles(source: str) -> bool:
    """Whether ``source`` is valid Python (parses and compiles); never raises."""
    try:
        return isinstance(source, str) and _compiled_tree(source) is not None
    except (RecursionError, MemoryError):
        return False


def _normalise_newlines(text: str) -> str:
    # Python's tokenizer reads \r\n and \r as newlines; so must the line counting below.
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _python_parses(prompt: str, completion: str, min_code_lines: int) -> float:
    prompt, completion = _normalise_newlines(prompt), _normalise_newlines(completion)
    kept = completion[: completion.rfind("\n") + 1]  # "" when there is no newline
    if len(prompt) + len(kept) > MAX_CHARS:
        return 0.0
    source = prompt + kept
    tree = _compiled_tree(source)
    if tree is None:
        return 0.0
    if min_code_lines <= 0:
        return 1.0
    # Lines (1-based) of the prompt, including a last line the completion finishes.
    prompt_lines = prompt.count("\n") + (0 if prompt.endswith("\n") or not prompt else 1)
    lines = source.split("\n")
    starts = {
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.stmt) and node.lineno > prompt_lines and not _is_trivial(node)
    }
    seen = {line.strip() for line in prompt.split("\n")}
    new_lines = 0
    for lineno in sorted(starts):
        text = lines[lineno - 1].strip() if lineno <= len(lines) else ""
        if text and text not in seen:
            seen.add(text)
            new_lines += 1
    return 1.0 if new_lines >= min_code_lines else 0.0


BUILTIN_REWARDS: dict[str, Reward] = {"python_parses": python_parses}


def load_reward(spec: str) -> Reward:
    """A built-in reward by name, or a user function given as ``package.module:function``.

    The module is imported as usual, so it must be importable (installed, or on ``PYTHONPATH``).
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    builtin = ", ".join(sorted(BUILTIN_REWARDS))
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"reward {spec!r}: not a built-in ({builtin}) nor of the form package.module:function"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward {spec!r}: cannot import module {module_name!r} ({e}); "
            "install it or add its directory to PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(
            f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}; "
            "check the name after the colon"
        )
    if not callable(fn):
        raise ValueError(
            f"reward {spec!r}: {module_name}.{attr} is a {type(fn).__name__}, not a function "
            "(prompt, completion, domain) -> float"
        )
    return fn

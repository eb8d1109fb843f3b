"""Verifiable rewards for ``wanka rl``: a built-in Python-syntax reward and user functions.

A reward is any ``(prompt, completion, domain) -> float`` callable; ``load_reward`` resolves a
spec (a built-in name or ``package.module:function``) to one.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import inspect
import os
import pkgutil
import re
import sys
import unicodedata
import warnings
from collections.abc import Callable

Reward = Callable[[str, str, str], float]

# ast.parse is roughly linear in its input, and RL completions are short (at most a few KB: a
# few hundred tokens), so one call takes well under a millisecond. Longer inputs earn nothing
# rather than letting a pathological sample stall the rollout.
MAX_CHARS = 1 << 16

# Statements that do nothing useful: a completion made only of these earns nothing.
_TRIVIAL = (ast.Pass, ast.Break, ast.Continue)


# What makes an expression statement do something; without one (a docstring, ``...``, a name,
# ``a, b``, ``x == 1``) it is dead code, and a policy finds it is the cheapest line that parses.
_EFFECTS = (ast.Call, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)


def _is_trivial(node: ast.stmt) -> bool:
    if isinstance(node, ast.Expr):
        return not any(isinstance(n, _EFFECTS) for n in ast.walk(node.value))
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
    comment-only lines; expression statements with no call, ``await``, ``yield`` or ``:=`` in
    them (docstrings, bare names, ``a, b``, ``x == 1``), ``pass``, ``break``, ``continue`` (not
    counted as statements); one line repeated; lines copied from the prompt;
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


# Block headers that only parse after an opener: the line is checked inside one.
_OPENERS = {"elif": "if x:\n pass\n", "else": "if x:\n pass\n",
            "except": "try:\n pass\n", "finally": "try:\n pass\n"}  # fmt: skip


def _parse_line(text: str) -> tuple[ast.Module, int] | None:
    """One stripped line parsed on its own (a statement or block header), and how many lines of
    scaffolding come before it; None when it does not parse.

    Only the parser is asked (``return`` or ``break`` are fine inside a function or loop the line
    may be in); a header (``def f(x):``, ``else:``) is given a body, ``elif`` / ``else`` /
    ``except`` / ``finally`` a matching opener, ``try:`` a ``finally``, a decorator a function.
    """
    words = text.split(":")[0].split()
    keyword = words[0] if words else ""
    opener = _OPENERS.get(keyword, "")
    source = opener + text + ("\n pass\n" if text.endswith(":") else "\n")
    if keyword == "try":
        source += "finally:\n pass\n"
    elif text.startswith("@"):
        source += "def _():\n pass\n"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(source), opener.count("\n")
    except Exception:  # SyntaxError, ValueError (null bytes), ...
        return None


class _Line:
    """What one parsed line does: the names it reads, binds for later lines, binds for itself
    (arguments, comprehension variables: a line's assignments do not count, ``a = a`` reads
    a name that does not exist), the modules it imports, and its shape."""

    def __init__(self, tree: ast.Module, skip: int, header: bool) -> None:
        self.reads: set[str] = set()
        self.binds: set[str] = set()
        self.local: set[str] = set()
        self.modules: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", skip + 1) <= skip:
                continue  # the opener's scaffolding
            if isinstance(node, ast.Name):
                (self.reads if isinstance(node.ctx, ast.Load) else self.binds).add(node.id)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.binds.add(node.name)
            elif isinstance(node, ast.arg):  # for the line, and for a def's body after it
                self.local.add(node.arg)
                self.binds.add(node.arg)
            elif isinstance(node, ast.comprehension):
                self.local.update(n.id for n in ast.walk(node.target) if isinstance(n, ast.Name))
            elif isinstance(node, ast.alias):
                self.binds.add(node.asname or node.name.split(".")[0])
            elif isinstance(node, ast.Import):
                self.modules.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                self.modules.add(node.module.split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                self.binds.add(node.name)
            elif isinstance(node, ast.Global | ast.Nonlocal):
                self.binds.update(node.names)
        for node in ast.walk(tree):  # literals do not make a line new: print(1), print(2)
            if isinstance(node, ast.Constant):
                node.value = None
        self.key = ast.dump(tree)
        # A header with the body we gave it is judged by what follows it (_completed); a line
        # with statements of its own (`x = 1; pass`, `if x: pass`, `else: pass`) by those.
        own = tree.body if skip == 0 else [
            n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno > skip
        ]  # fmt: skip
        self.trivial = not header and all(_does_nothing(n) for n in own)


def _does_nothing(node: ast.stmt) -> bool:
    # A statement that does nothing, or a header whose inline body does nothing (`if x: pass`).
    if _is_trivial(node):
        return True
    body = getattr(node, "body", None)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or not body:
        return False
    return all(_does_nothing(n) for n in body) and not getattr(node, "orelse", None)


@functools.cache
def _installed_modules() -> frozenset[str]:
    """Top-level module names Python could import here, listed without importing anything: a
    completion's ``import`` is looked up in this set, never handed to the import system (whose
    finders can run code, e.g. setuptools' distutils hook)."""
    found = {m.name for m in pkgutil.iter_modules()}
    return frozenset(found | set(sys.stdlib_module_names) | set(sys.builtin_module_names))


def _share_existing(line: _Line, known: set[str]) -> float:
    """The share of what a line reads (names, imported modules) that exists; 0 for a line that
    reads nothing (``x = 1``, ``else:``) and for a module imported again."""
    modules = _installed_modules()
    checks = [r in known or r in line.local for r in line.reads]
    checks += [m in modules and m not in known for m in line.modules]
    return sum(checks) / len(checks) if checks else 0.0


_IDENTIFIER = re.compile(r"[^\W\d]\w*")


def _indent(line: str) -> int:
    return len(line.expandtabs(8)) - len(line.expandtabs(8).lstrip())


def python_lines(prompt: str, completion: str, domain: str = "code", min_lines: int = 2) -> float:
    """How much of the completion is new, non-trivial Python that uses names that exist, line
    by line, in [0, 1].

    A graded form of ``python_parses`` for policies too weak to write a whole block that parses
    (a small byte-level model almost never does, so GRPO would see no signal). Each complete
    line of the completion (cut after its last newline, as there) that is not blank or a comment
    counts. A counted line earns 1/2 when, stripped of its indentation, it parses on its own as
    a statement or block header (``_parse_line``); it is new: its parsed form, literals aside,
    differs from every line of the prompt and every earlier line of the completion (so
    spacing, a ``;``, a comment or another number do not make a copy new); it is not trivial (as
    in ``python_parses``: an expression with no call in it such as ``x,``, ``pass``, ``break``;
    also ``if x: pass``); and a header (ending in ``:``) is followed by a deeper-indented line,
    a decorator (after any others) by ``def`` or ``class``. It earns up to 1/2 more in
    proportion to the share of what it reads that exists: a name that is a builtin, appears in
    the prompt, or was bound by an earlier line (a line's own assignment does not count:
    ``a = a``), or by the line for itself (arguments, comprehension variables); a module
    imported for the first time that is installed (looked up in a list, nothing is imported). A
    line that reads nothing (``x = 1``, ``else:``) earns only the first half. Reward = credit /
    max(counted, ``min_lines``): comments and blank lines change nothing, and one good line
    alone earns at most 1 / ``min_lines``.

    Why both halves: with syntax alone, the first policy trained on it learned columns of
    ``x,``, and once those were trivial, columns of invented calls ``foo()``; asking for
    existing names only leaves a small model almost no reward to find (the bench base scored
    0.002 under that rule, mean over 128 held-out prompts).

    What it does not check: that the lines fit together beyond headers (a statement spanning
    lines counts against), attributes, types, that anything runs. A name in the prompt's
    comments or strings counts as existing. A prompt that stops mid-line is continued by the
    completion's first line (counted only if the completion writes something on it).
    ``domain`` is accepted for the reward interface and ignored. Never raises: non-strings or
    inputs over ``MAX_CHARS`` earn 0.0, a line the parser rejects earns nothing.
    """
    if not isinstance(prompt, str) or not isinstance(completion, str):
        return 0.0
    try:
        return _python_lines(prompt, completion, min_lines)
    except (RecursionError, MemoryError):  # e.g. ast.dump of thousands of nested operators
        return 0.0


def _python_lines(prompt: str, completion: str, min_lines: int) -> float:
    prompt, completion = _normalise_newlines(prompt), _normalise_newlines(completion)
    kept = completion[: completion.rfind("\n") + 1]
    if len(prompt) + len(kept) > MAX_CHARS:
        return 0.0
    head, _, tail = prompt.rpartition("\n")
    first, _, rest = kept.partition("\n")
    # A prompt that stops mid-line: its last line and the completion's first form one line,
    # counted only if the completion adds something to it.
    lines = ([tail + first] if first.strip() else []) + rest.split("\n")[:-1] if kept else []
    lines = [ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    known = set(dir(builtins))
    known.update(unicodedata.normalize("NFKC", w) for w in _IDENTIFIER.findall(prompt))
    seen = set()
    for line in head.split("\n"):
        parsed = _parse_or_none(line.strip())
        seen.add(_Line(*parsed, header=False).key if parsed else line.strip())
    credit = 0.0
    for i, line in enumerate(lines):
        text = line.strip()
        parsed = _parse_or_none(text)
        if parsed is None:
            seen.add(text)
            continue
        info = _Line(*parsed, header=text.endswith(":") or text.startswith("@"))
        new = info.key not in seen
        seen.add(info.key)
        if new and not info.trivial and _completed(text, line, lines[i + 1 :]):
            credit += 0.5 + 0.5 * _share_existing(info, known)
        known.update(info.binds)
        known.update(info.modules)
    return credit / max(len(lines), min_lines, 1)


def _parse_or_none(text: str) -> tuple[ast.Module, int] | None:
    try:
        return _parse_line(text) if text else None
    except (RecursionError, MemoryError):
        return None


def _completed(text: str, line: str, after: list[str]) -> bool:
    """A header needs a deeper-indented line after it, a decorator a def, class or decorator."""
    if text.startswith("@"):
        nxt = next((a.strip() for a in after if not a.strip().startswith("@")), "")
        return nxt.startswith(("def ", "class ", "async def "))
    if text.endswith(":"):
        return bool(after) and _indent(after[0]) > _indent(line)
    return True


BUILTIN_REWARDS: dict[str, Reward] = {"python_parses": python_parses, "python_lines": python_lines}
# The built-in rewards judge Python: `wanka rl` with them uses the built-in code prompts.
PYTHON_REWARDS = frozenset(BUILTIN_REWARDS)


@contextlib.contextmanager
def kept_as_it_was():
    """What a reward function (or its module, as it loads) may change and the job depends on,
    put back: the working directory (a reward that runs completions in a sandbox folder, as
    code rewards do, and chdirs there: the checkpoints of a relative run.dir were written
    under the sandbox, and a rerun started over) and torch's grad mode (a scorer that calls
    torch.set_grad_enabled(False): the policy's next forward had no graph, a traceback at
    the first backward). Torch is not imported here for a built-in reward's sake."""
    torch = sys.modules.get("torch")
    grad = torch.is_grad_enabled() if torch is not None else True
    try:
        cwd = os.getcwd()
    except OSError:  # the folder it runs in is gone: nothing to go back to
        cwd = None
    try:
        yield
    finally:
        if (torch := sys.modules.get("torch")) is not None:
            torch.set_grad_enabled(grad)
        try:
            if cwd is not None:
                os.chdir(cwd)
        except OSError:  # gone meanwhile: nothing to go back to
            pass


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
        with kept_as_it_was():  # a scoring module may turn grad off or chdir as it loads
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward {spec!r}: cannot import module {module_name!r} ({e}); "
            "install it or add its directory to PYTHONPATH"
        ) from None
    except (Exception, SystemExit) as e:  # the module's own code failed: a SyntaxError, ...
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"reward {spec!r}: importing module {module_name!r} raised "
            f"{type(e).__name__}{': ' + first if first else ''}; fix the module"
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
    # An async or generator function passes the signature check, then each call returns a
    # coroutine or generator, not a number: the job stopped at its first step, not here.
    # (an instance with an async __call__ too: its bound __call__ is what runs)
    plain = inspect.isfunction(fn) or inspect.ismethod(fn) or isinstance(fn, type)
    call = fn if plain else type(fn).__call__
    wrap = "wrap it, e.g. def reward(p, c, d): return asyncio.run(my_reward(p, c, d))"
    for test, kind, hint in (
        (inspect.iscoroutinefunction, "an async function", wrap),
        (inspect.isasyncgenfunction, "an async generator", "return the number, not yield it"),
        (inspect.isgeneratorfunction, "a generator function", "return the number, not yield it"),
    ):
        if test(fn) or test(call):
            raise ValueError(
                f"reward {spec!r}: {module_name}.{attr} is {kind}: a reward is called as a plain "
                f"function (prompt, completion, domain) -> float; {hint}"
            )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: they are called as they are
        signature = None
    if signature is not None:
        try:
            signature.bind("", "", "")
        except TypeError as e:
            raise ValueError(
                f"reward {spec!r}: {module_name}.{attr}{signature} cannot be called as "
                f"(prompt, completion, domain) ({e}); give it those three arguments"
            ) from None
    return fn

"""Help that helps: every option of every command explains itself, shows its default, and
points at no source file; `wanka --version`; bare `wanka` prints the help."""

import argparse

from wanka.cli import build_parser, main


def _parsers(p: argparse.ArgumentParser, path: str = "wanka"):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, f"{path} {name}")


def test_every_option_has_a_help_line_without_source_pointers():
    missing, pointers = [], []
    for path, p in _parsers(build_parser()):
        for a in p._actions:
            if isinstance(
                a, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction
            ):
                continue
            if not a.help:
                missing.append(f"{path} {a.option_strings or a.dest}")
            elif ".py" in a.help or "src/" in a.help:
                pointers.append(f"{path} {a.option_strings or a.dest}: {a.help}")
    assert not missing, missing
    assert not pointers, pointers


def test_defaults_are_shown(capsys):
    for argv in (["train", "--help"], ["data", "prepare", "--help"], ["bench", "ops", "--help"]):
        try:
            main(argv)
        except SystemExit:
            pass
    out = capsys.readouterr().out
    assert "(default: 0.01)" in out and "(default: runs/bench/ops.json)" in out


def test_version_and_bare_command(capsys):
    try:
        main(["--version"])
    except SystemExit as e:
        assert e.code == 0
    assert capsys.readouterr().out.startswith("wanka 0.")
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: wanka" in out and "mixture-of-experts" in out and "train" in out


def test_the_cli_answers_bad_input_before_importing_torch():
    import subprocess
    import sys

    code = "import sys, wanka.cli; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr

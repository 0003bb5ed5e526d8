"""docs/DESIGN.md's "A new command", checked for every script in scripts/*.py and every console script, so
that a new command that skips a step fails here: its script is a thin entry to a package's main, setup.cfg's
commands are those mains, each main ends a mistake through exit_on_config_error or its process through
run_launched, and its flags come first (--version, --help and a flag argparse refuses write nothing).
Each numeric flag's check is tests/test_numeric_options.py's."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from fathom.common.cli import versions
from tests.helpers import ROOT
from tests.test_numeric_options import COMMANDS, MAINS, SCRIPTS
from tests.test_package import console_scripts

# Where a process may end otherwise (each main's own AST is read, not the functions it calls).
EXITS = ("exit_on_config_error", "run_launched")
NO_MISTAKE = {"list_schemes": "reads nothing but its flags, which argparse checks"}


def entry(script: str) -> tuple[dict[str, str], ast.Call]:
    """A script's fathom imports (name -> module) and the one call under `if __name__ == "__main__":`;
    fails on anything else a thin entry would not hold."""
    tree = ast.parse((ROOT / "scripts" / f"{script}.py").read_text())
    _, *body, run = tree.body
    assert ast.get_docstring(tree), f"scripts/{script}.py: start with a docstring saying what it runs"
    imports = {}
    for node in body:
        assert isinstance(node, ast.ImportFrom) and node.module.startswith("fathom."), (
            f"scripts/{script}.py: only `from fathom.PACKAGE import main` before the call, got {ast.unparse(node)}"
        )
        imports |= {alias.name: node.module for alias in node.names}
    assert isinstance(run, ast.If) and ast.unparse(run.test) == "__name__ == '__main__'" and len(run.body) == 1, (
        f'scripts/{script}.py: end with one call under `if __name__ == "__main__":`'
    )
    (call,) = [node.value for node in run.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    return imports, call


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_script_is_a_thin_entry_to_a_main(script):
    imports, call = entry(script)
    assert set(imports) <= {"main", "run_launched"} and "main" in imports, f"scripts/{script}.py imports {imports}"
    assert imports.get("run_launched", "fathom.pipeline.world.distributed") == "fathom.pipeline.world.distributed"
    expected = "run_launched(main)" if "run_launched" in imports else "main()"
    assert ast.unparse(call) == expected, f"scripts/{script}.py runs {ast.unparse(call)}; run {expected}"


def test_every_console_script_is_a_scripts_main():
    """The other way round is test_package's: every script users run has its console script."""
    scripts = {f"{entry(script)[0]['main']}:main" for script in SCRIPTS}
    strays = {name: target for name, target in console_scripts().items() if target not in scripts}
    assert not strays, f"give each its scripts/*.py: {strays}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_main_ends_through_exit_on_config_error_or_run_launched(script):
    imports, call = entry(script)
    module = importlib.import_module(imports["main"])
    (main,) = [node for node in ast.parse(module.__loader__.get_source(module.__name__)).body
               if isinstance(node, ast.FunctionDef) and node.name == "main"]  # fmt: skip
    called = {ast.unparse(node.func) for tree in (main, call) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    if script in NO_MISTAKE:
        assert not called & set(EXITS), f"{script}: remove it from NO_MISTAKE"
        return
    assert called & set(EXITS), (
        f"{module.__name__}.main: run its work inside `with exit_on_config_error():`, or the process through "
        f"run_launched (or say in NO_MISTAKE why it has no mistake to report)"
    )


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """Commands run in this process, in an empty working directory: run_launched calls main without ending
    the process (os._exit) when main is done."""
    monkeypatch.chdir(tmp_path)
    for main in MAINS.values():
        module = importlib.import_module(main.__module__)
        if hasattr(module, "run_launched"):
            monkeypatch.setattr(module, "run_launched", lambda launched: launched())
    return tmp_path


def run(command: str, flag: str) -> int:
    script, *subcommand = command.split()
    try:
        MAINS[script]([*subcommand, flag])
    except SystemExit as exit_:
        return exit_.code
    return 0


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_come_first_and_write_nothing(command, in_process, capsys):
    """--version and --help end with status 0, and a flag the command lacks in argparse's usage and
    `PROG: error:` line with status 2, all before the command reads, starts or writes anything."""
    assert run(command, "--version") == 0 and capsys.readouterr() == (versions() + "\n", "")
    assert run(command, "--help") == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: ") and err == ""
    assert run(command, "--no-such-flag") == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0].startswith("usage: ") and re.fullmatch(r"\S+: error: .+", lines[-1]), err
    assert not any(in_process.iterdir())

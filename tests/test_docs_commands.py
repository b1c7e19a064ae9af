"""The short commands the README and docs/ show run as written: every `angel-jax config`, `angel-jax train ...
--print-config` and `angel-jax plan ... --estimate` in their code blocks exits 0 (nothing is trained: a plan with
--estimate allocates nothing of the model). Each runs in a fresh directory beside a link to experiments/, so that a
plan's files land there and not in the working tree's runs/."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_docs_commands", ROOT / "scripts" / "check_docs_commands.py")
checker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checker)  # the script that runs every command: the blocks are read as it reads them
PAGES = checker.PAGES


def shell_lines(page: Path) -> list[str]:
    """The command lines of a page's runnable code blocks (no language, sh or bash), continuation lines joined."""
    return [line for line, is_command in checker.runnable_lines(page) if is_command]


MARKERS = checker.MARKERS
"""A command line whose comment says one of these is not run on a CPU (docs/development.md, "Code blocks")."""


def angel_args(line: str) -> list[str] | None:
    """The arguments of an `angel-jax` command line of a runnable block (None: another line, or one marked as
    needing a GPU or a cluster)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if any(marker in line for marker in MARKERS):
        return None
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)] if words else words  # XLA_FLAGS=... prefixes
    if not words or words[0] not in ("angel-jax", ".venv/bin/angel-jax"):
        return None
    return words[1:]


def placeholders(args: list[str]) -> list[str]:
    """The words of a command that stand for something to fill in: CONFIG, RUN_DIR, [key=value ...], /path/..."""
    return [a for a in args if re.fullmatch(r"[A-Z][A-Z0-9_]*", a) or a.startswith(("[", "/path"))]


def command(line: str) -> list[str] | None:
    """The angel-jax arguments of `line` when it is a cheap command written out in full, else None."""
    args = angel_args(line)
    if args is None or placeholders(args):
        return None
    if args[:1] == ["config"] or (args[:1] == ["train"] and "--print-config" in args) or (
            args[:1] == ["plan"] and "--estimate" in args):
        return args
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found: dict[str, tuple[str, list[str]]] = {}
    for page in PAGES:
        for line in shell_lines(page):
            args = command(line)
            if args is not None:
                found.setdefault(shlex.join(args), (page.name, args))
    return sorted(found.values(), key=lambda item: shlex.join(item[1]))


COMMANDS = documented_commands()


def test_runnable_blocks_hold_no_placeholders():
    """Every angel-jax command of a runnable block (no fence language, sh or bash) is written out in full, or is
    marked as needing a GPU or a cluster; a synopsis with placeholders goes in a `text` block."""
    found = [f"{page.name}: {line.strip()}" for page in PAGES for line in shell_lines(page)
             if (args := angel_args(line)) is not None and placeholders(args)]
    assert not found, "placeholders in runnable code blocks:\n" + "\n".join(found)


def test_runnable_blocks_hold_only_commands():
    """Every line of a runnable block is a command, a comment or `source .venv/bin/activate`: output shown in a
    block without a language would be read as commands to run (scripts/check_docs_commands.py fails on it too)."""
    found = [f"{page.name}: {line}" for page in PAGES for line in checker.stray_lines(page)]
    assert not found, "lines of runnable code blocks that are no command (a ```text block?):\n" + "\n".join(found)


def test_the_docs_show_cheap_commands():
    names = {args[0] for _, args in COMMANDS}
    assert {"config", "train", "plan"} <= names, COMMANDS


@pytest.mark.parametrize("page,args", COMMANDS, ids=[shlex.join(a) for _, a in COMMANDS])
def test_documented_command_runs(page: str, args: list[str], tmp_path: Path, monkeypatch, capsys):
    """In this process (`cli.main`, as the console script calls it): a child per command cost ~10 s of imports."""
    from angel_jax import cli

    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ANGEL_JAX_FAULTS", raising=False)
    code = cli.main(list(args))
    assert code == 0, f"`angel-jax {shlex.join(args)}` from {page} exited {code}:\n{capsys.readouterr().err[-3000:]}"

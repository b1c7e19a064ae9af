"""The short commands the README and docs/ show run as written: every `angel-jax config`, `angel-jax train ...
--print-config` and `angel-jax plan ... --estimate` in their code blocks exits 0 (nothing is trained: a plan with
--estimate allocates nothing of the model). Each runs in a fresh directory beside a link to experiments/, so that a
plan's files land there and not in the working tree's runs/."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shell_lines(text: str) -> list[str]:
    """The lines of a page's plain code blocks (no language, sh or bash), continuation lines joined."""
    out = []
    for block in re.findall(r"^```(?:sh|bash)?\n(.*?)^```", text, flags=re.S | re.M):
        out += block.replace("\\\n", " ").splitlines()
    return out


def command(line: str) -> list[str] | None:
    """The angel-jax arguments of `line` when it is a cheap command written out in full, else None."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    if not words or words[0] not in ("angel-jax", ".venv/bin/angel-jax"):
        return None
    args = words[1:]
    if any(re.fullmatch(r"[A-Z][A-Z0-9_]*", a) or a.startswith(("[", "/path")) for a in args):
        return None  # a placeholder: CONFIG, RUN_DIR, [key=value ...]
    if args[:1] == ["config"] or (args[:1] == ["train"] and "--print-config" in args) or (
            args[:1] == ["plan"] and "--estimate" in args):
        return args
    return None


def documented_commands() -> list[tuple[str, list[str]]]:
    found: dict[str, tuple[str, list[str]]] = {}
    for page in PAGES:
        for line in shell_lines(page.read_text()):
            args = command(line)
            if args is not None:
                found.setdefault(shlex.join(args), (page.name, args))
    return sorted(found.values(), key=lambda item: shlex.join(item[1]))


COMMANDS = documented_commands()


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

"""Run every command of the README's and docs/' runnable code blocks, as written, and say which fail.

    .venv/bin/python scripts/check_docs_commands.py            # run them all (tens of minutes: they train)
    .venv/bin/python scripts/check_docs_commands.py --list     # only list them, page by page
    .venv/bin/python scripts/check_docs_commands.py --page training.md --timeout 600

A runnable block is a code block with no language, `sh` or `bash` (docs/development.md, "Code blocks"); every
line of one is a command, a comment or `source .venv/bin/activate`, continuation lines joined. A command starts
with `angel-jax` (or `.venv/bin/angel-jax`), `.venv/bin/python`, `make`, `sbatch` or `srun`, after any
`NAME=value` environment assignments; a line whose comment says `needs a GPU` or `needs a cluster` is skipped,
and so are `make test` (the suite) and `make clean` (it would remove the environment this runs in). Any other
line (output shown in a block without a language: it wants ```text) fails the page. The commands run from the
repository's root in page order, with `.venv/bin` first on PATH (the docs assume `source .venv/bin/activate`),
each under a time limit, so that a page's later commands find what its earlier ones made (a run directory to
sample from, an export to read). Prints one line per command: ok / FAILED (exit status) / TIMEOUT and the time it
took, then the failures' last output lines; exit status 1 if any failed. tests/test_docs_commands.py reads the
blocks with `runnable_lines` and runs the cheap commands among them.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("needs a GPU", "needs a cluster")
STARTS = ("angel-jax ", ".venv/bin/angel-jax ", ".venv/bin/python ", "make ", "sbatch ", "srun ")
SKIPPED = ("make test", "make clean")
NOT_COMMANDS = ("source .venv/bin/activate",)
"""Lines a runnable block may hold besides commands and comments (the checker puts .venv/bin on PATH itself)."""
RUNNABLE = ("", "sh", "bash")
"""The fence languages of a runnable block."""


def runnable_blocks(text: str) -> list[str]:
    """The bodies of a page's runnable code blocks. Fences are paired line by line: the ``` that closes a ```text
    block opens nothing."""
    out, body, lang = [], None, ""
    for line in text.splitlines(keepends=True):
        if not line.startswith("```"):
            if body is not None:
                body.append(line)
        elif body is None:
            body, lang = [], line[3:].strip()
        else:
            if lang in RUNNABLE:
                out.append("".join(body))
            body = None
    return out


def command_of(line: str) -> str | None:
    """The command word onwards of a logical line of a runnable block (past a `$ ` prompt and `NAME=value`
    assignments), '' for a blank line, a comment or an allowed non-command, None for anything else."""
    line = line.strip()
    line = line[2:] if line.startswith("$ ") else line
    if not line or line.startswith("#") or line.startswith(NOT_COMMANDS):
        return ""
    rest = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", line)
    return line if rest.startswith(STARTS) else None


def runnable_lines(page: Path) -> list[tuple[str, bool]]:
    """(line, is_command) for every logical line of the page's runnable blocks that is not blank, a comment or
    an allowed non-command: a command to run as written (those marked as needing a GPU or a cluster included), or
    a line that is none of these (False)."""
    out = []
    for block in runnable_blocks(page.read_text()):
        for line in _logical_lines(block):
            cmd = command_of(line)
            if cmd != "":
                out.append((line.strip() if cmd is None else cmd, cmd is not None))
    return out


def commands(page: Path) -> list[str]:
    """The commands of the page's runnable blocks this checker runs (not those marked as needing a GPU or a
    cluster, not `make test` or `make clean`)."""
    return [line for line, is_command in runnable_lines(page) if is_command
            and not any(m in line for m in MARKERS) and not line.startswith(SKIPPED)]


def stray_lines(page: Path) -> list[str]:
    """Lines of the page's runnable blocks that are no command: output shown in a block without a language."""
    return [line for line, is_command in runnable_lines(page) if not is_command]


def _logical_lines(block: str) -> list[str]:
    """The block's lines, continuation lines joined, and a line whose quote is still open joined with the next
    (a prompt of several lines)."""
    out: list[str] = []
    pending = ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:
            continue
        out.append(pending)
        pending = ""
    return out + ([pending] if pending else [])


def run(line: str, timeout: float) -> tuple[str, float, str]:
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    start = time.monotonic()
    try:
        done = subprocess.run(["timeout", "-s", "KILL", str(int(timeout)), "bash", "-c", line], cwd=ROOT, env=env,
                              capture_output=True, text=True)
    except OSError as e:
        return f"FAILED ({e})", 0.0, ""
    took = time.monotonic() - start
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
    if done.returncode == 137 and took >= timeout - 1:
        return "TIMEOUT", took, tail
    return ("ok" if done.returncode == 0 else f"FAILED (exit {done.returncode})"), took, tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the commands, run nothing")
    p.add_argument("--page", action="append", default=[], help="only this page (e.g. README.md, training.md)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per command (default 900)")
    args = p.parse_args(argv)
    pages = [pg for pg in PAGES if not args.page or pg.name in args.page]
    failed = []
    for page in pages:
        for line in stray_lines(page):
            print(f"{page.name}: NOT A COMMAND: {line}" if args.list else
                  f"{'NOT A COMMAND':<18} {0.0:7.1f} s  {page.name}: {line}", flush=True)
            failed.append((page.name, line, "a line of a runnable block (no fence language, sh or bash) that is no "
                                            "command: output goes in a ```text block"))
        for line in commands(page):
            if args.list:
                print(f"{page.name}: {line}")
                continue
            verdict, took, tail = run(line, args.timeout)
            print(f"{verdict:<18} {took:7.1f} s  {page.name}: {line}", flush=True)
            if verdict != "ok":
                failed.append((page.name, line, tail))
    if not args.list:
        for name, line, tail in failed:
            print(f"\n{name}: {line}\n" + "\n".join(f"    {t}" for t in tail.splitlines()))
        print(f"\n{len(failed)} failed" if failed else "\nevery command ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Run every command of the README's and docs/' runnable code blocks, as written, and say which fail.

    .venv/bin/python scripts/check_docs_commands.py            # run them all (tens of minutes: they train)
    .venv/bin/python scripts/check_docs_commands.py --list     # only list them, page by page
    .venv/bin/python scripts/check_docs_commands.py --page training.md --timeout 600

A runnable block is a code block with no language, `sh` or `bash` (docs/development.md, "Code blocks"); its lines
that start with `angel-jax` (or `.venv/bin/angel-jax`), `sbatch` or `make` are the commands, continuation lines
joined; a line whose comment says `needs a GPU` or `needs a cluster` is skipped, and so are `make test` (the
suite) and `make clean` (it would remove the environment this runs in). The commands run from the repository's
root in page order, with `.venv/bin` first on PATH (the docs assume `source .venv/bin/activate`), each under a
time limit, so that a page's later commands find what its earlier ones made (a run directory to sample from, an
export to read). Prints one line per command: ok / FAILED (exit status) / TIMEOUT and the time it took, then the
failures' last output lines; exit status 1 if any failed.
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
STARTS = ("angel-jax ", ".venv/bin/angel-jax ", "make ", "sbatch ")
SKIPPED = ("make test", "make clean")


def commands(page: Path) -> list[str]:
    out = []
    for block in re.findall(r"^```(?:sh|bash)?\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        for line in _logical_lines(block):
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if not line.startswith(STARTS) or any(m in line for m in MARKERS):
                continue
            if line.startswith(SKIPPED):
                continue
            out.append(line)
    return out


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
        for line in commands(page):
            if args.list:
                print(f"{page.name}: {line}")
                continue
            verdict, took, tail = run(line, args.timeout)
            print(f"{verdict:<18} {took:7.1f} s  {page.name}: {line}", flush=True)
            if verdict != "ok":
                failed.append((page.name, line, tail))
    for name, line, tail in failed:
        print(f"\n{name}: {line}\n" + "\n".join(f"    {t}" for t in tail.splitlines()))
    if not args.list:
        print(f"\n{len(failed)} failed" if failed else "\nevery command ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

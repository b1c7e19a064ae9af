"""scripts/env_probe.py, which the set-up reads: the packages of the virtualenv an interpreter belongs to (a GPU
image's python3 is a virtualenv's, whose packages a `--system-site-packages` venv made from it would not see)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT

PROBE = REPO_ROOT / "scripts" / "env_probe.py"


def _sites(python: str) -> list[str]:
    out = subprocess.run([python, str(PROBE), "venv-sites"], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()


def test_a_virtualenvs_interpreter_names_its_own_site_packages():
    assert sys.prefix != sys.base_prefix, "the suite runs in a virtualenv"
    sites = _sites(sys.executable)
    assert sites and all(Path(s).is_dir() and Path(s).resolve().is_relative_to(Path(sys.prefix).resolve())
                         for s in sites)


def test_a_base_interpreter_names_none():
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert _sites(str(base)) == []

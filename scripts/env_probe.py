"""What an interpreter already has, for scripts/setup_env.sh. Standard library only (plus pip's vendored packaging
where present); imports no jax, so it is fast and needs no GPU.

  env_probe.py cuda-jax             exit 0 and print "JAX PLUGIN_CUDA" if this interpreter has a CUDA-enabled jax in
                                    pyproject.toml's range (jax, jaxlib and jax-cuda{13,12}-plugin of jaxlib's version);
                                    exit 1 (a reason on stdout when a CUDA plugin is there but unusable) if not
  env_probe.py missing EXTRA OUT    print "run REQ" / "EXTRA REQ" for each requirement of the project (and of EXTRA)
                                    that is not installed at a matching version; write to OUT the lines of
                                    constraints.txt for packages not installed at all (so an installed package is
                                    never replaced to satisfy a pin)
  env_probe.py venv-sites           print the site-packages folders of this interpreter's virtualenv, if it is one's
  env_probe.py build-backend        exit 0 if setuptools can build the editable install without build isolation
  env_probe.py cuda-devices         (imports jax) print the CUDA devices jax sees, or exit 1 with one line saying why
                                    it sees none
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
            from pip._vendor.packaging.version import Version
        except ImportError:
            return None, None
    return Requirement, Version


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def cuda_jax() -> int:
    jax, jaxlib = _version("jax"), _version("jaxlib")
    for cuda in ("13", "12"):
        plugin = _version(f"jax-cuda{cuda}-plugin")
        if plugin:
            break
    else:
        return 1
    if not jax or not jaxlib:
        print(f"jax-cuda{cuda}-plugin {plugin} without jax/jaxlib")
        return 1
    if plugin != jaxlib or _version(f"jax-cuda{cuda}-pjrt") not in (None, jaxlib):
        print(f"jax-cuda{cuda}-plugin {plugin} does not match jaxlib {jaxlib}")
        return 1
    Requirement, Version = _packaging()
    spec = next((r for r in _project()["dependencies"] if _name(r) == "jax"), None)
    if Requirement is not None and spec is not None:
        if not Requirement(spec).specifier.contains(Version(jax), prereleases=True):
            print(f"jax {jax} (with its CUDA {cuda} plugin) is outside angel_jax's range '{spec}'")
            return 1
    print(jax, cuda)
    return 0


def missing(extra: str, out: str) -> int:
    Requirement, _ = _packaging()
    if Requirement is None:
        print("neither packaging nor pip is importable", file=sys.stderr)
        return 2
    project = _project()
    groups = [("run", project["dependencies"])]
    for name in filter(None, extra.split(",")):
        groups.append((name, project["optional-dependencies"][name]))
    seen = set()
    for group, reqs in groups:
        for text in reqs:
            req = Requirement(text)
            if (req.marker and not req.marker.evaluate()) or _name(text) in seen:
                continue
            seen.add(_name(text))
            have = _version(req.name)
            if have is None or not req.specifier.contains(have, prereleases=True):
                print(group, text)
    lines = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#") and _version(_name(line)) is None:
            lines.append(line)
    Path(out).write_text("".join(f"{line}\n" for line in lines))
    return 0


def venv_sites() -> int:
    """The site-packages folders of this interpreter's virtualenv, one per line; nothing when it is none."""
    import site

    if sys.prefix == sys.base_prefix:
        return 0
    for folder in dict.fromkeys(site.getsitepackages()):
        if Path(folder).is_dir() and Path(folder).resolve().is_relative_to(Path(sys.prefix).resolve()):
            print(folder)
    return 0


def build_backend() -> int:
    _, Version = _packaging()
    setuptools = _version("setuptools")
    if setuptools is None or Version is None:
        return 1
    if Version(setuptools) >= Version("70.1"):  # bdist_wheel built in
        return 0
    return 0 if Version(setuptools) >= Version("68") and _version("wheel") else 1


def cuda_devices() -> int:
    import logging
    import os

    os.environ["JAX_PLATFORMS"] = "cuda"
    plugin = next((c for c in ("13", "12") if _version(f"jax-cuda{c}-plugin")), None)
    if _version("jax") is None or plugin is None:
        print(f"no CUDA-enabled jax in {sys.prefix} (its set-up chose the CPU: ACCEL=cuda forces CUDA)")
        return 1
    # A plugin that fails to start is logged, not raised; keep the last such record for the one-line reason.
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("jax").addHandler(Keep(logging.WARNING))
    logging.getLogger("jax").propagate = False
    try:
        import jax

        devices = jax.devices("cuda")
    except Exception as e:  # noqa: BLE001 - any failure means no device; say the most telling one
        cause = next((r.exc_info[1] for r in reversed(records) if r.exc_info and r.exc_info[1]), None) or e
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        import shutil

        where = "" if shutil.which("nvidia-smi") else " (no nvidia-smi on PATH: is there an NVIDIA GPU and driver here?)"
        print(f"jax with its CUDA {plugin} plugin sees no CUDA device: {text}{where}")
        return 1
    print(f"{len(devices)} CUDA device(s): {', '.join(sorted({d.device_kind for d in devices}))}")
    return 0


if __name__ == "__main__":
    cmd, *args = sys.argv[1:] or [""]
    if cmd == "cuda-jax":
        sys.exit(cuda_jax())
    if cmd == "venv-sites":
        sys.exit(venv_sites())
    if cmd == "missing":
        sys.exit(missing(*args))
    if cmd == "build-backend":
        sys.exit(build_backend())
    if cmd == "cuda-devices":
        sys.exit(cuda_devices())
    sys.exit(__doc__)

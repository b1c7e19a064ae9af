"""`angel-jax export --hf` is complete or absent: the weights, config.json and the tokenizer's files are written
into a directory beside the target and appear under it together. A disk that fills while the tokenizer is copied,
a kill in the middle, a target that is a file or sits where nothing can be written: one line, and nothing that
looks like a model under the target (an earlier export stays as it was)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import models
from angel_jax import cli
from angel_jax.data import hf_tokenizer as tokenizers_hf
from models import hf
from models.hf import staging
from test_hf_export_stream import FIXTURES, LLAMA, ROOT, random_params, read_all, synthetic_run

TOKENIZER = FIXTURES / "tokenizer"
CUT = 4096
"""Bytes of tokenizer.json written before the disk is full (the size the issue's export left)."""


def tokenizer_run(root: Path) -> Path:
    run_dir, _ = synthetic_run(root, paged=True, data={"tokenizer": "hf", "tokenizer_path": str(TOKENIZER)})
    return run_dir


def fill_up_at_tokenizer(self: Path, data, write_bytes=Path.write_bytes):
    """Path.write_bytes on a disk that fills while tokenizer.json is written: part of it lands, then ENOSPC."""
    if self.name != tokenizers_hf.TOKENIZER_FILE:
        return write_bytes(self, data)
    with open(self, "wb") as f:
        f.write(bytes(data)[:CUT])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as write() raises it: no file name


def the_export(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


def one_line(err: str) -> str:
    err = err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_disk_that_fills_during_the_tokenizer_copy_leaves_nothing(tmp_path, monkeypatch, capsys):
    """The weights and config.json are complete when tokenizer.json meets a full disk: one line, no target at all
    (a new export), or the earlier export byte for byte (--overwrite); no partial directory left beside it."""
    run_dir = tokenizer_run(tmp_path)
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_bytes", fill_up_at_tokenizer)
        assert cli.main(["export", str(run_dir), "--hf", str(out)]) == 1
    err = one_line(capsys.readouterr().err)
    assert f"cannot write the export {out}: No space left on device; nothing was written to {out}" in err
    assert not out.exists() and leftovers(tmp_path) == []

    assert cli.main(["export", str(run_dir), "--hf", str(out)]) == 0  # with room: complete
    assert (out / "tokenizer.json").read_bytes() == (TOKENIZER / "tokenizer.json").read_bytes()
    before = the_export(out)
    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_bytes", fill_up_at_tokenizer)
        assert cli.main(["export", str(run_dir), "--hf", str(out), "--overwrite", "--max-shard-size", "10KB"]) == 1
    one_line(capsys.readouterr().err)
    assert the_export(out) == before and leftovers(tmp_path) == []


def unwritable_directory(path: Path) -> Path:
    """A directory in which nothing can be created, even by root: chmod for a user, chattr +i (immutable) for
    root, where the file system and the capabilities allow it."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
    elif subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root where chattr +i is not possible: no directory refuses root's writes")
    try:
        (path / "probe").mkdir()
    except OSError:
        return path
    writable(path)
    pytest.skip(f"{path} still takes writes")


def writable(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o755)


@pytest.mark.parametrize("target", ["a file", "under a file", "unwritable parent"])
def test_a_wrong_target_is_one_line_and_nothing_is_written(target, tmp_path, capsys):
    run_dir = tokenizer_run(tmp_path)
    (tmp_path / "taken").write_text("mine\n")
    if target == "a file":
        out, says = tmp_path / "taken", f"{tmp_path / 'taken'} is a file, not a directory"
    elif target == "under a file":
        out, says = tmp_path / "taken" / "out", f"{tmp_path / 'taken'} is a file, not a directory"
    else:
        parent = unwritable_directory(tmp_path / "locked")
        out, says = parent / "out", f"cannot create a directory in {parent}"
    try:
        assert cli.main(["export", str(run_dir), "--hf", str(out)]) == 1
        assert says in one_line(capsys.readouterr().err)
        assert (tmp_path / "taken").read_text() == "mine\n"
        assert out == tmp_path / "taken" or not out.exists()
    finally:
        if target == "unwritable parent":
            writable(out.parent)
    assert leftovers(tmp_path) == []


CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from angel_jax import cli

write_bytes = Path.write_bytes

def stalls_at_tokenizer(self, data):
    # The weights and config.json are written; half of tokenizer.json is, when the process is killed.
    if self.name != "tokenizer.json":
        return write_bytes(self, data)
    with open(self, "wb") as f:
        f.write(bytes(data)[:4096])
        f.flush()
        Path(sys.argv[4]).touch()
        time.sleep(600)

Path.write_bytes = stalls_at_tokenizer
cli.main(["export", sys.argv[2], "--hf", sys.argv[3]])
"""


@pytest.mark.slow
def test_an_export_killed_while_writing_leaves_no_target(tmp_path):
    """SIGKILL while tokenizer.json is half written (the weights and config.json complete beside it): no target;
    the next export to it goes through and removes what the killed one left."""
    run_dir = tokenizer_run(tmp_path)
    out, marker = tmp_path / "out", tmp_path / "writing-tokenizer"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(ROOT), str(run_dir), str(out), str(marker)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240  # a guard against a hang, not a timing the test depends on
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), child.communicate(timeout=5) if child.poll() is not None else "no marker in 240 s"
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    assert not out.exists()
    [partial] = leftovers(tmp_path)  # what the killed export had written, under no name that looks like a model
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / partial).iterdir()}
    assert (tmp_path / partial / "tokenizer.json").stat().st_size == 4096

    assert cli.main(["export", str(run_dir), "--hf", str(out)]) == 0
    assert leftovers(tmp_path) == []
    assert set(the_export(out)) == {"config.json", "model.safetensors", *[
        n for n in tokenizers_hf.TOKENIZER_FILES if (TOKENIZER / n).is_file()]}
    assert read_all(out)


def test_without_an_atomic_swap_an_overwrite_still_replaces_the_export(tmp_path, monkeypatch):
    """Where renameat2 cannot swap the directories (another C library, a file system without it), the old export
    is renamed aside and the new one into place: the result is the same, the user's file stays."""
    def unsupported(a: Path, b: Path) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(a))

    out = tmp_path / "out"
    hf.export(LLAMA, models.get(LLAMA).split(random_params(LLAMA)), out)
    (out / "README.md").write_text("mine\n")
    monkeypatch.setattr(staging, "_exchange", unsupported)
    hf.export(LLAMA, models.get(LLAMA).split(random_params(LLAMA, seed=1)), out, overwrite=True,
              max_shard_size="10KB")
    assert (out / "README.md").read_text() == "mine\n" and "model.safetensors" not in the_export(out)
    assert read_all(out) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]

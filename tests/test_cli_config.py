"""The `angel-jax` CLI's config handling: `angel-jax config`, --print-config, and config errors that exit 2 naming
the key.
"""

from __future__ import annotations

import re

import pytest
import yaml

from angel_jax import cli
from angel_jax.config import describe, load_config, to_dict


def test_cli_config_lists_every_key(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == describe()
    assert re.search(r"^optimizer\.lr \(float, default 0\.001\): \S", out, re.M)


def test_cli_config_with_file_prints_resolved_values(capsys, tmp_path, write_tiny_config):
    cfg_path = write_tiny_config(tmp_path)
    assert cli.main(["config", str(cfg_path), "train.steps=7"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == to_dict(load_config(cfg_path, ["train.steps=7"]))


def test_cli_bad_override_exits_2_naming_the_key(capsys, tmp_path, write_tiny_config):
    cfg_path = write_tiny_config(tmp_path)
    assert cli.main(["train", str(cfg_path), "train.steps=abc"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "'train.steps'" in err and "train.steps=abc" in err
    assert not (tmp_path / "run").exists()  # nothing was started


@pytest.mark.parametrize("args, needle", [
    (["train", "{missing}"], "does not exist"),
    (["train", "{cfg}", "model.d_modle=64"], "'model.d_modle'"),
    (["train", "{cfg}", "train.steps"], "key=value"),
    (["config", "{cfg}", "optimizer.lr=-1"], "'optimizer.lr'"),
])
def test_cli_config_errors_exit_2(capsys, tmp_path, write_tiny_config, args, needle):
    cfg_path = write_tiny_config(tmp_path)
    argv = [a.format(cfg=cfg_path, missing=tmp_path / "missing.yaml") for a in args]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.err.startswith("config error: ")
    assert captured.out == ""


def test_cli_print_config(capsys, tmp_path, write_tiny_config):
    cfg_path = write_tiny_config(tmp_path)
    overrides = ["optimizer.lr=3e-4", "model.remat=true"]
    assert cli.main(["train", str(cfg_path), *overrides, "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == to_dict(load_config(cfg_path, overrides))
    assert printed["optimizer"]["lr"] == 3e-4 and printed["model"]["remat"] is True and printed["name"] == "tiny"
    assert not (tmp_path / "run").exists()  # printing trains nothing


def test_cli_print_config_before_overrides(capsys, tmp_path, write_tiny_config):
    cfg_path = write_tiny_config(tmp_path)
    try:
        rc = cli.main(["train", str(cfg_path), "--print-config", "train.steps=7"])
    except SystemExit as e:
        rc = e.code
    assert rc == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == 7

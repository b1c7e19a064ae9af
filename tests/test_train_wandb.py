"""Weights & Biases logging (angel_jax.train.metrics.WandbSink): an offline run holds what metrics.jsonl holds, a
resumed run continues the same W&B run, and runs that do not ask for W&B neither need nor import it.

The offline run is read back from its transaction log (`run-<id>.wandb`), the file `wandb sync` uploads: W&B's
LevelDB-style record log of `wandb_internal_pb2.Record` protobufs (W&B ships no Python reader for it any more).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from angel_jax.config import ConfigError, load_config
from angel_jax.train import metrics as M
from test_train_loop import PROC_LIMIT, ROOT, _env

BLOCK, HEADER = 32768, 7  # the log's block size; a record chunk's header: crc32 (4), length (2), type (1)
FULL, FIRST, LAST = 1, 2, 4


def read_wandb_log(path: Path) -> list:
    """Every Record of a .wandb transaction log, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zero padding up to the end of a block
            pos += BLOCK - pos % BLOCK
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def history(records: list) -> list[dict]:
    """The logged rows of a run: {metric: value} with W&B's own keys (_step, _runtime, ...) left out."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def run_record(records: list):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No network and nothing written outside tmp_path: W&B's own settings and caches go there too."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


@pytest.mark.slow
def test_an_offline_run_logs_what_metrics_jsonl_holds_and_a_resume_continues_it(tmp_path, wandb_env,
                                                                                write_tiny_config):
    cfg_path = write_tiny_config(tmp_path, "wb", logging={"wandb": True, "wandb_mode": "offline"},
                                 checkpoint={"every": 2, "keep": 2, "memory_dir": str(tmp_path / "wb.memtier")})
    run_dir = tmp_path / "wb"
    # Both runs in one child process (one interpreter start and jax import, the second run's programs already
    # compiled), killed if it outlives PROC_LIMIT: W&B starts a service process, and nothing here may hang.
    code = ("import sys\nfrom angel_jax import cli\n"
            "for steps in (4, 6):\n"
            "    if cli.main(['train', sys.argv[1], f'train.steps={steps}']):\n"
            "        sys.exit(1)\n")
    # Output to a file, not a pipe: a service process that outlived its parent could hold a pipe open.
    with open(tmp_path / "train.log", "w") as log:
        proc = subprocess.run(["timeout", "-s", "KILL", str(PROC_LIMIT), sys.executable, "-c", code, str(cfg_path)],
                              cwd=tmp_path, env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=PROC_LIMIT + 30)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{(tmp_path / 'train.log').read_text()[-6000:]}"

    run_id = (run_dir / M.WANDB_RUN_ID_FILE).read_text().strip()
    logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and all(p.name == f"run-{run_id}.wandb" for p in logs), logs  # one W&B run, two attempts
    first, resumed = (read_wandb_log(p) for p in logs)
    run = run_record(first)
    assert run_record(resumed).run_id == run.run_id == run_id
    assert run.display_name == "wb" and run.project == "angel-jax"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"]["d_model"] == 32 and config["logging"]["wandb"] is True

    # Every record of metrics.jsonl, each metric with the same value, against the trainer's step.
    logged = history(first) + history(resumed)
    jsonl = [{k: v for k, v in r.items() if k != "time"} for r in M.read_jsonl(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in jsonl] == [1, 2, 3, 4, 5, 6]
    assert logged == jsonl
    assert {"loss", "grad_norm", "lr", "perf/step_time"} <= set(logged[-1])


def test_the_run_id_is_kept_for_resumes_and_replaced_when_starting_over(tmp_path):
    first = M.wandb_run_id(tmp_path, resume=True)
    assert (tmp_path / M.WANDB_RUN_ID_FILE).read_text().strip() == first
    assert M.wandb_run_id(tmp_path, resume=True) == first
    other = M.wandb_run_id(tmp_path, resume=False)
    assert other != first and M.wandb_run_id(tmp_path, resume=True) == other


def test_wandb_without_the_package_is_an_error_naming_the_extra(tmp_path, monkeypatch, write_tiny_config):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets when it is not installed
    cfg = load_config(write_tiny_config(tmp_path, "nowb"), ["logging.wandb=true"])
    with pytest.raises(ConfigError, match=r"'logging\.wandb'.*pip install 'angel-jax\[wandb\]'"):
        M.open_sinks(cfg, tmp_path, start_step=0)
    assert M.import_wandb(load_config(write_tiny_config(tmp_path, "nowb")).logging) is None  # not asked: no error


def test_bad_wandb_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"'logging\.wandb_mode'"):
        load_config(None, ["logging.wandb_mode=sometimes"])
    with pytest.raises(ConfigError, match=r"'logging\.wandb_project'.*a/b"):
        load_config(None, ["logging.wandb_project=a/b"])


def test_runs_without_wandb_do_not_import_it():
    code = ("import sys, angel_jax.cli, angel_jax.train.loop, angel_jax.data; "
            "print(sorted(m for m in ('wandb', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_disabled_mode_takes_every_record_and_writes_nothing(tmp_path, wandb_env, write_tiny_config):
    cfg = load_config(write_tiny_config(tmp_path, "off"), ["logging.wandb=true", "logging.wandb_mode=disabled"])
    (tmp_path / "run").mkdir()
    sinks = M.open_sinks(cfg, tmp_path / "run", start_step=0)
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "WandbSink"]
    for sink in sinks:
        sink.write(1, {"loss": 1.5})
        sink.truncate_after(0)
        sink.close()
    assert not (tmp_path / "run" / "wandb").exists()

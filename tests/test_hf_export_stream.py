"""`angel-jax export --hf` streamed and sharded: a model split into shards of at most --max-shard-size, named by
model.safetensors.index.json as transformers writes it, reads back bit for bit; a paged run is read from its
checkpoint one stage at a time (each restore asks for one stage's pages), so its export runs under a process
memory limit that the whole parameters exceed; an interrupted export or a full disk leaves no file under a final
name; an export that would hold more than the machine has is refused before anything is read."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import models
from angel_jax import cli
from angel_jax.checkpoint import CheckpointManager
from angel_jax.config import ConfigError, ModelConfig, config_from_dict, dump_yaml, to_dict
from angel_jax.schedule.blueprint import params_layout
from angel_jax.cli import hf as hf_cli
from angel_jax.train.checkpointing import checkpoint_options
from angel_jax.train.protocol import path_name
from angel_jax.train.state_formats import page_name, pages_fingerprint
from angel_jax.train.weights import load_params
from models import hf
from models.hf.safetensors_io import ShardedWriter, TensorSpec, parse_size, plan_shards

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
LLAMA = ModelConfig(name="llama", d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, seq_len=16, mlp_hidden=48)
GPT = ModelConfig(name="gpt", d_model=32, n_layers=3, n_heads=4, seq_len=16, mlp_hidden=64)


def random_params(cfg: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype), models.get(cfg).abstract()[1])


def read_all(out: Path) -> dict[str, np.ndarray]:
    """Every tensor of an export, whichever files hold them."""
    tensors: dict[str, np.ndarray] = {}
    for name in hf.weight_files(out):
        if name.endswith(".safetensors"):
            shard = load_file(str(out / name))
            assert not set(shard) & set(tensors), f"a tensor twice: {set(shard) & set(tensors)}"
            tensors.update(shard)
    return tensors


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def assert_bit_identical(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


# ------------------------------------------------------------------------------------------------ units


def test_shard_sizes_are_read_as_huggingface_writes_them():
    assert parse_size("500MB") == 500 * 10**6 and parse_size("2GB") == 2 * 10**9 and parse_size("5GB") == 5 * 10**9
    assert parse_size("1GiB") == 2**30 and parse_size("10kb") == 10_000 and parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("4096") == 4096 == parse_size(4096)
    for bad in ("5XB", "", "GB", "-1MB", "0", "1e9"):
        with pytest.raises(ValueError, match="shard size"):
            parse_size(bad)


def test_shards_are_planned_as_huggingface_hub_plans_them():
    """huggingface_hub's own example: limit 10, tensors [6, 6, 2, 6, 2, 2] -> [6], [6, 2], [6, 2, 2]; a tensor
    larger than the limit gets a shard of its own."""
    specs = [TensorSpec(f"t{i}", (n,), np.dtype(np.uint8)) for i, n in enumerate([6, 6, 2, 6, 2, 2])]
    assert [[s.nbytes for s in shard] for shard in plan_shards(specs, 10)] == [[6], [6, 2], [6, 2, 2]]
    specs = [TensorSpec(f"t{i}", (n,), np.dtype(np.float32)) for i, n in enumerate([1, 5, 1, 1])]
    assert [[s.nbytes for s in shard] for shard in plan_shards(specs, 10)] == [[4], [20], [4, 4]]
    assert [len(shard) for shard in plan_shards(specs, 10**9)] == [4]


# ------------------------------------------------------------------------------------------------ sharded export


@pytest.mark.parametrize("cfg", [LLAMA, GPT], ids=["llama", "gpt"])
def test_a_sharded_export_reads_back_bit_for_bit(cfg, tmp_path):
    staged = models.get(cfg)
    params = random_params(cfg)
    stages = staged.split(params)
    hf.export(cfg, stages, tmp_path / "whole")
    assert hf.weight_files(tmp_path / "whole") == ["model.safetensors"]  # under 5GB: one file, no index, as before
    assert not (tmp_path / "whole" / "model.safetensors.index.json").exists()

    limit = 12_000  # bytes: a block's tensors span several shards, small tensors share one
    with pytest.raises(TypeError, match="need `abstract`"):  # stages read on demand: their shapes come first
        hf.export(cfg, lambda i: stages[i], tmp_path / "sharded", max_shard_size=limit)
    hf.export(cfg, lambda i: stages[i], tmp_path / "sharded", abstract=staged.stage_shapes(),
              max_shard_size=limit)
    out = tmp_path / "sharded"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors"
                                         for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors.index.json", *files])

    whole = load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert_same_tensors(read_all(out), whole)
    # The index: each tensor where it is, the bytes and the parameters of all of them.
    for file in files:
        with safe_open(str(out / file), framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            held = set(f.keys())
        assert held == {k for k, v in index["weight_map"].items() if v == file}
        size = sum(whole[k].nbytes for k in held)
        assert size <= limit or len(held) == 1, (file, size)
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in whole.values()),
                                 "total_parameters": sum(a.size for a in whole.values())}
    assert sorted(index["weight_map"]) == sorted(whole)
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "whole" / "config.json").read_text())

    # Imported again (our reader, through the index): the parameters bit for bit.
    back = models.get(dataclasses.replace(cfg, init_from=str(out))).init(0)[1]
    assert_bit_identical(back, params)
    files_read = hf.CheckpointTensors(out)
    assert set(files_read.file_of.values()) == {out / f for f in files}


def test_a_transformers_sharded_checkpoint_imports(tmp_path):
    """Shards as transformers' save_pretrained writes them (safetensors' own writer, an index with total_parameters
    and total_size, one layer's tensors across two files) import as the single file does; an index that places a
    tensor in a shard that does not hold it, or names a file outside the directory, is named."""
    src = FIXTURES / "llama"
    tensors = load_file(str(src / "model.safetensors"))
    out = tmp_path / "ckpt"
    out.mkdir()
    shutil.copy(src / "config.json", out)
    names = list(tensors)
    parts = {"model-00001-of-00003.safetensors": names[:5], "model-00002-of-00003.safetensors": names[5:9],
             "model-00003-of-00003.safetensors": names[9:]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(out / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_parameters": sum(a.size for a in tensors.values()),
                      "total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}))
    cfg = ModelConfig(**hf.model_fields(src), compute_dtype="float32")
    want = models.get(dataclasses.replace(cfg, init_from=str(src))).init(0)[1]
    assert_bit_identical(models.get(dataclasses.replace(cfg, init_from=str(out))).init(0)[1], want)

    wrong = dict(weight_map, **{names[0]: "model-00002-of-00003.safetensors"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wrong}))
    with pytest.raises(hf.CheckpointFileError, match="places tensors in shards that do not hold them"):
        hf.CheckpointTensors(out)
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {names[0]: "../elsewhere"}}))
    with pytest.raises(hf.CheckpointFileError, match="file names in the same directory"):
        hf.CheckpointTensors(out)


def test_overwrite_goes_from_one_file_to_shards_and_back(tmp_path):
    """An export over an earlier one (--overwrite) leaves exactly its own weight files: no model.safetensors that
    would win over a new index, no shards an old index named; the user's own file beside them stays."""
    stages = models.get(LLAMA).split(random_params(LLAMA))
    out = tmp_path / "out"
    hf.export(LLAMA, stages, out)
    (out / "README.md").write_text("mine\n")
    with pytest.raises(hf.CheckpointFileError, match="already holds config.json and model.safetensors"):
        hf.export(LLAMA, stages, out, max_shard_size="10KB")
    hf.export(LLAMA, stages, out, max_shard_size="10KB", overwrite=True)
    sharded = hf.weight_files(out)
    assert "model.safetensors" not in sharded and len(sharded) > 3
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "config.json", *sharded])
    with pytest.raises(hf.CheckpointFileError, match="already holds config.json and model-00001-of"):
        hf.export(LLAMA, stages, out)
    hf.export(LLAMA, stages, out, max_shard_size="30KB", overwrite=True)  # fewer shards: the others go
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "config.json", *hf.weight_files(out)])
    hf.export(LLAMA, stages, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no directory of its own left beside it
    with pytest.raises(ConfigError, match="--max-shard-size: shard size '5XB'"):
        hf.export(LLAMA, stages, tmp_path / "bad", max_shard_size="5XB")


@pytest.mark.parametrize("limit", ["5GB", "10KB"], ids=["one-file", "shards"])
def test_an_interrupted_export_leaves_no_file_under_the_final_names(limit, tmp_path):
    """Stage 2 fails to come (a read error, an interrupt) while a shard is half written: what was written goes,
    nothing has a final name, and the directory is as before."""
    stages = models.get(LLAMA).split(random_params(LLAMA))
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine\n")

    def read(i: int):
        if i == 2:
            raise KeyboardInterrupt
        return stages[i]

    with pytest.raises(KeyboardInterrupt):
        hf.export(LLAMA, read, out, abstract=models.get(LLAMA).stage_shapes(), max_shard_size=limit)
    assert [p.name for p in out.iterdir()] == ["README.md"]
    hf.export(LLAMA, stages, out, max_shard_size=limit)  # and the next export goes through
    hf.export(LLAMA, stages, tmp_path / "whole")
    assert_same_tensors(read_all(out), read_all(tmp_path / "whole"))


def test_a_full_disk_is_a_clear_error_that_leaves_no_file_under_the_final_names(tmp_path):
    """The second shard is written to a file that has no space (/dev/full): one clear error naming it; every
    shard written before it is removed, nothing has a final name."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    stages = models.get(LLAMA).split(random_params(LLAMA))
    out = tmp_path / "out"
    out.mkdir()
    specs = hf.export_specs(LLAMA, models.get(LLAMA).stage_shapes(), "float32")
    writer = ShardedWriter(out, specs, parse_size("10KB"))
    (out / (writer.names[1] + ".tmp")).symlink_to("/dev/full")
    with pytest.raises(hf.CheckpointFileError, match=rf"cannot write .*{writer.names[1]}\.tmp: No space left on "
                                                     "device"), writer:
        for i, stage in enumerate(stages):
            hf._write_stage(writer, hf.mapping_for(LLAMA).tensor_table(LLAMA, i), stage, np.float32)
    assert list(out.iterdir()) == []


def test_a_full_disk_leaves_an_earlier_export_as_it_was(tmp_path):
    """--overwrite over an earlier export, and the last file of the new one meets a full disk (/dev/full): one
    line naming the file; the earlier export, and the user's file beside it, are there byte for byte, and nothing
    of the new one is, beside it or in it."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    stages = models.get(LLAMA).split(random_params(LLAMA))
    out = tmp_path / "out"
    hf.export(LLAMA, stages, out)
    (out / "README.md").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fill_up(staging: Path) -> None:
        (staging / "notes.txt").symlink_to("/dev/full")
        (staging / "notes.txt").write_bytes(b"x" * 100_000)

    with pytest.raises(hf.ExportTargetError, match=rf"cannot write the export {out}: No space left on device; "
                                                   rf"nothing was written to {out}$"):
        hf.export(LLAMA, models.get(LLAMA).split(random_params(LLAMA, seed=1)), out, max_shard_size="10KB",
                  overwrite=True, extra=fill_up)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------------------------------------ runs


def synthetic_run(root: Path, paged: bool, d_model: int = 32, n_layers: int = 3, page_size: int = 16384,
                  seed: int = 0, data: dict | None = None) -> tuple[Path, int]:
    """A run directory with one checkpoint (step 3) as the paged engine (pages `params/<stage>/<k>`, its layout
    fingerprint) or the in-memory engine (`params/<path>` leaves) writes it, of random parameters, in the
    persistent tier alone (what a model larger than RAM has); `data`: its config's data section (a Hugging Face
    tokenizer, whose files an export carries). Returns (run_dir, the parameters' bytes)."""
    run_dir = root / ("paged" if paged else "in_memory")
    raw = {"name": "synthetic", "model": {"name": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": d_model,
                                          "n_layers": n_layers, "n_heads": 4, "compute_dtype": "float32"},
           "memory": {"mode": "paged" if paged else "in_memory", "page_size": page_size},
           "train": {"run_dir": str(run_dir)}, "checkpoint": {"memory_dir": str(root / "memtier")},
           "data": data or {}}
    cfg = config_from_dict(raw, "synthetic run")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    rng = np.random.default_rng(seed)
    if paged:
        layout = params_layout(cfg)
        arrays = {page_name("params", s.name, k): rng.standard_normal(p.length, dtype=np.float32).astype(p.dtype)
                  for s in layout.stages for k, p in enumerate(s.pages)}
        engine = {"engine": "paged", "page_size": page_size, "page_fit": cfg.memory.page_fit, "ranks": 1,
                  "layout": {s.name: {"params": pages_fingerprint(layout, s.name)} for s in layout.stages}}
    else:
        leaves = jax.tree_util.tree_leaves_with_path(models.get(cfg.model).abstract()[1])
        arrays = {"params/" + path_name(path): rng.standard_normal(a.shape, dtype=np.float32).astype(a.dtype)
                  for path, a in leaves}
        engine = {"engine": "in_memory"}
    with CheckpointManager(checkpoint_options(cfg, run_dir)) as manager:
        manager.save(3, arrays, {"config": to_dict(cfg), "engine": engine})
        manager.wait()
    shutil.rmtree(root / "memtier")
    return run_dir, sum(a.nbytes for a in arrays.values())


def whole_export(run_dir: Path, out: Path) -> dict[str, np.ndarray]:
    """The run exported from its parameters read whole (`load_params`, what export did before it streamed)."""
    weights = load_params(run_dir)
    hf.export(weights.cfg.model, models.get(weights.cfg.model).split(weights.params), out)
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "in_memory"])
def test_a_run_exports_in_shards_a_stage_at_a_time(paged, tmp_path, monkeypatch, capsys):
    """`angel-jax export --max-shard-size`: shards equal to the export of the parameters read whole; a paged run's
    checkpoint is restored a stage at a time (after a look at its index, each restore asks for, and gets, one
    stage's pages, every stage once), the in-memory engine's leaves whole."""
    run_dir, _ = synthetic_run(tmp_path, paged)
    want = whole_export(run_dir, tmp_path / "whole")
    stages = [s.name for s in models.get(load_params(run_dir).cfg.model).stages]
    asked: list[list[str]] = []
    restore = CheckpointManager.restore

    def recording(self, step=None, *, select=None):
        restored = restore(self, step, select=select)
        asked.append(sorted(restored.arrays))
        return restored

    monkeypatch.setattr(CheckpointManager, "restore", recording)
    out = tmp_path / "out"
    assert cli.main(["export", str(run_dir), "--hf", str(out), "--max-shard-size", "20KB"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert re.search(rf"wrote {out}/config.json and \d+ shards named by {out}/model.safetensors.index.json: the "
                     rf"parameters of step 3 of {run_dir}; peak host memory [\d.]+ [MG]iB \(parameters read "
                     + ("a stage at a time" if paged else "whole"), line), line
    assert_same_tensors(read_all(out), want)
    if paged:
        assert asked[0] == [] and len(asked) == 1 + len(stages)  # the index alone, then one restore per stage
        assert [{name.split("/")[1] for name in names} for names in asked[1:]] == [{s} for s in stages]
    else:
        assert asked[0] == [] and len(asked) == 2 and all(name.startswith("params/") for name in asked[1])


def test_an_export_larger_than_available_memory_is_refused_before_reading(tmp_path, monkeypatch, capsys):
    run_dir, _ = synthetic_run(tmp_path, paged=True)
    read: list[str] = []
    restore = CheckpointManager.restore

    def recording(self, step=None, *, select=None):
        restored = restore(self, step, select=select)
        read.extend(restored.arrays)
        return restored

    monkeypatch.setattr(CheckpointManager, "restore", recording)
    with pytest.raises(hf_cli.ExportMemoryError, match=r"would hold [\d.]+ KiB of host memory at once \(one stage "
                                                       r"of the model, unpacked, and one converted tensor\), more "
                                                       r"than the 1000 B it may take"):
        hf_cli.export_run(run_dir, tmp_path / "out", room=1000)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(hf_cli, "gather_room", lambda: 1000)  # the machine's own figure, as small
    assert cli.main(["export", str(run_dir), "--hf", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: exporting") and "\n" not in err and not (tmp_path / "out").exists()
    assert read == []  # refused on the index alone: no parameter was read


# ------------------------------------------------------------------------------------------------ memory limit

CHILD = r"""
import json, re, resource, sys, threading
threading.stack_size(2 << 20)  # the Python threads each reader starts reserve 2 MiB, not the default 8 MiB
sys.path.insert(0, sys.argv[1])
from pathlib import Path
run_dir, out, mode, headroom = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5])
from angel_jax.cli.hf import export_run
from angel_jax.train.weights import load_params, open_stages
import models
from models import hf

def address_space():
    return int(re.search(r"VmSize:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024

# Everything a reader starts once (imports, jax, orbax's and tensorstore's threads) before the limit is set:
# the limit then bounds what reading the parameters takes, over this process's own baseline.
with open_stages(run_dir) as weights:
    weights.read(1)
    cfg = weights.cfg
models.get(cfg.model).stage_shapes()
resource.setrlimit(resource.RLIMIT_AS, (address_space() + headroom, resource.RLIM_INFINITY))
if mode == "streamed":
    done = export_run(run_dir, out, max_shard_size="8MB")
    print(json.dumps({"files": done.files, "held": done.held, "peak": done.peak}))
else:
    weights = load_params(run_dir)
    hf.export(cfg.model, models.get(cfg.model).split(weights.params), out)
    print(json.dumps({"files": hf.weight_files(out)}))
"""


@pytest.mark.slow
def test_a_streamed_export_runs_under_a_memory_limit_the_whole_parameters_exceed(tmp_path):
    """A paged run of 22 blocks (283 MB of parameters, 12.6 MB a block) exported in a process whose address space
    may grow by 160 MiB over what it has once the readers are started: the streamed export goes through, and
    equals the export of the parameters read whole (read here, without a limit); reading the whole parameters
    under the same limit fails. The limit is set inside the child once jax, orbax and tensorstore have started
    (their threads and mappings reserve address space unrelated to the model, which differs from one machine to
    the next); glibc's malloc arenas are capped so that a thread's first allocation does not reserve 64 MiB, and
    the threads the readers start have 2 MiB stacks (measured on 2 cores: the export's address space grew 88 MiB
    with 8 MiB stacks, about 40 MiB of it the stacks of the 5 Python threads a checkpoint manager starts)."""
    run_dir, total = synthetic_run(tmp_path, paged=True, d_model=512, n_layers=22, page_size=1 << 20)
    headroom = 160 << 20
    assert total > 1.6 * headroom
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "JAX_PLATFORMS": "cpu"}

    def child(mode: str, out: Path) -> subprocess.Popen:
        return subprocess.Popen(["timeout", "-s", "KILL", "300", sys.executable, "-c", CHILD, str(ROOT),
                                 str(run_dir), str(out), mode, str(headroom)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    streamed, whole = child("streamed", tmp_path / "streamed"), child("whole", tmp_path / "whole-limited")
    (out, err), (_, whole_err) = streamed.communicate(), whole.communicate()
    assert streamed.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["files"]) > 10 and 2 * 13_631_488 <= result["held"] < headroom
    assert_same_tensors(read_all(tmp_path / "streamed"), whole_export(run_dir, tmp_path / "whole"))

    # The same limit does not let the parameters be read whole (tensorstore's C++ aborts on its failed
    # allocation, numpy raises MemoryError): the limit is what told the two apart.
    assert whole.returncode != 0, "the whole parameters were read under the limit: it does not discriminate"
    assert "MemoryError" in whole_err or "bad_alloc" in whole_err or whole.returncode < 0, whole_err[-2000:]
    assert not (tmp_path / "whole-limited" / "model.safetensors").exists()


"""A resume continues the same run or is refused: every checkpoint records what the run trains on (the tokenizer's
fingerprint, the sha256 of the data's sources: angel_jax/data/identity.py), and a resume on another tokenizer of
the same vocabulary, or on a source replaced by another of the same size, is refused in one line naming it unless
train.allow_data_change says so; a source only touched (same content) still resumes exactly. Both engines."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from angel_jax.checkpoint import CheckpointError
from angel_jax.config import Config, load_config
from angel_jax.data import identity
from angel_jax.data import shards as data_lib
from angel_jax.train.checkpointing import check_same_run
from angel_jax.train.loop import train
from conftest import TOY_TEXT, tiny_config_dict
from test_hf_tokenizer import _word_tokenizer as word_tokenizer

ENGINES = {"in_memory": {"mode": "in_memory"},
           "paged": {"mode": "paged", "page_size": 16384, "device_budget": 700_000}}


def _config(directory: Path, run: str, source: Path, **sections: dict) -> Path:
    """A tiny config on `source` (its data in directory/data), checkpointing every 2 steps."""
    raw = tiny_config_dict((source, directory / "data"), directory / run, **sections)
    raw["checkpoint"].update(every=2)
    path = directory / f"{run}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _replace(path: Path, text: str, *, later_s: int) -> None:
    """Rewrite `path` with an mtime `later_s` seconds after the original's (so its prepared data is stale
    whatever the file system's clock resolution)."""
    mtime = path.stat().st_mtime
    path.write_text(text)
    os.utime(path, (mtime + later_s, mtime + later_s))


def _resumed_at(run_dir: Path) -> int:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
            if '"resumed"' in line][-1]["step"]


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("mode", sorted(ENGINES))
def test_a_source_replaced_by_one_of_the_same_size_is_refused_unless_asked_for(tmp_path, mode, caplog):
    source = tmp_path / "corpus.txt"
    source.write_text(TOY_TEXT * 100)
    cfg = _config(tmp_path, "run", source, memory=ENGINES[mode])
    train(load_config(cfg, ["train.steps=2"]))
    other = TOY_TEXT.upper() * 100  # the same byte count: the data iterator alone cannot tell
    assert len(other.encode()) == source.stat().st_size
    _replace(source, other, later_s=10)
    with pytest.raises(CheckpointError) as refused:
        train(load_config(cfg, ["train.steps=4"]))
    message = str(refused.value)
    assert "\n" not in message and "the checkpoint of step 2 was trained on other data" in message
    assert f"{source.absolute()} sha256 " in message and "in the checkpoint" in message
    assert "train.resume=false" in message and "train.allow_data_change=true" in message
    # Asked for explicitly, the resume goes on, and says so.
    with caplog.at_level(logging.WARNING):
        assert train(load_config(cfg, ["train.steps=4", "train.allow_data_change=true"])).final_step == 4
    assert _resumed_at(tmp_path / "run") == 2 and "resuming the checkpoint of step 2 on changed data" in caplog.text


def test_a_source_only_touched_is_the_same_data_and_resumes_exactly(tmp_path):
    """A new mtime prepares the data again; its content is the same, so the resume goes on, bit for bit the run
    that never stopped."""
    source = tmp_path / "corpus.txt"
    source.write_text(TOY_TEXT * 100)
    straight = train(load_config(_config(tmp_path, "straight", source), ["train.steps=6"]))
    cfg = _config(tmp_path, "run", source)
    train(load_config(cfg, ["train.steps=4"]))
    _replace(source, TOY_TEXT * 100, later_s=10)
    resumed = train(load_config(cfg, ["train.steps=6"]))
    assert _resumed_at(tmp_path / "run") == 4 and _leaves_equal(resumed.params, straight.params)


def _word_tokenizer(directory: Path, order: list[int]) -> Path:
    """A tokenizer.json of 256 whole-word ids, word 'w<k>' having id order[k] (an end-of-sequence token at 0)."""
    return word_tokenizer(directory, 256, order)


def test_a_tokenizer_of_the_same_vocabulary_with_its_ids_permuted_is_refused_naming_it(tmp_path):
    rng = np.random.default_rng(0)
    source = tmp_path / "words.txt"
    source.write_text(" ".join(f"w{k}" for k in rng.integers(2, 256, 3000)) + "\n")
    tok = _word_tokenizer(tmp_path / "tok", list(range(256)))
    cfg = _config(tmp_path, "run", source, data={"tokenizer": "hf", "tokenizer_path": str(tok)})
    train(load_config(cfg, ["train.steps=2"]))

    _word_tokenizer(tok, [0, 1, *(2 + rng.permutation(254))])  # the same words and vocabulary size, other ids
    with pytest.raises(CheckpointError) as refused:
        train(load_config(cfg, ["train.steps=4"]))
    message = str(refused.value)
    assert f"the tokenizer (data.tokenizer_path={tok}) is another: hf sha256 " in message and "\n" not in message
    assert "training data's content" not in message  # the text is the same: only the tokenizer is named
    assert train(load_config(cfg, ["train.steps=4", "train.allow_data_change=true"])).final_step == 4
    assert _resumed_at(tmp_path / "run") == 2


def test_a_checkpoint_without_an_identity_resumes_with_a_note_and_an_unchanged_one_passes(tmp_path, caplog):
    """Checkpoints written before identities were recorded resume (saying so); the comparison itself: the same
    identity passes, any field the checkpoint lacks is not compared, a different one is refused."""
    source = tmp_path / "a.txt"
    source.write_text("abc\n")
    meta = data_lib.ensure_prepared(tmp_path / "data", str(source))
    now = identity.identity_of(tmp_path / "data", meta)
    assert now == {"tokenizer": "byte", "chat_template": None, "data": meta["content"]["sha256"],
                   "files": {str(source.absolute()): identity.file_sha256(source)}}
    cfg = Config()
    with caplog.at_level(logging.WARNING):
        check_same_run({}, cfg, now, 3)
    assert "records no tokenizer or data fingerprint" in caplog.text
    check_same_run({"identity": now}, cfg, now, 3)
    check_same_run({"identity": {"tokenizer": "byte"}}, cfg, now, 3)
    with pytest.raises(CheckpointError, match=r"the tokenizer \(data.tokenizer=byte\) is another: bpe sha256 0123"):
        check_same_run({"identity": {**now, "tokenizer": "bpe:0123456789abcdef"}}, cfg, now, 3)
    # Data prepared before meta.json recorded its content: its sources' digests stand in.
    legacy = {k: v for k, v in meta.items() if k != "content"}
    assert identity.identity_of(tmp_path / "data", legacy, lambda: [source]) == now

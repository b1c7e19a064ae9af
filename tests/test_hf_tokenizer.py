"""A run started from a Hugging Face checkpoint uses that checkpoint's tokenizer: our reading of tokenizer.json gives
the ids transformers gives (tests/fixtures/hf/tokenizer, made by experiments/hf/make_tokenizer_fixtures.py with
transformers' AutoTokenizer), data prepared with it holds those ids and lives in its own directory, a tokenizer
larger than the model is refused, `angel-jax import` records it, and a run trained with it samples and exports
through it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from angel_jax import cli
from angel_jax.data import shards as data_lib
from angel_jax.data import hf_tokenizer as tokenizers_hf
from angel_jax.config import Config, ConfigError, DataConfig, load_config
from angel_jax.data.hf_tokenizer import HfTokenizer
from angel_jax.train.loop import data_dir_for
from models import hf

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TOKENIZER = FIXTURES / "tokenizer"
RECORDED = json.loads((TOKENIZER / "texts.json").read_text(encoding="utf-8"))
TEXTS = [r["text"] for r in RECORDED["texts"]]


def _checkpoint_with_tokenizer(directory: Path, tokenizer: Path = TOKENIZER) -> Path:
    """The tiny Llama checkpoint with a tokenizer beside it, as a checkpoint from the Hub has."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURES / "llama" / name, directory / name)
    for name in tokenizers_hf.TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, directory / name)
    return directory


def _word_tokenizer(directory: Path, n_ids: int, order: list[int] | None = None) -> Path:
    """A tokenizer.json of n_ids whole-word ids ("w0" ... ), with an end-of-sequence token: vocabularies of any size.
    `order`: word 'w<k>' gets id order[k] instead of k (the same words, other ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"</s>": 0, "[UNK]": 1, **{f"w{i}": (order[i] if order else i) for i in range(2, n_ids)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return directory


# ----------------------------------------------------------------------------------------- transformers' ids


def test_the_tokenizer_gives_transformers_ids_and_decodes_back():
    tok = HfTokenizer.load(TOKENIZER)
    made = RECORDED["made_with"]
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (
        made["vocab_size"], made["bos_token_id"], made["eos_token_id"], made["pad_token_id"])
    assert len(TEXTS) >= 12 and tok.prefix == [tok.bos_id] and tok.suffix == []
    for r in RECORDED["texts"]:
        assert tok.encode_text(r["text"]) == r["ids"], r["text"]
        assert tok.encode_text(r["text"], add_special_tokens=False) == r["ids_no_special"], r["text"]
        assert tok.decode(r["ids_no_special"]) == r["text"] == r["decoded"]
        assert tok.decode(r["ids"]) == r["decoded_special"]
        assert tok.encode(r["text"]).tolist() == r["ids"]  # a prompt starts as a document does: with the BOS
    ids = tok.encode_text("Hello, world!", add_special_tokens=False)
    assert tok.decode_after(tok.encode("Hello,"))(ids[2:]) == tok.decode(ids)[len(tok.decode(ids[:2])):]


def test_special_tokens_are_read_where_transformers_reads_them(tmp_path):
    # special_tokens_map.json first, then tokenizer_config.json (a token as text or an AddedToken dict), then
    # config.json's ids (the first of a list), which is where GPT-2 names its end-of-text token.
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(TOKENIZER / "tokenizer.json", d)
    assert tokenizers_hf.special_tokens(d, "k") == {"bos": None, "eos": None, "pad": None}
    (d / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [2, 1], "pad_token_id": None}))
    assert tokenizers_hf.special_tokens(d, "k") == {"bos": 0, "eos": 2, "pad": None}
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>", "lstrip": False}}))
    assert HfTokenizer.load(d).eos_id == 1
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))
    assert HfTokenizer.load(d).eos_id == 2
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<none>"}))
    with pytest.raises(ConfigError, match=r"the eos token '<none>' is not in the tokenizer's vocabulary of 250 ids"):
        HfTokenizer.load(d)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'none'} \\(data.tokenizer_path\\): no such directory"):
        HfTokenizer.load(tmp_path / "none")
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a tokenizer the `tokenizers` library reads"):
        HfTokenizer.load(d)


# ----------------------------------------------------------------------------------------------------- data


def _corpus(tmp_path: Path) -> Path:
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return source


def _tokens(data_dir: Path) -> np.ndarray:
    meta = data_lib.load_meta(data_dir)
    return np.concatenate([np.fromfile(data_dir / s["file"], data_lib.DTYPES[meta["dtype"]]) for s in meta["shards"]])


def test_prepare_with_the_checkpoints_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = _corpus(tmp_path)
    cfg = Config(data=DataConfig(source=str(source), tokenizer="hf", tokenizer_path=str(TOKENIZER)))
    out = data_dir_for(cfg)
    assert cli.main(["data", "prepare", "--source", str(source), "--tokenizer", "hf", "--tokenizer-path",
                     str(TOKENIZER)]) == 0
    assert str(out) in capsys.readouterr().out
    # Every document is transformers' `tokenizer(text)` (its BOS first), then the end-of-sequence token.
    eos = RECORDED["made_with"]["eos_token_id"]
    np.testing.assert_array_equal(_tokens(out), [i for r in RECORDED["texts"] for i in r["ids"] + [eos]])
    meta = data_lib.load_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("hf", 250, "uint16")
    assert sorted(p.name for p in out.iterdir() if p.name != "meta.json" and not p.name.endswith(".bin")) == sorted(
        tokenizers_hf.TOKENIZER_FILES)
    copy = data_lib.load_tokenizer(out)
    assert isinstance(copy, HfTokenizer) and copy.encode_text(TEXTS[3]) == RECORDED["texts"][3]["ids"]

    # The byte tokenizer's data is another directory with another fingerprint; so is another tokenizer's.
    byte = data_dir_for(Config(data=DataConfig(source=str(source))))
    assert byte.name == "docs.jsonl-byte" and out.name == f"docs.jsonl-hf-{tokenizers_hf.fingerprint(TOKENIZER)[:12]}"
    other = tmp_path / "other"
    shutil.copytree(TOKENIZER, other)
    (other / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))  # another end of document
    assert tokenizers_hf.fingerprint(other) != tokenizers_hf.fingerprint(TOKENIZER)
    assert data_dir_for(Config(data=DataConfig(source=str(source), tokenizer="hf", tokenizer_path=str(other)))) != out
    by_bytes = data_lib.ensure_prepared(tmp_path / "fixed", str(source))
    assert by_bytes["spec"]["tokenizer_sha256"] is None
    # In one fixed data.dir, a change of tokenizer prepares again instead of reusing the shards.
    again = data_lib.ensure_prepared(tmp_path / "fixed", str(source), tokenizer="hf", tokenizer_path=other)
    assert again["spec"]["tokenizer_sha256"] == tokenizers_hf.fingerprint(other) != meta["spec"]["tokenizer_sha256"]
    assert _tokens(tmp_path / "fixed")[len(RECORDED["texts"][0]["ids"])] == 2  # '<pad>' ends each document now
    assert data_lib.ensure_prepared(tmp_path / "fixed", str(source), tokenizer="hf", tokenizer_path=other) == again

    assert cli.main(["data", "prepare", "--source", str(source), "--tokenizer", "hf"]) == 2
    assert "--tokenizer hf needs it" in capsys.readouterr().err


def test_a_vocabulary_past_65536_ids_is_stored_in_uint32_shards(tmp_path):
    tok_dir = _word_tokenizer(tmp_path / "big", 70_000)
    source = tmp_path / "words.txt"
    source.write_text(" ".join(f"w{i}" for i in range(65_530, 65_600)) + " w3\n")
    meta = data_lib.prepare([source], tmp_path / "data", tokenizer="hf", tokenizer_path=tok_dir)
    assert (meta["vocab_size"], meta["dtype"]) == (70_000, "uint32")
    want = list(range(65_530, 65_600)) + [3, 0]  # the words, then '</s>'
    np.testing.assert_array_equal(_tokens(tmp_path / "data"), want)
    batch = next(data_lib.TokenIterator(tmp_path / "data", batch_size=1, seq_len=len(want) - 1, seed=0))
    np.testing.assert_array_equal(batch[0], want)


# ------------------------------------------------------------------------------------------- vocabulary size


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    big = _word_tokenizer(tmp_path / "big", 300)
    ckpt = _checkpoint_with_tokenizer(tmp_path / "ckpt", big)
    assert cli.main(["import", str(ckpt), "--config", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "'model.vocab_size'=256 is smaller than the vocabulary of the Hugging Face tokenizer" in err
    assert "300 ids" in err and "model.init_from" not in err and "data.tokenizer_path" in err
    assert not (tmp_path / "x.yaml").exists()

    from angel_jax.train.loop import _data

    cfg = load_config(None, [f"data.source={_corpus(tmp_path)}", "data.tokenizer=hf", f"data.tokenizer_path={big}",
                             f"data.dir={tmp_path / 'data'}"])
    with pytest.raises(ConfigError, match=r"'model.vocab_size'=256 .* 300 ids"):
        _data(cfg)
    assert not (tmp_path / "data").exists()  # refused before any text was tokenized
    with pytest.raises(ConfigError, match="data.tokenizer_path"):
        load_config(None, ["data.tokenizer=hf"])  # no directory to take it from


# ------------------------------------------------------------------------------------------ import and a run


def test_import_records_the_checkpoints_tokenizer(tmp_path, capsys):
    ckpt = _checkpoint_with_tokenizer(tmp_path / "ckpt")
    assert cli.main(["import", str(ckpt), "--config", str(tmp_path / "run.yaml")]) == 0
    assert f"data tokenizer hf ({ckpt.resolve()})" in capsys.readouterr().out
    cfg = load_config(tmp_path / "run.yaml")
    assert (cfg.data.tokenizer, cfg.data.tokenizer_path) == ("hf", str(ckpt.resolve()))
    # A checkpoint without tokenizer.json keeps the base's tokenizer, and says so.
    assert cli.main(["import", str(FIXTURES / "llama"), "--config", str(tmp_path / "bare.yaml")]) == 0
    assert "note: the data is tokenized with the byte tokenizer, not the checkpoint's" in capsys.readouterr().out
    assert load_config(tmp_path / "bare.yaml").data.tokenizer == "byte"


def test_export_keeps_the_checkpoints_ids_where_they_agree_with_the_tokenizer():
    from angel_jax.cli.hf import special_ids

    checkpoint = {"bos_token_id": 0, "eos_token_id": [1, 7], "pad_token_id": None}
    assert special_ids(checkpoint, {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}) == {
        "bos_token_id": 0, "eos_token_id": [1, 7], "pad_token_id": 2}
    assert special_ids({"eos_token_id": 0}, {"eos_token_id": 1}) == {"eos_token_id": 1}


@pytest.mark.slow
def test_a_run_from_the_checkpoint_trains_samples_and_exports_with_its_tokenizer(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the prepared data goes to data/<source>-hf-<hash> under the working directory
    ckpt = _checkpoint_with_tokenizer(tmp_path / "ckpt")
    source = _corpus(tmp_path)
    run = tmp_path / "run"
    assert cli.main(["import", str(ckpt), "--config", str(tmp_path / "run.yaml"), f"data.source={source}",
                     "train.steps=1", "train.batch_size=2", "train.progress=false", f"train.run_dir={run}",
                     "checkpoint.every=1", f"checkpoint.memory_dir={tmp_path / 'memtier'}",
                     "model.compute_dtype=float32"]) == 0
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 0
    cfg = load_config(tmp_path / "run.yaml")
    assert data_dir_for(cfg).is_dir() and data_lib.load_meta(data_dir_for(cfg))["tokenizer"] == "hf"

    # Sampling encodes the prompt as transformers does (with the BOS) and decodes the continuation through it.
    from angel_jax.train.sample import Sampler
    from angel_jax.train.weights import load_params
    from angel_jax.config.sampling import SamplingOptions
    import models

    capsys.readouterr()
    assert cli.main(["sample", str(run), "--prompt", TEXTS[0], "--temperature", "0", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    weights = load_params(run)
    tok = HfTokenizer.load(TOKENIZER)
    sampler = Sampler(models.get(cfg.model), weights.params, context=cfg.model.seq_len, family=cfg.model.name,
                      options=SamplingOptions(max_tokens=8, temperature=0.0), vocab_limit=tok.vocab_size)
    generated = sampler.generate(np.asarray(RECORDED["texts"][0]["ids"], np.int32), end_of_text=tok.eos_id)
    tokens = [int(t) for t in generated.tokens[0] if t != tok.eos_id]
    assert out == TEXTS[0] + tok.decode(tokens) + "\n"

    # The export holds the tokenizer's files, and config.json its special ids (the checkpoint's where they agree).
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "out")]) == 0
    assert "and the run's tokenizer: tokenizer.json, tokenizer_config.json, special_tokens_map.json" in (
        capsys.readouterr().out)
    for name in tokenizers_hf.TOKENIZER_FILES:
        assert (tmp_path / "out" / name).read_bytes() == (TOKENIZER / name).read_bytes()
    assert {k: v for k, v in hf.special_tokens(tmp_path / "out").items()} == {
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    assert HfTokenizer.load(tmp_path / "out").encode_text(TEXTS[2]) == RECORDED["texts"][2]["ids"]
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "tokenizer.json").write_text("{}")
    assert cli.main(["export", str(run), "--hf", str(tmp_path / "again")]) == 1
    assert "already holds tokenizer.json" in capsys.readouterr().err
    assert not (tmp_path / "again" / "config.json").exists()

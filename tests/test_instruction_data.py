"""Instruction data (data.format: instruction): records into rows of marked tokens, the loss on the responses only in
every engine and in eval/loss, exact across micro-batches, packed documents kept apart, bad records named by file
and line, `angel-jax data prepare --format instruction` making the directory training reuses, and the fine-tuning
example in both engines. Chat records: tests/test_chat_data.py."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO_ROOT
from flax import nnx

from angel_jax import cli
from angel_jax.data import shards as data_lib
from angel_jax.data import instructions as idata
from angel_jax.data import marks as token_marks
from angel_jax.config import (Config, ConfigError, DataConfig, MemoryConfig, ModelConfig, OptimizerConfig,
                              TrainConfig, load_config)
from angel_jax.data.sources import DataError
from angel_jax.data.hf_tokenizer import HfTokenizer
from angel_jax.train.engines import InMemoryEngine
from angel_jax.train.evaluation import ValidationSet, evaluate, weighted_mean
from angel_jax.train import loop
from angel_jax.train.loop import data_dir_for, train
from angel_jax.train.paged import PagedTrainEngine
from angel_jax.train.step import make_loss_fn, make_value_and_grad
import models

GPT = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32, compute_dtype="float32")
LLAMA = ModelConfig(name="llama", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, seq_len=32,
                    compute_dtype="float32")
ROW = GPT.seq_len + 1
PAGE = 16384
TOKENIZER = REPO_ROOT / "tests" / "fixtures" / "hf" / "tokenizer"
WORDS = "the quick brown fox jumps over a lazy dog and then some more words follow here".split()


def _pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """Prompts and responses of random lengths (so rows hold very different numbers of scored tokens)."""
    rng = np.random.default_rng(seed)

    def words(most: int) -> str:
        return " ".join(rng.choice(WORDS, rng.integers(1, most)))

    return [(words(6) + ":", " " + words(4)) for _ in range(n)]


def _rows(n: int, pack: bool, seed: int = 0) -> np.ndarray:
    """n rows of ROW marked tokens, byte-tokenized, as preparation makes them."""
    docs = idata.documents(_pairs(4 * n, seed), idata.encoder_of(data_lib.ByteTokenizer()))
    make = idata.packed_rows if pack else idata.padded_rows
    rows = list(make(docs, ROW, 0, idata.Counts()))
    assert len(rows) >= n
    return np.stack(rows[:n])


def _masked_cross_entropy(logits: np.ndarray, rows: np.ndarray) -> tuple[float, int]:
    """By hand in float64: the summed cross-entropy of the scored targets, and their number."""
    targets = rows[:, 1:]
    scored = targets >= 0
    ids = np.where(scored, targets, ~targets) & token_marks.MAX_ID
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
    return float(nll[scored].sum()), int(scored.sum())


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))


# --------------------------------------------------------------------------------------------- the loss


@pytest.mark.compares_programs
def test_the_loss_is_the_masked_cross_entropy_of_the_responses():
    staged = models.get(GPT)
    graphdef, params = staged.init(0)
    rows = _rows(4, pack=False)
    logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(rows[:, :-1])))
    total, count = _masked_cross_entropy(logits, rows)
    assert 0 < count < rows[:, 1:].size / 3, "mostly prompts and padding: a mask that does nothing would show"
    got = float(jax.jit(make_loss_fn(graphdef, staged.loss))(params, jnp.asarray(rows)))
    np.testing.assert_allclose(got, total / count, rtol=1e-6)
    # The inputs are read through their marks: the same logits as the plain ids give.
    plain = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(token_marks.token_ids(rows[:, :-1]))))
    np.testing.assert_array_equal(logits, plain)
    # Text data (no marks): the plain mean over every target.
    ids = token_marks.token_ids(rows)
    unmasked, n = _masked_cross_entropy(logits, ids)
    assert n == ids[:, 1:].size
    np.testing.assert_allclose(float(staged.loss(jnp.asarray(logits), jnp.asarray(ids[:, 1:]))), unmasked / n,
                               rtol=1e-6)
    assert abs(unmasked / n - total / count) > 0.01


@pytest.mark.compares_programs
def test_micro_batches_and_ranks_give_the_whole_batchs_loss_and_gradients():
    """Micro-batches holding very different numbers of scored targets (all, one, none, a few): each divides by its
    share of the batch's count, so their mean is the whole batch's, loss and gradients, also per rank."""
    staged = models.get(GPT)
    graphdef, params = staged.init(0)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, (8, ROW))
    scored = np.zeros((8, ROW), bool)
    scored[0] = scored[4] = True  # micro-batch 0 of 4 (split_batch: rows m, m + 4)
    scored[1, 5] = True  # micro-batch 1: one target
    scored[3, 20:25] = scored[7, 2:4] = True  # micro-batch 3: a few; micro-batch 2: none
    batch = jnp.asarray(token_marks.mark(ids, scored, np.arange(ROW) == 0))
    whole_loss, whole_grads, _ = jax.jit(make_value_and_grad(graphdef, staged.loss))(params, batch)
    for micro, ranks in ((4, 1), (2, 2)):
        loss, grads, _ = jax.jit(make_value_and_grad(graphdef, staged.loss, micro, ranks))(params, batch)
        np.testing.assert_allclose(float(loss), float(whole_loss), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8)
    # What a mean of each micro-batch's own mean would have given instead: far off.
    own = [float(staged.loss(nnx.merge(graphdef, params)(batch[m::4, :-1]), batch[m::4, 1:])) for m in range(4)]
    assert abs(np.mean(own) - float(whole_loss)) > 0.1


def _cfg(tmp_path: Path, model: ModelConfig, pack: bool, **memory) -> Config:
    return Config(name="instruct", model=model, data=DataConfig(format="instruction", pack=pack),
                  optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2, schedule="constant"),
                  train=TrainConfig(steps=10, batch_size=4, run_dir=str(tmp_path / "run")),
                  memory=MemoryConfig(**memory))


@pytest.mark.compares_programs
@pytest.mark.parametrize("model, pack", [(GPT, False), (LLAMA, True)], ids=["gpt-padded", "llama-packed"])
def test_the_paged_engine_in_micro_batches_gives_the_in_memory_engines_masked_loss(tmp_path, model, pack):
    """Training steps and evaluations of the same marked batches: the in-memory engine on whole batches, the paged
    one in two micro-batches holding different numbers of scored targets, agree."""
    reference = InMemoryEngine(_cfg(tmp_path, model, pack), _mesh())
    cfg = _cfg(tmp_path, model, pack, mode="paged", page_size=PAGE)
    paged = PagedTrainEngine(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=2)),
                             _mesh())
    try:
        assert paged.built.plan.micro_batches == 2
        batches = [jnp.asarray(b) for b in _rows(12, pack, seed=2).reshape(3, 4, ROW)]
        first = [float(e.eval_loss(batches[0])) for e in (reference, paged)]
        for b in batches:
            counts = [int(np.sum(np.asarray(b)[m::2, 1:] >= 0)) for m in range(2)]
            assert counts[0] != counts[1]
            evals = [float(e.eval_loss(b)) for e in (reference, paged)]
            losses = [float(e.step(b)["loss"]) for e in (reference, paged)]
            np.testing.assert_allclose(evals, evals[0], rtol=1e-5)
            np.testing.assert_allclose(losses, evals[0], rtol=1e-5)  # a step's loss: before its update
        last = [float(e.eval_loss(batches[0])) for e in (reference, paged)]
        np.testing.assert_allclose(last, last[0], rtol=1e-5)
        assert last[0] < first[0] - 0.1, "the steps must have changed the parameters"
    finally:
        for engine in (reference, paged):
            engine.close()


@pytest.mark.slow
@pytest.mark.compares_programs
def test_the_sharded_engines_give_the_one_device_masked_loss():
    """Four CPU devices (instruction_sharded_check.py): the in-memory engine data parallel over them and the paged
    engine's sharded pages (ZeRO-3), each with two micro-batches of one row per rank, train packed rows as the
    in-memory engine does on one device with whole batches."""
    from conftest import comparing_env

    script = Path(__file__).with_name("instruction_sharded_check.py")
    run = subprocess.run(["timeout", "-s", "KILL", "300", sys.executable, str(script)], capture_output=True,
                         text=True, cwd=REPO_ROOT, env=comparing_env())
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["uneven"]
    for engine in ("in_memory", "paged"):
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(out[engine][key], out["reference"][key], rtol=1e-5, err_msg=engine)


@pytest.mark.compares_programs
def test_eval_loss_is_the_mean_over_every_scored_validation_token(tmp_path):
    engine = InMemoryEngine(_cfg(tmp_path, GPT, False), _mesh())
    try:
        batches = (_rows(4, False, seed=3), _rows(4, False, seed=4))
        counts = [int(np.sum(b[:, 1:] >= 0)) for b in batches]
        assert counts[0] != counts[1]
        graphdef, _ = models.get(GPT).abstract()
        params = engine.state.params
        sums = [_masked_cross_entropy(np.asarray(nnx.merge(graphdef, params)(jnp.asarray(b[:, :-1]))), b)[0]
                for b in batches]
        got = evaluate(engine, ValidationSet(batches), tokenizer="hf")
        np.testing.assert_allclose(got["eval/loss"], sum(sums) / sum(counts), rtol=1e-6)
        for b, s, c in zip(batches, sums, counts):
            np.testing.assert_allclose(float(engine.eval_loss(jnp.asarray(b))), s / c, rtol=1e-6)
    finally:
        engine.close()
    assert weighted_mean([1.0, 4.0], [3, 1]) == 1.75
    assert weighted_mean([1.0, 4.0], [2, 2]) == 2.5


# --------------------------------------------------------------------------------------------- packed rows


@pytest.mark.compares_programs
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_documents_do_not_see_each_other(family):
    """A document's logits in a packed row do not change when the document before it does, and are those of the
    same document alone at the start of a row (positions restart), in the whole model and stage by stage."""
    cfg = GPT if family == "gpt" else LLAMA
    packed, plain = models.get(cfg, documents=True), models.get(cfg)
    graphdef, params = packed.init(0)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 256, (2, ROW))
    starts = np.isin(np.arange(ROW), [0, 11])
    row = token_marks.mark(ids, ~starts, starts)
    changed = ids.copy()
    changed[:, 1:11] = rng.integers(0, 256, (2, 10))

    def whole(model, graph, tokens):
        return np.asarray(nnx.merge(graph, params)(jnp.asarray(tokens[:, :-1])))

    logits = whole(packed, graphdef, row)
    np.testing.assert_allclose(np.asarray(packed.forward(packed.split(params), jnp.asarray(row[:, :-1]))), logits,
                               rtol=1e-5, atol=1e-6)
    after = whole(packed, graphdef, token_marks.mark(changed, ~starts, starts))
    np.testing.assert_array_equal(after[:, 11:], logits[:, 11:])
    assert np.abs(after[:, :11] - logits[:, :11]).max() > 1e-3
    alone = whole(plain, plain.abstract()[0], np.pad(row[:, 11:], ((0, 0), (0, 11))))
    np.testing.assert_allclose(alone[:, :ROW - 12], logits[:, 11:], rtol=1e-5, atol=1e-5)
    # Without documents the second document attends to the first: what the mask prevents.
    crossing = whole(plain, plain.abstract()[0], row)
    assert np.abs(crossing[:, 11:] - logits[:, 11:]).max() > 1e-3


# --------------------------------------------------------------------------------------------- preparation


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_records_become_rows_with_the_prompt_unscored(tmp_path):
    """The Hugging Face fixture tokenizer (BOS 0, EOS 1, pad 2): [BOS, prompt, response, EOS, padding], the
    response and the EOS scored, the prompt, the first token and the padding not; packed rows hold several."""
    source = _write(tmp_path / "sft.jsonl", [{"prompt": "Q: add 3 and 4\nR:", "response": " 7"},
                                              {"prompt": "Q: up\nR:", "response": " down"},
                                              {"prompt": "x " * 40, "response": " never seen"},
                                              {"prompt": "Q: double 8\nR:", "response": " 16" * 20}])
    tok = HfTokenizer.load(TOKENIZER)
    for pack in (False, True):
        out = tmp_path / f"data-{pack}"
        meta = idata.prepare([source], out, idata.Rows(ROW, pack), tokenizer="hf", tokenizer_path=TOKENIZER)
        info = meta["instruction"]
        assert (info["records"], info["dropped"], info["truncated"]) == (4, 1, 2)
        assert meta["dtype"] == "int32" and meta["spec"]["pack"] == pack
        rows = np.fromfile(out / meta["shards"][0]["file"], "<i4").reshape(-1, ROW)
        assert len(rows) == info["rows"] == (2 if pack else 3)
        first = rows[0]
        starts = np.flatnonzero(token_marks.doc_starts(first))
        doc, rest = first[:starts[1]], first[starts[1]:]  # the first document, then what follows it in the row
        ids, scored = token_marks.token_ids(doc), token_marks.scored(doc)
        assert ids[0] == tok.bos_id and not scored[0]
        assert tok.decode(ids[~scored]) == "<s>Q: add 3 and 4\nR:" and tok.decode(ids[scored]) == " 7</s>"
        np.testing.assert_array_equal(scored, np.arange(doc.size) >= np.argmax(scored))  # a scored suffix
        if pack:
            assert tok.decode(token_marks.token_ids(rest)).startswith("<s>Q: up\nR: down</s>")
        else:
            assert set(token_marks.token_ids(rest).tolist()) == {tok.pad_id} and not token_marks.scored(rest).any()
        assert info["scored_tokens"] == int(sum(token_marks.scored(r[1:]).sum() for r in rows))
        # The iterator reads rows as its windows; another seq_len is refused, naming it.
        batch = next(data_lib.TokenIterator(out, batch_size=2, seq_len=ROW - 1, seed=0))
        assert {tuple(r) for r in batch} <= {tuple(r) for r in rows}
        with pytest.raises(DataError, match=r"instruction rows of 33 tokens .* model.seq_len\+1=17"):
            data_lib.TokenIterator(out, batch_size=1, seq_len=16, seed=0)


@pytest.mark.parametrize("line, problem", [
    ('{"prompt": "a"}', r"no key 'response' \(data.response_key\); this record's keys: 'prompt'"),
    ('{"prompt": 3, "response": "b"}', r"'prompt' \(data.prompt_key\) is a number, not a string"),
    ('{"prompt": "a", "response": null}', r"'response' \(data.response_key\) is null, not a string"),
    ('["a", "b"]', r"expected a JSON object with 'prompt' and 'response' keys \(or 'messages'\), got an array"),
    ('{"prompt": "a", "response": ', r"not a valid JSON line"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}',
     r"a chat record \('messages'\) is rendered by the chat template of a Hugging Face tokenizer; the 'byte' "
     r"tokenizer has none: set data.tokenizer: hf"),
])
def test_a_bad_record_names_its_file_and_line(tmp_path, line, problem):
    source = _write(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "b"}, "", line])
    with pytest.raises(DataError, match=rf"{source}:3: {problem}"):
        idata.prepare([source], tmp_path / "out", idata.Rows(ROW))
    assert not (tmp_path / "out").exists()


def _prepared_rows(out: Path, meta: dict) -> np.ndarray:
    return np.concatenate([np.fromfile(out / s["file"], "<i4") for s in meta["shards"]]).reshape(-1, ROW)


@pytest.mark.parametrize("tokenizer, pack", [("hf", False), ("hf", True), ("byte", False), ("bpe", True)])
def test_a_long_record_is_cut_before_tokenization_to_the_rows_it_gives_whole(tmp_path, monkeypatch, tokenizer,
                                                                              pack):
    """Records longer than a row can use (a prompt of 3000 words, a response of 3000, both) are cut to text_bound
    before the tokenizer sees them, counted as cut, and give the rows they gave whole (an unbounded cut, as before);
    the short ones are untouched."""
    long = " ".join(WORDS * 200)
    records = [{"prompt": p, "response": r} for p, r in _pairs(6)]
    records[1:1] = [{"prompt": long + ":", "response": " yes"}, {"prompt": "Q:", "response": " " + long},
                    {"prompt": long[:9000] + ":", "response": long}, {"prompt": "Q\n" * 30, "response": " é" * 9000}]
    source = _write(tmp_path / "sft.jsonl", records)
    kwargs = {"tokenizer": tokenizer, "tokenizer_path": TOKENIZER if tokenizer == "hf" else None, "vocab_size": 300}
    seen: list[int] = []
    real = idata.documents

    def documents(items, enc):  # the texts the tokenizer is given: no longer than the bound
        items = list(items)
        seen.extend(len(t) for r in items for t in r)
        return real(items, enc)

    monkeypatch.setattr(idata, "documents", documents)
    meta = idata.prepare([source], tmp_path / "cut", idata.Rows(ROW, pack), **kwargs)
    bound = idata.text_bound(ROW, idata.token_chars(data_lib.load_tokenizer(tmp_path / "cut")))
    assert meta["instruction"]["cut"] == 4 and max(seen) <= bound < len(long)
    monkeypatch.setattr(idata, "text_bound", lambda row_tokens, chars: 10**9)  # nothing cut: the rows of old
    whole = idata.prepare([source], tmp_path / "whole", idata.Rows(ROW, pack), **kwargs)
    assert whole["instruction"]["cut"] == 0 and max(seen) > bound
    np.testing.assert_array_equal(_prepared_rows(tmp_path / "cut", meta), _prepared_rows(tmp_path / "whole", whole))
    same = ("records", "truncated", "dropped", "rows", "scored_tokens")
    assert {k: meta["instruction"][k] for k in same} == {k: whole["instruction"][k] for k in same}


def test_the_bound_keeps_a_rows_worth_of_tokens_for_every_tokenizer():
    """The byte tokenizer's bound is exact (a row's bytes and one more); a BPE or Hugging Face token is bounded by
    twice its vocabulary's longest entry, at least TOKEN_CHARS_FLOOR."""
    assert idata.text_bound(ROW, idata.token_chars(data_lib.ByteTokenizer())) == ROW + 1
    hf = HfTokenizer.load(TOKENIZER)
    assert idata.token_chars(hf) == 2 * idata.TOKEN_CHARS_FLOOR >= 2 * max(map(len, hf.vocabulary()))
    chat = idata.Chat(({"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b" * 10},
                       {"role": "user", "content": "c"}), "x:1")
    cut = idata._cut(chat, 15)
    assert [m["content"] for m in cut.messages] == ["a" * 10, "b" * 5] and cut.where == "x:1"
    assert idata._cut(chat, 21) is chat and idata._cut(("ab", "cd"), 3) == ("ab", "c")


def test_empty_responses_are_counted_and_warned_about_once(tmp_path, caplog, capsys):
    """Records with an empty response (a chat: an empty assistant turn) are kept, only their end scored, as
    transformers' trainers keep them; meta.json and `data prepare` count them and one warning says so."""
    chat = {"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]}
    source = _write(tmp_path / "sft.jsonl", [{"prompt": "Q: up\nR:", "response": " down"},
                                              {"prompt": "Q: hush\nR:", "response": ""}, chat,
                                              {"prompt": "Q: quiet\nR:", "response": ""}])
    with caplog.at_level("WARNING", logger=idata.log.name):
        meta = idata.prepare([source], tmp_path / "out", idata.Rows(ROW), tokenizer="hf", tokenizer_path=TOKENIZER)
    assert (meta["instruction"]["empty"], meta["instruction"]["rows"]) == (3, 4)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "3 of 4 records have an empty response" in warnings[0]
    rows = np.fromfile(tmp_path / "out" / meta["shards"][0]["file"], "<i4").reshape(-1, ROW)
    assert int(token_marks.scored(rows[1]).sum()) == 1  # the end of the document alone
    assert cli.main(["data", "prepare", "--format", "instruction", "--seq-len", str(GPT.seq_len), "--source",
                     str(source), "--tokenizer", "hf", "--tokenizer-path", str(TOKENIZER), "--out",
                     str(tmp_path / "cli")]) == 0
    assert "3 with an empty response" in capsys.readouterr().out


def test_instruction_data_reads_json_lines_only_and_gets_a_directory_of_its_own(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    with pytest.raises(DataError, match=r"notes.txt: data.format 'instruction' reads JSON Lines records"):
        idata.prepare([text], tmp_path / "out", idata.Rows(ROW))
    cfg = Config(model=GPT, data=DataConfig(source="sft.jsonl", format="instruction", pack=True, val_fraction=0.1))
    assert data_dir_for(cfg) == Path("data/sft.jsonl-byte-pack33-val0.1")


def test_data_prepare_makes_the_directory_training_reuses(tmp_path, monkeypatch, capsys):
    """`angel-jax data prepare --format instruction` with a run's settings writes the directory that run's training
    finds and reuses (nothing prepared again); another packing, in the same directory, is prepared again."""
    monkeypatch.chdir(tmp_path)
    source = _write(tmp_path / "sft.jsonl", [{"question": "Q: up\nR:", "answer": " down"},
                                              {"messages": [{"role": "user", "content": "Hello, world!"},
                                                            {"role": "assistant", "content": "x"}]}] * 16)
    flags = ["--source", str(source), "--tokenizer", "hf", "--tokenizer-path", str(TOKENIZER), "--prompt-key",
             "question", "--response-key", "answer", "--val-fraction", "0.25"]
    assert cli.main(["data", "prepare", "--format", "instruction", "--seq-len", str(GPT.seq_len), *flags]) == 0
    cfg = Config(model=GPT, data=DataConfig(source=str(source), format="instruction", tokenizer="hf",
                                            tokenizer_path=str(TOKENIZER), prompt_key="question",
                                            response_key="answer", val_fraction=0.25))
    out = data_dir_for(cfg)
    assert (f"{out}: 32 records -> 32 rows of {ROW} tokens (padded; 0 cut to what a row can use before "
            f"tokenization, 0 truncated, 0 dropped, 0 with an empty response)") in capsys.readouterr().out
    made = data_lib.load_meta(out)
    builds = []
    real = idata.prepare
    monkeypatch.setattr(idata, "prepare", lambda *a, **k: builds.append(a) or real(*a, **k))
    data, _ = loop._data(cfg)  # what training does before its first step
    assert builds == [] and data_lib.load_meta(out) == made
    assert {tuple(r) for r in next(data)} <= {tuple(r) for r in np.fromfile(out / made["shards"][0]["file"], "<i4")
                                              .reshape(-1, ROW)}

    # Packed rows are other data: in the directory training names for them, or in the same data.dir, prepared anew.
    packed = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=True))
    assert data_dir_for(packed) != out
    loop._data(dataclasses.replace(packed, data=dataclasses.replace(packed.data, dir=str(out))))
    assert len(builds) == 1 and data_lib.load_meta(out)["spec"]["pack"] is True


@pytest.mark.parametrize("flags, problem", [
    (["--format", "instruction"], r"--seq-len N goes with --format instruction, and --format instruction needs it"),
    (["--seq-len", "8"], r"--seq-len N goes with --format instruction"),
    (["--pack"], r"--pack: only with --format instruction"),
    (["--format", "instruction", "--seq-len", "8", "--max-bytes", "10"], r"--max-bytes: caps the text"),
    (["--format", "instruction", "--seq-len", "8", "--prompt-key", "a", "--response-key", "a"],
     r"--response-key: must differ"),
])
def test_data_prepare_refuses_instruction_flags_that_do_not_fit(tmp_path, capsys, flags, problem):
    source = _write(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "b"}])
    assert cli.main(["data", "prepare", "--source", str(source), "--out", str(tmp_path / "out"), *flags]) == 2
    assert re.search(problem, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, key", [
    (["model.name=t5", "data.format=instruction"], "data.format"),
    (["data.format=instruction", "data.max_bytes=100"], "data.max_bytes"),
    (["data.prompt_key=text", "data.response_key=text"], "data.response_key"),
    (["data.format=chat"], "data.format"),
])
def test_what_instruction_data_cannot_do_is_refused_by_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert repr(key) in str(e.value)
    # Packed rows run on the GPT and Llama, with or without experts (tests/test_moe_documents.py); not on T5.
    assert load_config(None, ["model.moe.experts=4", "data.format=instruction", "data.pack=true"]).data.packed
    with pytest.raises(ConfigError, match="'data.pack'"):
        models.get(ModelConfig(name="t5"), documents=True)


# --------------------------------------------------------------------------------------------- the example


@pytest.mark.slow
@pytest.mark.compares_programs
def test_the_finetuning_example_runs_in_both_engines(tmp_path, monkeypatch):
    """experiments/finetune_tiny.yaml, a few steps: the same losses and evaluation in both engines, falling."""
    monkeypatch.chdir(REPO_ROOT)  # the config names its files relative to the repository
    runs = {}
    for mode in ("in_memory", "paged"):
        cfg = load_config("experiments/finetune_tiny.yaml", [
            "train.steps=6", "train.eval_every=6", f"memory.mode={mode}", f"train.run_dir={tmp_path / mode}",
            f"data.dir={tmp_path / 'data'}", f"checkpoint.memory_dir={tmp_path / mode}.memtier", "train.progress=false",
            "checkpoint.every=6"])
        runs[mode] = train(cfg).history
    losses = {mode: [r["loss"] for r in history] for mode, history in runs.items()}
    np.testing.assert_allclose(losses["paged"], losses["in_memory"], rtol=1e-5)
    assert losses["in_memory"][-1] < losses["in_memory"][0] - 0.5
    evals = [history[-1]["eval/loss"] for history in runs.values()]
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)

"""Tokenizers, prepared shards, ensure_prepared and the resumable iterator, on real files in tmp_path."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from angel_jax.data import shards as D
from angel_jax.data import sources as data_sources

TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — ☃ 𝄞\n", "import os\nprint(os.sep)\n"]


def _files(tmp_path: Path, texts: list[str] = TEXTS, sub: str = "src") -> list[Path]:
    d = tmp_path / sub
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, t in enumerate(texts):
        p = d / f"f{i}.txt"
        p.write_text(t, encoding="utf-8")
        paths.append(p)
    return paths


def _stream(data_dir: Path, key: str = "shards") -> np.ndarray:
    meta = D.load_meta(data_dir)
    return np.concatenate([np.fromfile(data_dir / s["file"], dtype="<u2") for s in meta[key]])


def _synthetic(tmp_path: Path, n: int = 5000, vocab: int = 1000, shard_tokens: int = 777, seed: int = 0) -> Path:
    tokens = np.random.default_rng(seed).integers(0, vocab, n)
    D.write_tokens(tokens, tmp_path / "syn", vocab_size=vocab, shard_tokens=shard_tokens)
    return tmp_path / "syn"


def _take(it: D.TokenIterator, n: int) -> list[np.ndarray]:
    return [next(it) for _ in range(n)]


# ------------------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
    tok = D.ByteTokenizer()
    text = "plain ascii, ünïcödé, ☃, 𝄞 and\ttabs\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and ids.dtype == np.uint16
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0xE2, 0x98]) == "\ufffd"  # a cut UTF-8 sequence decodes with a replacement
    with pytest.raises(D.DataError, match="0, 255"):
        tok.decode([300])


def test_bpe_train_save_load_round_trip(tmp_path):
    pytest.importorskip("tokenizers")
    files = _files(tmp_path, TEXTS * 20)
    tok = D.BpeTokenizer.train(files, 300)
    assert 257 < tok.vocab_size <= 300 and tok.eot_id is not None
    text = "def g(y):\n    return y + ☃\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and len(ids) < len(text.encode())  # merges were learned
    assert tok.decode(ids) == text
    tok.save(tmp_path / "tok.json")
    loaded = D.BpeTokenizer.load(tmp_path / "tok.json")
    assert loaded.encode(text).tolist() == ids.tolist() and loaded.vocab_size == tok.vocab_size
    with pytest.raises(D.DataError, match="vocab_size"):
        D.BpeTokenizer.train(files, 100)
    with pytest.raises(D.DataError, match="missing.json"):
        D.BpeTokenizer.load(tmp_path / "missing.json")


def test_prepare_bpe_separates_documents_with_eot(tmp_path):
    pytest.importorskip("tokenizers")
    files = _files(tmp_path, TEXTS * 5)
    meta = D.prepare(files, tmp_path / "out", tokenizer="bpe", vocab_size=280)
    assert meta["tokenizer"] == "bpe" and meta["tokenizer_file"] == "tokenizer.json"
    tok = D.load_tokenizer(tmp_path / "out")
    stream = _stream(tmp_path / "out")
    assert int((stream == tok.eot_id).sum()) == len(files) and stream[-1] == tok.eot_id
    assert tok.decode(stream) == "".join(t + D.EOT for t in TEXTS * 5)


# ---------------------------------------------------------------------------------------------------- prepare


def test_prepare_byte_shards_hold_the_concatenated_bytes(tmp_path):
    files = _files(tmp_path)
    raw = b"".join(p.read_bytes() for p in files)
    meta = D.prepare(files, tmp_path / "out", shard_tokens=7)
    out = tmp_path / "out"
    assert meta == D.load_meta(out)
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["total_tokens"] == len(raw) == meta["source_bytes"] and meta["sources"] == 3
    assert [s["tokens"] for s in meta["shards"]] == [7] * (len(raw) // 7) + ([len(raw) % 7] if len(raw) % 7 else [])
    for s in meta["shards"]:
        assert (out / s["file"]).stat().st_size == 2 * s["tokens"]
    assert _stream(out).tolist() == list(raw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no temporary left behind


def test_prepare_max_bytes_cuts_the_last_file(tmp_path):
    files = _files(tmp_path, ["abcdefgh", "ijklmnop", "qrstuvwx"])
    meta = D.prepare(files, tmp_path / "out", max_bytes=10)
    assert meta["source_bytes"] == 10 and meta["sources"] == 2
    assert bytes(_stream(tmp_path / "out").astype(np.uint8)) == b"abcdefghij"


def test_a_long_text_reaches_the_tokenizer_in_bounded_pieces_and_tokenizes_as_whole(tmp_path, monkeypatch):
    """A text file or record longer than ENCODE_CHARS (scaled down to 1000) is split where the pre-tokenizer splits
    anyway (after a newline, before a space) and gives the tokens it gives whole; no text handed to the tokenizer is
    longer than ENCODE_CHARS, so memory is bounded by it, not by a block or a record."""
    tokenizer = Path(__file__).parent / "fixtures" / "hf" / "tokenizer"
    words = " ".join(["tea", "Ünïcode", "🙂", " spaced", "words"] * 600)
    lines = "\n".join(["one line of text", "", "  indented"] * 300)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(words, encoding="utf-8")
    (src / "b.txt").write_text(lines, encoding="utf-8")
    (src / "c.jsonl").write_text(json.dumps({"text": words}) + "\n" + json.dumps({"text": "short"}) + "\n")
    files = sorted(src.iterdir())
    seen: list[int] = []
    real = D.HfTokenizer.encode_batch

    def encode_batch(self, texts):
        seen.extend(map(len, texts))
        return real(self, texts)

    monkeypatch.setattr(D.HfTokenizer, "encode_batch", encode_batch)
    monkeypatch.setattr(D, "ENCODE_CHARS", 1000)
    D.prepare(files, tmp_path / "pieces", tokenizer="hf", tokenizer_path=tokenizer)
    assert max(seen) <= 1000 < len(words)
    monkeypatch.setattr(D, "ENCODE_CHARS", 10**9)
    D.prepare(files, tmp_path / "whole", tokenizer="hf", tokenizer_path=tokenizer)
    assert max(seen) == len(words)
    np.testing.assert_array_equal(_stream(tmp_path / "pieces"), _stream(tmp_path / "whole"))
    assert D.split_text("ab cd\nef gh", 8) == ["ab cd\n", "ef gh"] and D.split_text("abcdef", 4) == ["abcd", "ef"]
    assert D.split_text("ab cd ef", 7) == ["ab cd", " ef"]


def test_prepare_val_fraction_takes_the_tail(tmp_path):
    files = _files(tmp_path, ["x" * 60, "y" * 40])
    meta = D.prepare(files, tmp_path / "out", shard_tokens=30, val_fraction=0.25)
    assert (meta["train_tokens"], meta["val_tokens"], meta["total_tokens"]) == (75, 25, 100)
    assert bytes(_stream(tmp_path / "out").astype(np.uint8)) == b"x" * 60 + b"y" * 15
    assert bytes(_stream(tmp_path / "out", "val_shards").astype(np.uint8)) == b"y" * 25
    assert sum(p.stat().st_size for p in (tmp_path / "out").glob("*.bin")) == 200


def test_prepare_missing_source_names_it(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(D.DataError, match="nope.txt"):
        D.prepare([missing], tmp_path / "out")
    with pytest.raises(D.DataError, match="nope.txt"):
        D.resolve_sources(str(missing))
    with pytest.raises(D.DataError, match="matches no files"):
        D.resolve_sources(str(tmp_path / "*.zzz"))
    assert not (tmp_path / "out").exists()


def test_failed_prepare_keeps_the_old_directory(tmp_path):
    files = _files(tmp_path)
    before = D.prepare(files, tmp_path / "out")
    with pytest.raises(D.DataError):  # fails inside the build: bad BPE size (or `tokenizers` missing)
        D.prepare(files, tmp_path / "out", tokenizer="bpe", vocab_size=10)
    assert D.load_meta(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_prepare_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "precious.txt").write_text("keep me")
    with pytest.raises(D.DataError, match="not a prepared data directory"):
        D.prepare(_files(tmp_path), tmp_path / "out")
    assert (tmp_path / "out" / "precious.txt").read_text() == "keep me"


def test_load_meta_errors_name_the_file(tmp_path):
    with pytest.raises(D.DataError, match="meta.json is missing"):
        D.load_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(D.DataError, match="corrupt"):
        D.load_meta(tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(D.DataError, match="format 99"):
        D.load_meta(tmp_path)


def test_damaged_shard_is_detected(tmp_path):
    d = _synthetic(tmp_path)
    first = d / D.load_meta(d)["shards"][0]["file"]
    os.truncate(first, 10)
    with pytest.raises(D.DataError, match="train_00000.bin is 10 bytes"):
        D.TokenIterator(d, batch_size=2, seq_len=8, seed=0)


def test_stdlib_corpus_files_are_sorted_python_sources():
    a, b = data_sources.stdlib_corpus_files(), data_sources.stdlib_corpus_files()
    assert a == b and len(a) > 100
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in a)
    assert any(p.name == "os.py" for p in a)
    assert D.resolve_sources("stdlib") == a


def test_resolve_sources_directory_skips_binary_and_hidden(tmp_path):
    files = _files(tmp_path)
    (tmp_path / "src" / "blob.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "src" / ".hidden").mkdir()
    (tmp_path / "src" / ".hidden" / "x.txt").write_text("hidden")
    (tmp_path / "src" / "sub").mkdir()
    (tmp_path / "src" / "sub" / "z.md").write_text("# z")
    assert D.resolve_sources(str(tmp_path / "src")) == files + [tmp_path / "src" / "sub" / "z.md"]
    assert D.resolve_sources(str(tmp_path / "src" / "*.txt")) == files
    assert D.resolve_sources(str(files[0])) == [files[0]]


# ------------------------------------------------------------------------------------------- ensure_prepared


def test_ensure_prepared_reuses_then_reprepares_on_change(tmp_path):
    _files(tmp_path, ["aaaa" * 50], sub="a")
    _files(tmp_path, ["bbbb" * 50], sub="b")
    out = tmp_path / "data" / "out"
    first = D.ensure_prepared(out, str(tmp_path / "a"))
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert D.ensure_prepared(out, str(tmp_path / "a")) == first
    assert (out / "meta.json").stat().st_mtime_ns == mtime
    assert D.ensure_prepared(out, str(tmp_path / "a"), max_bytes=0) == first  # 0 means "all", as in the config

    D.ensure_prepared(out, str(tmp_path / "b"))
    assert set(_stream(out).tolist()) == {ord("b")}
    D.ensure_prepared(out, str(tmp_path / "b"), max_bytes=100)
    assert D.load_meta(out)["total_tokens"] == 100
    (tmp_path / "b" / "f0.txt").write_text("c" * 300)  # edited corpus: prepared again
    D.ensure_prepared(out, str(tmp_path / "b"))
    assert D.load_meta(out)["total_tokens"] == 300


def test_ensure_prepared_concurrent_callers_agree(tmp_path):
    _files(tmp_path, [str(i) * 2000 for i in range(8)])
    out, results, errors = tmp_path / "data" / "out", [], []

    def run():
        try:
            results.append(D.ensure_prepared(out, str(tmp_path / "src")))
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]  # flock also excludes fds of one process
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 4 and all(r == results[0] for r in results)
    assert _stream(out).size == 16000


# ---------------------------------------------------------------------------------------------------- iterator


def test_iterator_is_deterministic_per_seed(tmp_path):
    d = _synthetic(tmp_path)
    a = _take(D.TokenIterator(d, batch_size=4, seq_len=16, seed=1), 5)
    b = _take(D.TokenIterator(d, batch_size=4, seq_len=16, seed=1), 5)
    c = _take(D.TokenIterator(d, batch_size=4, seq_len=16, seed=2), 5)
    assert a[0].shape == (4, 17) and a[0].dtype == np.int32
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_windows_are_read_from_the_stream_across_shards(tmp_path):
    tokens = np.random.default_rng(3).integers(0, 500, 3000)
    D.write_tokens(tokens, tmp_path / "small", vocab_size=500, shard_tokens=37)
    D.write_tokens(tokens, tmp_path / "one", vocab_size=500)
    a = D.TokenIterator(tmp_path / "small", batch_size=3, seq_len=40, seed=5)
    b = D.TokenIterator(tmp_path / "one", batch_size=3, seq_len=40, seed=5)
    for _ in range(10):
        x, y = next(a), next(b)
        assert np.array_equal(x, y)
    w = 41
    for row in x:  # each row is one aligned, contiguous window of the original stream
        starts = [s for s in range(0, 3000 - w + 1, w) if np.array_equal(tokens[s:s + w], row)]
        assert len(starts) == 1


def test_state_restore_gives_the_same_batches_across_epochs(tmp_path):
    d = _synthetic(tmp_path, n=1000)
    make = lambda: D.TokenIterator(d, batch_size=4, seq_len=20, seed=7)  # noqa: E731
    ref = make()
    assert ref.windows_per_epoch == 47 and ref.batches_per_epoch == 11
    expected = _take(ref, 30)  # nearly three epochs
    for k in (0, 3, 10, 11, 12, 25):
        it = make()
        _take(it, k)
        saved = json.loads(json.dumps(it.state().to_dict()))
        resumed = make()
        resumed.restore(D.IteratorState.from_dict(saved))
        assert all(np.array_equal(x, y) for x, y in zip(_take(resumed, 30 - k), expected[k:]))
    it = make()
    _take(it, 11)
    assert (it.state().epoch, it.state().position) == (1, 0)


def test_process_shards_together_make_the_global_batch(tmp_path):
    d = _synthetic(tmp_path)
    single = _take(D.TokenIterator(d, batch_size=6, seq_len=10, seed=3), 8)
    parts = [_take(D.TokenIterator(d, batch_size=6, seq_len=10, seed=3, shard_index=i, shard_count=3), 8)
             for i in range(3)]
    for b in range(8):
        assert parts[0][b].shape == (2, 11)
        assert np.array_equal(np.concatenate([p[b] for p in parts]), single[b])
    with pytest.raises(D.DataError, match="split evenly"):
        D.TokenIterator(d, batch_size=6, seq_len=10, seed=3, shard_count=4)


def test_restore_rejects_an_incompatible_state(tmp_path):
    d = _synthetic(tmp_path)
    saved = D.TokenIterator(d, batch_size=4, seq_len=16, seed=1).state()
    with pytest.raises(D.DataError, match="batch_size=4"):
        D.TokenIterator(d, batch_size=8, seq_len=16, seed=1).restore(saved)
    with pytest.raises(D.DataError, match="seq_len"):
        D.TokenIterator(d, batch_size=4, seq_len=15, seed=1).restore(saved)
    with pytest.raises(D.DataError, match="malformed"):
        D.IteratorState.from_dict({"seed": 1})


def test_corpus_smaller_than_one_batch_is_a_clear_error(tmp_path):
    D.prepare(_files(tmp_path), tmp_path / "out")
    with pytest.raises(D.DataError, match="too small for one batch"):
        D.TokenIterator(tmp_path / "out", batch_size=8, seq_len=64, seed=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(20, 3000), batch=st.integers(1, 8), seq=st.integers(1, 40), shard=st.integers(1, 500),
       seed=st.integers(0, 2**31))
def test_each_epoch_visits_distinct_windows(n, batch, seq, shard, seed):
    w = seq + 1
    if n // w < batch:
        return
    with tempfile.TemporaryDirectory() as tmp:
        D.write_tokens(np.arange(n) % 65536, Path(tmp) / "d", vocab_size=65536, shard_tokens=shard)
        it = D.TokenIterator(Path(tmp) / "d", batch_size=batch, seq_len=seq, seed=seed)
        assert it.windows_per_epoch == n // w
        for epoch in range(2):
            seen = []
            for _ in range(it.batches_per_epoch):
                b = next(it)
                assert np.array_equal(b - b[:, :1], np.broadcast_to(np.arange(w), b.shape))  # contiguous
                assert np.all(b[:, 0] % w == 0)  # aligned to a window
                seen += (b[:, 0] // w).tolist()
            assert len(set(seen)) == len(seen) == it.batches_per_epoch * batch
            assert max(seen) < it.windows_per_epoch
            assert it.state().epoch == epoch + 1

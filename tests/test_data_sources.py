"""Sources as documents (angel_jax.data.sources): JSON Lines and Parquet records prepare into the very shards that
the same documents give as text files, and a record that cannot be read is an error naming the file and where."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from angel_jax import cli
from angel_jax.data import shards as D
from angel_jax.data import sources as S
from angel_jax.config import ConfigError, load_config

# Documents with and without a final newline, newlines inside, non-ASCII text and an empty one.
DOCS = ["def f(x):\n    return x + 1\n", "héllo wörld — ☃ 𝄞", "", "line one\nline two\n\nline four",
        "import os\nprint(os.sep)\n", "tail without newline"]


def write_text_files(directory: Path, docs: list[str]) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"d{i:02d}.txt" for i in range(len(docs))]
    for path, doc in zip(paths, docs):
        path.write_bytes(doc.encode("utf-8"))
    return paths


def write_jsonl(path: Path, records: list, *, gz: bool = False) -> Path:
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    path.write_bytes(gzip.compress(lines) if gz else lines)
    return path


def write_parquet(path: Path, columns: dict[str, list], row_group_size: int = 2) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def write_records(directory: Path, fmt: str, docs: list[str], key: str = "text") -> Path:
    """The documents as one file of `fmt`, with a second field beside the text."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "parquet":
        return write_parquet(directory / "docs.parquet", {"id": list(range(len(docs))), key: docs})
    gz = fmt == "jsonl.gz"
    return write_jsonl(directory / f"docs.{fmt}", [{"id": i, key: d} for i, d in enumerate(docs)], gz=gz)


def shards(out: Path) -> tuple[dict, dict[str, bytes]]:
    """(the token counts of meta.json, each shard file's bytes): what two preparations must agree on."""
    meta = D.load_meta(out)
    counts = {k: meta[k] for k in ("tokenizer", "vocab_size", "shards", "val_shards", "total_tokens")}
    return counts, {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.name != "meta.json"}


# ---------------------------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet"])
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_records_prepare_into_the_shards_of_the_same_documents_as_text_files(tmp_path, fmt, tokenizer):
    if tokenizer == "bpe":
        pytest.importorskip("tokenizers")
    docs = DOCS * 3
    text_files = write_text_files(tmp_path / "txt", docs)
    records = write_records(tmp_path / "rec", fmt, docs)
    kwargs = dict(tokenizer=tokenizer, vocab_size=300, shard_tokens=37)
    from_text = D.prepare(text_files, tmp_path / "from-text", **kwargs)
    from_records = D.prepare([records], tmp_path / "from-records", **kwargs)
    assert shards(tmp_path / "from-records") == shards(tmp_path / "from-text")
    assert from_records["source_bytes"] == from_text["source_bytes"] == sum(len(d.encode()) for d in docs)
    if tokenizer == "bpe":  # one EOT after every document, the empty ones included
        assert from_records["total_tokens"] > len(docs) and (tmp_path / "from-records" / "tokenizer.json").is_file()


@pytest.mark.parametrize("max_bytes", [1, 40, 41, 10_000])
def test_max_bytes_cuts_the_last_record_as_it_cuts_the_last_file(tmp_path, max_bytes):
    text_files = write_text_files(tmp_path / "txt", DOCS)
    records = write_records(tmp_path / "rec", "jsonl", DOCS)
    D.prepare(text_files, tmp_path / "from-text", max_bytes=max_bytes)
    D.prepare([records], tmp_path / "from-records", max_bytes=max_bytes)
    assert shards(tmp_path / "from-records") == shards(tmp_path / "from-text")


def test_a_mixed_directory_reads_each_file_in_its_format(tmp_path):
    src = tmp_path / "mixed"
    write_text_files(src, DOCS[:2])  # d00.txt, d01.txt
    write_jsonl(src / "e.jsonl", [{"text": DOCS[2]}, {"text": DOCS[3]}])
    write_parquet(src / "f.parquet", {"text": DOCS[4:]})
    (src / "g.bin").write_bytes(b"\x00\x01binary")  # not text, not a record format: skipped
    assert S.resolve_sources(str(src)) == [src / "d00.txt", src / "d01.txt", src / "e.jsonl", src / "f.parquet"]
    D.ensure_prepared(tmp_path / "from-dir", str(src))
    D.prepare(write_text_files(tmp_path / "txt", DOCS), tmp_path / "from-text")
    assert shards(tmp_path / "from-dir") == shards(tmp_path / "from-text")


def test_a_jsonl_file_is_records_in_a_glob_and_as_a_single_file(tmp_path):
    path = write_records(tmp_path, "jsonl", DOCS)
    assert [S.source_format(p) for p in (path, Path("x.JSONL.GZ"), Path("x.parquet"), Path("x.json"))] == \
        ["jsonl", "jsonl", "parquet", "text"]
    texts = [b"".join(block for _, block, _ in S.read_documents(S.resolve_sources(src)))
             for src in (str(path), str(tmp_path / "*.jsonl"))]
    assert texts == ["".join(DOCS).encode()] * 2


# --------------------------------------------------------------------------------------------------- errors


def _read_all(path: Path, text_key: str = "text") -> list[bytes]:
    return [block for _, block, _ in S.read_documents([path], text_key=text_key)]


def test_a_malformed_json_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "cut\n{"text": "never read"}\n')
    with pytest.raises(D.DataError, match=r"bad\.jsonl:3: not a valid JSON line"):
        _read_all(path)


def test_a_record_without_the_key_names_the_keys_it_has(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a"}, {"text": "b"}, {"content": "c", "id": 3}])
    with pytest.raises(D.DataError, match=r"docs\.jsonl:3: no key 'text' \(data\.text_key\); "
                                          r"this record's keys: 'content', 'id'"):
        _read_all(path)
    assert _read_all(write_jsonl(tmp_path / "b.jsonl", [{"content": "c"}]), text_key="content") == [b"c"]


@pytest.mark.parametrize("value, kind", [(3, "a number"), (None, "null"), (["a"], "an array")])
def test_a_record_whose_text_is_not_a_string_is_an_error(tmp_path, value, kind):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a"}, {"text": value}])
    with pytest.raises(D.DataError, match=rf"docs\.jsonl:2: 'text' is {kind}, not a string"):
        _read_all(path)


def test_a_line_that_is_not_an_object_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", ["just a string"])
    with pytest.raises(D.DataError, match=r"docs\.jsonl:1: expected a JSON object .* got a string"):
        _read_all(path)


def test_a_parquet_file_without_the_column_lists_its_columns(tmp_path):
    path = write_parquet(tmp_path / "docs.parquet", {"id": [1, 2], "body": ["a", "b"]})
    with pytest.raises(D.DataError, match=r"docs\.parquet: no column 'text' \(data\.text_key\); "
                                          r"its columns: 'id', 'body'"):
        _read_all(path)
    assert _read_all(path, text_key="body") == [b"a", b"b"]


def test_a_parquet_column_that_is_not_strings_is_an_error(tmp_path):
    path = write_parquet(tmp_path / "docs.parquet", {"text": [1, 2]})
    with pytest.raises(D.DataError, match=r"docs\.parquet: column 'text' holds int64, not strings"):
        _read_all(path)


def test_a_null_in_a_parquet_column_names_the_row_group_and_row(tmp_path):
    path = write_parquet(tmp_path / "docs.parquet", {"text": ["a", "b", "c", None, "e"]}, row_group_size=2)
    with pytest.raises(D.DataError, match=r"docs\.parquet: row group 1, row 1: 'text' is null"):
        _read_all(path)


def test_a_file_that_is_not_parquet_is_named(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_text("not parquet at all")
    with pytest.raises(D.DataError, match=r"fake\.parquet: not a readable Parquet file"):
        _read_all(path)


def test_an_empty_text_key_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'data\.text_key'.*must not be empty"):
        load_config(None, ["data.text_key="])


# ------------------------------------------------------------------------------------------- re-preparation


def test_changing_the_text_key_prepares_record_sources_again_and_text_sources_not(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", [{"text": "from text\n", "body": "from body\n"}] * 20)
    out = tmp_path / "data" / "out"
    D.ensure_prepared(out, str(src))
    mtime = (out / "meta.json").stat().st_mtime_ns
    assert D.ensure_prepared(out, str(src), text_key="text")["spec"]["text_key"] == "text"
    assert (out / "meta.json").stat().st_mtime_ns == mtime  # same key: reused
    D.ensure_prepared(out, str(src), text_key="body")
    assert shards(out)[1]["train_00000.bin"][::2] == b"from body\n" * 20

    text = write_text_files(tmp_path / "txt", ["plain text\n" * 20])[0]
    meta = D.ensure_prepared(tmp_path / "data" / "txt", str(text))
    assert meta["spec"]["text_key"] is None
    assert D.ensure_prepared(tmp_path / "data" / "txt", str(text), text_key="body") == meta  # reused


def test_cli_prepare_reads_the_text_key(tmp_path, capsys):
    src = write_parquet(tmp_path / "docs.parquet", {"body": ["abc\n"] * 10})
    assert cli.main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "out"),
                     "--text-key", "body"]) == 0
    assert "40 tokens" in capsys.readouterr().out
    assert bytes(shards(tmp_path / "out")[1]["train_00000.bin"][::2]) == b"abc\n" * 10
    assert cli.main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "out2")]) == 1
    assert "no column 'text'" in capsys.readouterr().err


def test_a_text_file_larger_than_a_block_is_cut_after_newlines_only_between_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "_BLOCK", 16)
    path = tmp_path / "big.txt"
    path.write_bytes(b"".join(f"line {i}\n".encode() for i in range(30)) + b"tail\n\nend")
    blocks = [(block, last) for _, block, last in S.read_documents([path])]
    assert b"".join(b for b, _ in blocks) == path.read_bytes()
    assert [last for _, last in blocks] == [False] * (len(blocks) - 1) + [True] and len(blocks) > 10
    assert all(b.endswith(b"\n") and len(b) <= 2 * 16 for b, _ in blocks[:-1])  # a block and the carry
    cut = [b for _, b, _ in S.read_documents([path, path], max_bytes=300)]
    assert b"".join(cut) == (path.read_bytes() * 2)[:300]

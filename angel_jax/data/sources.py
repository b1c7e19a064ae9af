"""Source files as a stream of documents: which files a source names, and their text, one document at a time.

Three formats, told apart by the file name:

    *.jsonl, *.jsonl.gz   JSON Lines: one JSON object per line, a document per object, its text under text_key
    *.parquet             Parquet: a document per row, its text in the string column text_key
    anything else         plain text: one document per file

A directory source walks every non-hidden file and reads each in its own format, so one directory may mix the
three; a plain file there is taken only when it looks like text (no NUL byte in its first block), which keeps
stray binaries out. A plain-text file named as a source or by a glob is refused when its first MiB looks binary (a
NUL byte, or mostly not UTF-8) unless allow_binary. Everything streams: text files in blocks, JSON Lines line by
line, Parquet by record batches of one row group at a time, and only the text column is read.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import json
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from angel_jax.errors import AngelError

TEXT, JSONL, PARQUET = "text", "jsonl", "parquet"
_SUFFIXES = ((".jsonl", JSONL), (".jsonl.gz", JSONL), (".parquet", PARQUET))
_BLOCK = 64 * 2**20  # bytes read at a time from one text file
_SNIFF = 8192  # bytes inspected to tell a text file from a binary one
_TEXT_SAMPLE = 2**20  # bytes of a plain-text source checked before it is read as text
_MAX_NOT_UTF8 = 0.5  # share of those bytes that may be outside valid UTF-8 (the stdlib's KOI8-R module has 42%)
_PARQUET_BATCH = 4096  # rows per record batch read from a Parquet row group


class DataError(AngelError, ValueError):
    """A user-facing data problem; the message names the path or setting at fault."""


def source_format(path: Path) -> str:
    """TEXT, JSONL or PARQUET, by the file's name (case-insensitive)."""
    name = Path(path).name.lower()
    return next((fmt for suffix, fmt in _SUFFIXES if name.endswith(suffix)), TEXT)


def holds_records(files: list[Path]) -> bool:
    """Whether any file is read as records (JSON Lines or Parquet), whose text depends on the text key."""
    return any(source_format(p) != TEXT for p in files)


# ------------------------------------------------------------------------------------------------ file lists


def stdlib_corpus_files() -> list[Path]:
    """This interpreter's standard library *.py files, sorted by relative path (same order on every host)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):  # os.walk: several times faster than Path.rglob here
        dirnames[:] = [d for d in dirnames if d not in skip]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    files = [p for p in files if p.is_file()]
    if not files:
        raise DataError(f"no standard library sources under {root} (a Python installed without its .py files?)")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _looks_like_text(path: Path) -> bool:
    # A NUL byte in the first block is the classic binary test (what git and grep use).
    try:
        with open(path, "rb") as f:
            return b"\0" not in f.read(_SNIFF)
    except OSError:
        return False


def resolve_sources(source: str) -> list[Path]:
    """'stdlib', a file, a directory (recursive: every non-hidden JSON Lines, Parquet or text file) or a glob ->
    sorted file list."""
    if source == "stdlib":
        return stdlib_corpus_files()
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(path).parts)]
        files = sorted((p for p in files if source_format(p) != TEXT or _looks_like_text(p)),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise DataError(f"source directory {path} holds no text, JSON Lines or Parquet files")
        return files
    if any(c in source for c in "*?["):
        matches = glob.glob(os.path.expanduser(source), recursive=True)
        files = sorted(Path(m) for m in matches if os.path.isfile(m))
        if not files:
            raise DataError(f"source glob {source!r} matches no files")
        return files
    raise DataError(f"data source {source!r} not found: expected 'stdlib', an existing file or directory, or a glob")


def check_text(path: Path, sample: bytes) -> None:
    """Raises DataError naming `path` when the first bytes of a plain-text source look binary: a NUL byte, or mostly
    (over _MAX_NOT_UTF8) bytes outside valid UTF-8 (a sequence cut by the sample's end does not count)."""
    sample = sample[:_TEXT_SAMPLE]
    hint = "set data.allow_binary=true to train on its bytes anyway"
    nul = sample.find(b"\0")
    if nul >= 0:
        raise DataError(f"{path}: a binary file, not text (a NUL byte at offset {nul}); {hint}")
    decoder = codecs.getincrementaldecoder("utf-8")("ignore")
    valid = len(decoder.decode(sample).encode("utf-8")) + len(decoder.getstate()[0])
    if sample and (len(sample) - valid) / len(sample) > _MAX_NOT_UTF8:
        raise DataError(f"{path}: not UTF-8 text ({(len(sample) - valid) / len(sample):.0%} of its first "
                        f"{len(sample):,} bytes are not UTF-8); {hint}")


# ------------------------------------------------------------------------------------------------- documents


@dataclass
class ReadStats:
    files: int = 0
    bytes: int = 0
    """Bytes of document text read (UTF-8): a text file's bytes, a record's text, not its JSON or Parquet."""


def read_documents(files: list[Path], *, text_key: str = "text", max_bytes: int | None = None,
                   stats: ReadStats | None = None, allow_binary: bool = False) -> Iterator[tuple[Path, bytes, bool]]:
    """Yield (file, block of UTF-8 text, is_last_block_of_its_document) for every document of `files` in order,
    stopping after max_bytes (None or 0 = all) of text in total; the last document read is cut to fit.

    A text file is one document, read in blocks that end at a newline where possible (a BPE never sees a word or a
    UTF-8 sequence cut in two, one huge file never sits in RAM whole); a record is one document, one block. A text
    file that looks binary (check_text) raises DataError unless allow_binary.
    """
    budget = max_bytes or None
    stats = stats if stats is not None else ReadStats()
    for path in files:
        if budget is not None and budget <= 0:
            return
        fmt = source_format(path)
        if fmt == TEXT:
            blocks = _text_blocks(path, budget, allow_binary)
        else:
            texts = _jsonl_texts(path, text_key) if fmt == JSONL else _parquet_texts(path, text_key)
            blocks = ((text.encode("utf-8"), True) for text in texts)
        stats.files += 1
        for block, last in blocks:
            if budget is not None:
                if len(block) >= budget:
                    block, last = block[:budget], True
                budget -= len(block)
            stats.bytes += len(block)
            yield path, block, last
            if budget is not None and budget <= 0:
                return


def _text_blocks(path: Path, budget: int | None, allow_binary: bool = False) -> Iterator[tuple[bytes, bool]]:
    """A text file in blocks of about _BLOCK bytes (at most `budget` in all), each cut after its last newline.

    The last block is never cut: a file that fits one block is one piece of text, tokenized exactly as the same
    document read from a record (a BPE's pre-tokenizer splits "\\n\\nx" and "\\n\\n" + "x" differently).
    """
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read source file {path}: {e.strerror}") from e
    with f:
        carry, checked = b"", allow_binary
        while True:
            want = _BLOCK if budget is None else min(_BLOCK, budget)
            chunk = f.read(want) if want > 0 else b""
            if not checked:  # the file's first block: checked once, so a big corpus costs nothing more
                check_text(path, chunk)
                checked = True
            if budget is not None:
                budget -= len(chunk)
            data = carry + chunk
            if len(chunk) < want or want == 0 or budget == 0:  # the end of the file or of the byte budget
                yield data, True
                return
            cut = data.rfind(b"\n") + 1 or len(data)
            data, carry = data[:cut], data[cut:]
            if data:
                yield data, False


def json_kind(value: Any) -> str:
    """How a JSON value is named in an error."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every non-blank line of a JSON Lines file, .gz read through; a file that cannot be
    opened, or read to its end, is a DataError naming it."""
    try:
        f = gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read source file {path}: {e.strerror}") from e
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
        except (OSError, EOFError, zlib.error) as e:  # a damaged or cut .gz
            raise DataError(f"{path}: cannot read past line {lineno}: {e}") from e


def _jsonl_texts(path: Path, text_key: str) -> Iterator[str]:
    """The text_key string of every line's object, line by line; blank lines are skipped."""
    for lineno, line in jsonl_lines(path):
        yield _record_text(path, lineno, line, text_key)


def json_object(path: Path, lineno: int, line: bytes, wanted: str) -> dict:
    """The JSON object on line `lineno` of `path`; a DataError naming the file and line when it is not UTF-8, not
    JSON or not an object (`wanted` says what the object should hold: "with a 'text' key")."""
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno}: not UTF-8 (byte {e.start + 1} of the line)") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a valid JSON line: {e.msg} at column {e.colno}") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{lineno}: expected a JSON object {wanted}, got {json_kind(record)}")
    return record


def _record_text(path: Path, lineno: int, line: bytes, text_key: str) -> str:
    record = json_object(path, lineno, line, f"with a {text_key!r} key (data.text_key)")
    if text_key not in record:
        keys = ", ".join(repr(k) for k in record) or "none"
        raise DataError(f"{path}:{lineno}: no key {text_key!r} (data.text_key); this record's keys: {keys}")
    text = record[text_key]
    if not isinstance(text, str):
        raise DataError(f"{path}:{lineno}: {text_key!r} is {json_kind(text)}, not a string")
    return text


def _parquet_texts(path: Path, text_key: str) -> Iterator[str]:
    """The text_key column of a Parquet file, row group by row group, a record batch at a time."""
    import pyarrow as pa  # imported lazily: only Parquet sources need it
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: not a readable Parquet file: {e}") from e
    try:
        schema = pf.schema_arrow
        if text_key not in schema.names:
            raise DataError(f"{path}: no column {text_key!r} (data.text_key); its columns: "
                            f"{', '.join(repr(n) for n in schema.names) or 'none'}")
        kind = schema.field(text_key).type
        value_kind = kind.value_type if pa.types.is_dictionary(kind) else kind
        if not (pa.types.is_string(value_kind) or pa.types.is_large_string(value_kind)
                or pa.types.is_string_view(value_kind)):
            raise DataError(f"{path}: column {text_key!r} holds {kind}, not strings")
        for group in range(pf.num_row_groups):
            row = 0
            try:
                for batch in pf.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group], columns=[text_key]):
                    column = batch.column(0)
                    if column.null_count:
                        first = row + column.is_null().to_pylist().index(True)
                        raise DataError(f"{path}: row group {group}, row {first}: {text_key!r} is null, "
                                        "not a string")
                    row += len(column)
                    yield from column.to_pylist()
            except (OSError, pa.ArrowException) as e:
                raise DataError(f"{path}: cannot read row group {group}: {e}") from e
    finally:
        pf.close()

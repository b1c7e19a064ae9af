"""Tokenizers, token shards and a deterministic, resumable token iterator.

A prepared data directory holds:

    meta.json        format, tokenizer, vocab size, shard list, token counts, the spec it was prepared from and
                     the content of its sources (sha256 per file: what a resume compares, data/identity.py)
    train_00000.bin  raw little-endian uint16 tokens (uint32 for a vocabulary past 65536 ids; np.memmap-able);
                     every shard but the last has shard_tokens (instruction data: int32 rows of seq_len + 1 marked
                     tokens, angel_jax/data/instructions.py)
    val_00000.bin    optional held-out tail of the token stream (val_fraction > 0)
    tokenizer.json   the locally trained BPE (tokenizer "bpe"), or a copy of the Hugging Face tokenizer's files
                     (tokenizer "hf": with its tokenizer_config.json and special_tokens_map.json when it has them)

The shards are one token stream cut only for storage: the iterator reads windows across shard boundaries, so the
batches do not depend on shard_tokens. Nothing is downloaded: the byte tokenizer needs no vocabulary, the BPE is
trained on the corpus itself, the Hugging Face tokenizer is a local directory (hf_tokenizer.py), and the default
corpus is this interpreter's own standard library source.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

# DataError and resolve_sources are also this module's API (callers name them through it).
from angel_jax.data.sources import DataError, ReadStats, holds_records, read_documents, resolve_sources
from angel_jax.data.hf_tokenizer import HfTokenizer, copy_files, fingerprint
from angel_jax.data.identity import sources_content, tokens_content

FORMAT = 1
DTYPE = np.dtype("<u2")  # little-endian on every host, so shards are portable
DTYPES = {"uint16": DTYPE, "uint32": np.dtype("<u4"), "int32": np.dtype("<i4")}
"""A shard's dtype by name (meta.json's "dtype"): uint16 while the ids fit, uint32 past 65536 ids; int32 for
instruction rows, whose tokens carry in-band marks (angel_jax/data/marks.py, angel_jax/data/instructions.py)."""
META = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"


# ----------------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: nothing to train or download, every input round-trips."""

    name = "byte"
    vocab_size = 256
    eot_id: int | None = None  # all 256 ids are real bytes; there is no spare id for a separator

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64).ravel()
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise DataError(f"byte tokenizer ids must be in [0, 255], got [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def decode_after(self, prompt: Iterable[int]) -> Callable[[Iterable[int]], str]:
        """A decoder of the ids that follow `prompt` (bytes decode alike with or without what precedes them)."""
        return self.decode


def _import_tokenizers() -> Any:
    try:
        import tokenizers  # a dependency, imported where it is used: the byte tokenizer never loads it
    except ImportError as e:
        raise DataError("tokenizer 'bpe' needs the `tokenizers` library, a dependency of angel-jax: "
                        "pip install tokenizers") from e
    return tokenizers


class BpeTokenizer:
    """A byte-level BPE (GPT-2 style) trained locally with `tokenizers`; EOT is appended after every document."""

    name = "bpe"

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.eot_id: int | None = tok.token_to_id(EOT)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    @classmethod
    def train(cls, files: list[Path], vocab_size: int, *, max_bytes: int | None = None,
              text_key: str = "text", allow_binary: bool = False) -> BpeTokenizer:
        blocks = read_documents(files, text_key=text_key, max_bytes=max_bytes, allow_binary=allow_binary)
        return cls.train_from_texts((block.decode("utf-8", errors="replace") for _, block, _ in blocks), vocab_size)

    @classmethod
    def train_from_texts(cls, texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
        tk = _import_tokenizers()
        # 256 byte symbols + EOT is the smallest vocabulary; ids must fit the uint16 shards.
        if not 257 <= vocab_size <= 65536:
            raise DataError(f"BPE vocab_size must be in [257, 65536], got {vocab_size}")
        byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = byte_level
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    def vocabulary(self) -> list[str]:
        """Every token's text as the vocabulary names it (byte-level: one character per byte)."""
        return list(self._tok.get_vocab())

    def save(self, path: Path) -> None:
        self._tok.save(str(path))

    @classmethod
    def load(cls, path: Path) -> BpeTokenizer:
        tk = _import_tokenizers()
        if not Path(path).is_file():
            raise DataError(f"BPE tokenizer file not found: {path}")
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise DataError(f"BPE tokenizer file {path} is corrupt: {e}") from e

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.uint16)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint16) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        # Keep EOT visible so decoded samples show document boundaries; invalid UTF-8 becomes U+FFFD.
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def decode_after(self, prompt: Iterable[int]) -> Callable[[Iterable[int]], str]:
        """A decoder of the ids that follow `prompt` (the byte-level decoder needs no context)."""
        return self.decode


Tokenizer = ByteTokenizer | BpeTokenizer | HfTokenizer


def load_tokenizer(data_dir: Path) -> Tokenizer:
    """The tokenizer a prepared directory was made with (to encode prompts and decode samples)."""
    meta = load_meta(data_dir)
    if meta["tokenizer"] == "byte":
        return ByteTokenizer()
    if meta["tokenizer"] == "bpe":
        return BpeTokenizer.load(Path(data_dir) / TOKENIZER_FILE)
    if meta["tokenizer"] == "hf":  # its copy, with the special tokens as they were resolved from the original
        return HfTokenizer.load(Path(data_dir), "a prepared data directory", meta.get("special_tokens"))
    raise DataError(f"{Path(data_dir) / META}: tokenizer {meta['tokenizer']!r} has no encoder")


def shard_dtype(vocab_size: int) -> str:
    """The narrowest dtype of DTYPES that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# ---------------------------------------------------------------------------------------------------- shards


class ShardWriter:
    """Appends tokens to `<prefix>_00000.bin`, `<prefix>_00001.bin`, ... of shard_tokens each."""

    def __init__(self, directory: Path, prefix: str, shard_tokens: int, dtype: np.dtype) -> None:
        self.directory, self.prefix = directory, prefix
        self.buf = np.empty(shard_tokens, dtype)  # np.empty is lazy: a small corpus touches little of it
        self.fill = 0
        self.shards: list[dict[str, Any]] = []

    def append(self, tokens: np.ndarray) -> None:
        while tokens.size:
            n = min(tokens.size, self.buf.size - self.fill)
            self.buf[self.fill:self.fill + n] = tokens[:n]
            self.fill, tokens = self.fill + n, tokens[n:]
            if self.fill == self.buf.size:
                self._flush()

    def _flush(self) -> None:
        if not self.fill:
            return
        name = f"{self.prefix}_{len(self.shards):05d}.bin"
        with open(self.directory / name, "wb") as f:
            f.write(self.buf[:self.fill].tobytes())
            f.flush()
            os.fsync(f.fileno())  # the rename that publishes the directory must not outrun the data
        self.shards.append({"file": name, "tokens": int(self.fill)})
        self.fill = 0

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        return self.shards


def split_tail(directory: Path, shards: list[dict[str, Any]], n_val: int, shard_tokens: int,
               dtype: np.dtype) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Move the last n_val tokens of the train stream into val shards (the total is only known at the end)."""
    keep = sum(s["tokens"] for s in shards) - n_val
    val = ShardWriter(directory, "val", shard_tokens, dtype)
    train, start = [], 0
    for s in shards:
        path, end = directory / s["file"], start + s["tokens"]
        if end <= keep:
            train.append(s)
        else:
            cut = max(keep - start, 0)
            val.append(np.fromfile(path, dtype)[cut:])  # at most one shard in RAM
            if cut:
                os.truncate(path, cut * dtype.itemsize)
                train.append({"file": s["file"], "tokens": cut})
            else:
                path.unlink()
        start = end
    return train, val.close()


def files_fingerprint(files: list[Path]) -> str:
    """Identity of an ordered source list: paths, sizes and mtimes (cheap; no file contents are read)."""
    h = hashlib.sha256()
    for p in files:
        try:
            st = p.stat()
        except OSError as e:
            raise DataError(f"source file not found: {p}") from e
        h.update(f"{p.absolute()}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _spec(files: list[Path], tokenizer: str, vocab_size: int, max_bytes: int | None,
          val_fraction: float | None, text_key: str, tokenizer_path: Path | None = None) -> dict[str, Any]:
    # The text key is part of the data only where there are records to read it from: a text corpus prepared before
    # the key existed (its spec has none) is still reused, and changing the key does not prepare it again. The same
    # holds for the Hugging Face tokenizer's hash: None for the others, as in specs written before it existed.
    hf = tokenizer == "hf"
    return {"tokenizer": tokenizer, "vocab_size": 256 if tokenizer == "byte" else None if hf else vocab_size,
            "max_bytes": max_bytes or None, "val_fraction": val_fraction, "fingerprint": files_fingerprint(files),
            "text_key": text_key if holds_records(files) else None,
            "tokenizer_sha256": fingerprint(hf_path(tokenizer_path)) if hf else None}


def hf_path(tokenizer_path: Path | None) -> Path:
    if tokenizer_path is None:
        raise DataError("tokenizer 'hf' needs tokenizer_path: the directory holding the Hugging Face tokenizer.json")
    return Path(tokenizer_path)


def publish(out_dir: Path, build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """Run build(tmp_dir) -> meta, write meta.json last and rename the directory into place.

    meta.json is what makes a directory count as prepared, and out_dir only ever appears whole, so a crash at any
    point leaves either the old directory or the new one, plus at worst a hidden `.name.tmp-*` to delete.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not (out_dir / META).is_file() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DataError(f"refusing to replace {out_dir}: it exists and is not a prepared data directory (no {META})")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        meta = build(tmp)
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def base_meta(tokenizer: str, vocab_size: int, train: list[dict[str, Any]],
              val: list[dict[str, Any]]) -> dict[str, Any]:
    n_train, n_val = sum(s["tokens"] for s in train), sum(s["tokens"] for s in val)
    return {"format": FORMAT, "tokenizer": tokenizer, "vocab_size": vocab_size, "dtype": shard_dtype(vocab_size),
            "shards": train, "val_shards": val, "total_tokens": n_train + n_val, "train_tokens": n_train,
            "val_tokens": n_val}


def prepare(sources: list[Path], out_dir: Path, *, tokenizer: str = "byte", vocab_size: int = 256,
            shard_tokens: int = 16 * 2**20, max_bytes: int | None = None, val_fraction: float = 0.0,
            text_key: str = "text", allow_binary: bool = False, tokenizer_path: Path | None = None) -> dict:
    """Tokenize `sources` in order into shards under out_dir (replaced atomically); returns the meta dict.

    A document is a text file, a JSON Lines record or a Parquet row (its text under `text_key`; see
    data/sources.py). Documents are simply concatenated for the byte tokenizer: all 256 ids are real bytes, so a
    separator would have to be a byte that also occurs in text, and source files already end in a newline. The BPE
    appends its EOT id after every document. The Hugging Face tokenizer in `tokenizer_path` (tokenizer "hf") makes
    each document what transformers' `tokenizer(text)` gives (its BOS, if the checkpoint has one) followed by its
    EOS. vocab_size only applies to the BPE. max_bytes (None or 0 = all) caps the text read; the last document read
    is cut to fit. val_fraction moves that share of the stream's tail to val_*.bin. A plain-text source that looks
    binary (NUL bytes, mostly not UTF-8) is refused unless allow_binary.
    """
    sources = [Path(s) for s in sources]
    if tokenizer not in ("byte", "bpe", "hf"):
        raise DataError(f"unknown tokenizer {tokenizer!r}: expected 'byte', 'bpe' or 'hf'")
    if shard_tokens < 1 or (max_bytes is not None and max_bytes < 0) or not 0.0 <= val_fraction < 1.0:
        raise DataError(f"bad prepare arguments: shard_tokens={shard_tokens} (>= 1), max_bytes={max_bytes} "
                        f"(>= 0), val_fraction={val_fraction} (in [0, 1))")
    if not sources:
        raise DataError("no source files to prepare")
    for p in sources:
        if not p.is_file():
            raise DataError(f"source file not found: {p}")
    spec = _spec(sources, tokenizer, vocab_size, max_bytes, val_fraction, text_key, tokenizer_path)

    def build(tmp: Path) -> dict[str, Any]:
        stats = ReadStats()
        documents = read_documents(sources, text_key=text_key, max_bytes=max_bytes, stats=stats,
                                   allow_binary=allow_binary)
        tok = _tokenizer_for(tokenizer, tmp, sources, vocab_size, tokenizer_path, max_bytes=max_bytes,
                             text_key=text_key, allow_binary=allow_binary)
        dtype = DTYPES[shard_dtype(tok.vocab_size)]
        writer = ShardWriter(tmp, "train", shard_tokens, dtype)
        if isinstance(tok, ByteTokenizer):
            for _, block, _ in documents:
                writer.append(np.frombuffer(block, dtype=np.uint8))
        else:
            _encode_documents(tok, documents, writer)
        train = writer.close()
        total = sum(s["tokens"] for s in train)
        if total == 0:
            raise DataError(f"the {len(sources)} source file(s) hold no text (first: {sources[0]}"
                            + (f"; records are read from their {text_key!r} key" if holds_records(sources) else "")
                            + ")")
        n_val = int(round(total * val_fraction))
        if n_val >= total:
            raise DataError(f"val_fraction={val_fraction} leaves no training tokens out of {total}")
        train, val = split_tail(tmp, train, n_val, shard_tokens, dtype) if n_val else (train, [])
        meta = base_meta(tokenizer, tok.vocab_size, train, val)
        meta.update(sources=stats.files, source_bytes=stats.bytes, spec=spec,
                    tokenizer_file=None if tokenizer == "byte" else TOKENIZER_FILE,
                    content=sources_content(sources))  # what a resume compares (data/identity.py)
        if isinstance(tok, HfTokenizer):  # what a copy without config.json still needs (load_tokenizer)
            meta.update(tokenizer_path=str(Path(tokenizer_path).absolute()), special_tokens=tok.special_tokens)
        return meta

    return publish(Path(out_dir), build)


def _tokenizer_for(tokenizer: str, tmp: Path, sources: list[Path], vocab_size: int, tokenizer_path: Path | None,
                   **read: Any) -> Tokenizer:
    """The tokenizer to prepare with; its files (the trained BPE, the Hugging Face tokenizer's) saved in tmp."""
    if tokenizer == "byte":
        return ByteTokenizer()
    if tokenizer == "bpe":
        bpe = BpeTokenizer.train(sources, vocab_size, **read)
        bpe.save(tmp / TOKENIZER_FILE)
        return bpe
    hf = HfTokenizer.load(hf_path(tokenizer_path))
    copy_files(hf_path(tokenizer_path), tmp)
    return hf


ENCODE_CHARS = 2**20
"""The longest text handed to a BPE or Hugging Face tokenizer at once: a text tokenizes in about 200 bytes of memory
per character, so a 64 MiB block or record whole would take some 13 GB (longer texts are split, split_text)."""


def split_text(text: str, most: int | None = None) -> list[str]:
    """`text` in pieces of at most `most` characters, each ending after its last newline where it has one, else
    before its last space (where a pre-tokenizer splits anyway: GPT-2's puts a space with the word after it); a
    text that fits is one piece, tokenized as it always was."""
    most = most or ENCODE_CHARS
    pieces = []
    while len(text) > most:
        head = text[:most]
        newline, space = head.rfind("\n"), head.rfind(" ")
        cut = newline + 1 if newline >= 0 else space if space > 0 else most
        pieces.append(text[:cut])
        text = text[cut:]
    return pieces + [text]


def _encode_documents(tok: BpeTokenizer | HfTokenizer, blocks: Iterable[tuple[Path, bytes, bool]],
                      writer: ShardWriter) -> None:
    """Each document's blocks encoded, between what the tokenizer puts around a document (the BPE: its EOT after
    it; a Hugging Face tokenizer: its template's BOS before, its EOS after)."""
    # encode_batch runs on all cores in Rust; batches of pieces (256, or 4 x ENCODE_CHARS characters) keep that
    # parallel without holding the corpus, and pieces of at most ENCODE_CHARS bound the tokenizer's memory by that,
    # not by a block or a record.
    hf = isinstance(tok, HfTokenizer)
    start = np.asarray(tok.document_start if hf else [], dtype=np.uint32)
    end = np.asarray(tok.document_end if hf else [tok.eot_id], dtype=np.uint32)
    pending: list[tuple[str, bool, bool]] = []
    chars = 0
    first = True  # the next block begins a document

    def flush() -> None:
        for ids, (_, begins, last) in zip(tok.encode_batch([t for t, _, _ in pending]), pending):
            if begins:
                writer.append(start)
            writer.append(ids)
            if last:
                writer.append(end)
        pending.clear()

    for _, block, last in blocks:
        pieces = split_text(block.decode("utf-8", errors="replace"))
        for i, piece in enumerate(pieces):
            pending.append((piece, first and i == 0, last and i == len(pieces) - 1))
            chars += len(piece)
            if len(pending) >= 256 or chars >= 4 * ENCODE_CHARS:
                flush()
                chars = 0
        first = last
    flush()


def write_tokens(tokens: np.ndarray, out_dir: Path, *, vocab_size: int, shard_tokens: int = 16 * 2**20,
                 tokenizer: str = "raw") -> dict:
    """Publish an in-memory token array as a prepared directory (synthetic data for tests and benchmarks)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or tokens.size == 0 or tokens.min() < 0 or tokens.max() >= min(vocab_size, 2**32):
        raise DataError(f"write_tokens needs a non-empty 1-D array of ids in [0, {vocab_size})")

    def build(tmp: Path) -> dict[str, Any]:
        dtype = DTYPES[shard_dtype(vocab_size)]
        writer = ShardWriter(tmp, "train", shard_tokens, dtype)
        writer.append(tokens.astype(dtype))
        meta = base_meta(tokenizer, vocab_size, writer.close(), [])
        meta.update(sources=0, source_bytes=0, spec=None, tokenizer_file=None, content=tokens_content(tokens))
        return meta

    return publish(Path(out_dir), build)


def load_meta(data_dir: Path) -> dict:
    """Read and check data_dir/meta.json; DataError names the file and what is wrong with it."""
    path = Path(data_dir) / META
    if not path.is_file():
        raise DataError(f"no prepared data in {data_dir}: {path} is missing (run `angel-jax data prepare`)")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is unreadable or corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise DataError(f"{path}: data format {got!r} is not supported (expected {FORMAT}); prepare it again")
    for key, typ in (("tokenizer", str), ("vocab_size", int), ("dtype", str), ("shards", list),
                     ("total_tokens", int)):
        if not isinstance(meta.get(key), typ):
            raise DataError(f"{path}: missing or malformed {key!r}")
    if meta["dtype"] not in DTYPES:
        raise DataError(f"{path}: dtype {meta['dtype']!r} is not supported (expected one of {', '.join(DTYPES)})")
    for s in meta["shards"] + meta.get("val_shards", []):
        if not (isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("tokens"), int)):
            raise DataError(f"{path}: malformed shard entry {s!r}")
    return meta


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released on close too, so a killed holder never wedges the others
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_prepared(data_dir: Path, source: str, *, tokenizer: str = "byte", vocab_size: int = 256,
                    max_bytes: int | None = None, val_fraction: float | None = None, text_key: str = "text",
                    allow_binary: bool = False, tokenizer_path: Path | None = None) -> dict:
    """Reuse data_dir if it was prepared from the same sources and settings, else prepare it (once per host group).

    "Same sources" means the same resolved file list with the same sizes and mtimes (and, for JSON Lines and
    Parquet sources, the same text key), so a directory made by `angel-jax data prepare` is reused by training,
    and an edited corpus is prepared again; "same settings" include the Hugging Face tokenizer's fingerprint (its
    tokenizer.json and special tokens), so another tokenizer in the same place prepares again. val_fraction=None
    accepts whatever split exists (and prepares with none).
    """
    files = resolve_sources(source)
    want = _spec(files, tokenizer, vocab_size, max_bytes, val_fraction, text_key, tokenizer_path)
    return reuse_or_prepare(Path(data_dir), want, lambda: prepare(
        files, Path(data_dir), tokenizer=tokenizer, vocab_size=vocab_size, max_bytes=max_bytes,
        val_fraction=val_fraction or 0.0, text_key=text_key, allow_binary=allow_binary, tokenizer_path=tokenizer_path))


def reuse_or_prepare(data_dir: Path, want: dict, make: Callable[[], dict]) -> dict:
    """data_dir's meta if its recorded spec is `want` (a `val_fraction` of None accepts any split), else `make()`'s
    (which prepares it), once per host group: under a file lock beside the directory."""
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(data_dir.parent / f".{data_dir.name}.lock"):
        if (data_dir / META).is_file():
            try:
                meta = load_meta(data_dir)
            except DataError:
                meta = {}  # corrupt or old format: prepare again
            have = meta.get("spec") or {}
            if all(have.get(k) == v for k, v in want.items() if not (k == "val_fraction" and v is None)):
                return meta
        return make()


# -------------------------------------------------------------------------------------------------- iterator


@dataclass
class IteratorState:
    """Where a TokenIterator stands (before its next batch); global, so the same on every data-parallel process."""

    seed: int
    epoch: int
    position: int  # index of the next batch's first entry in this epoch's window permutation
    batch_size: int  # global batch size
    seq_len: int
    windows_per_epoch: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IteratorState:
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or set(d) != names or not all(type(d[k]) is int for k in names):
            raise DataError(f"malformed data iterator state {d!r}: expected integer fields {sorted(names)}")
        return cls(**d)


class TokenIterator:
    """Endless batches of windows of seq_len+1 tokens, in a per-epoch order fixed by (seed, epoch).

    The train stream (all shards, in order) is cut into non-overlapping windows [w*(L+1), (w+1)*(L+1)); a window
    may span two shards, so shard size never changes the data. Epoch e visits windows in the order
    default_rng([seed, e]).permutation(windows_per_epoch); global batch b is entries [b*B, (b+1)*B) of it and the
    incomplete last batch is dropped. Process i of n takes rows [i*B/n, (i+1)*B/n) of each global batch, so n
    processes together see exactly what one would. Shards are memory-mapped; only the rows asked for are read.
    Instruction data is stored as rows of exactly seq_len+1 tokens, so its windows are its rows.
    """

    def __init__(self, data_dir: Path, *, batch_size: int, seq_len: int, seed: int, shard_index: int = 0,
                 shard_count: int = 1, split: str = "train") -> None:
        data_dir = Path(data_dir)
        if batch_size < 1 or seq_len < 1 or seed < 0:
            raise DataError(f"batch_size={batch_size} and seq_len={seq_len} must be >= 1, seed={seed} >= 0")
        if shard_count < 1 or not 0 <= shard_index < shard_count or batch_size % shard_count:
            raise DataError(f"batch_size={batch_size} must split evenly over shard_count={shard_count} "
                            f"processes (shard_index={shard_index})")
        if split not in ("train", "val"):
            raise DataError(f"unknown split {split!r}: expected 'train' or 'val'")
        self.meta = load_meta(data_dir)
        self.vocab_size: int = self.meta["vocab_size"]
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.local_batch_size = batch_size // shard_count
        self._row0 = shard_index * self.local_batch_size
        dtype = DTYPES[self.meta["dtype"]]
        self._maps = [self._open_shard(data_dir, s, dtype)
                      for s in self.meta["shards" if split == "train" else "val_shards"]]
        self._starts = np.cumsum([0] + [m.size for m in self._maps], dtype=np.int64)
        total = int(self._starts[-1])
        self.window = seq_len + 1
        rows = (self.meta.get("instruction") or {}).get("row_tokens")
        if rows is not None and rows != self.window:  # windows would cut across its rows
            raise DataError(f"{data_dir} holds instruction rows of {rows} tokens (model.seq_len {rows - 1} + 1), "
                            f"this run reads windows of model.seq_len+1={self.window}: prepare it again for this "
                            "model.seq_len (another data.dir, or an empty one to have it chosen)")
        self.windows_per_epoch: int = total // self.window
        self.batches_per_epoch: int = self.windows_per_epoch // batch_size
        if self.batches_per_epoch == 0:
            raise DataError(f"the {split} data in {data_dir} is too small for one batch: {total} tokens make "
                            f"{self.windows_per_epoch} windows of seq_len+1={self.window} tokens, fewer than "
                            f"batch_size={batch_size}; use more data or a smaller batch_size/seq_len")
        self.epoch, self.position = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, np.int64)

    @staticmethod
    def _open_shard(data_dir: Path, shard: dict[str, Any], dtype: np.dtype) -> np.memmap:
        path = data_dir / shard["file"]
        want = shard["tokens"] * dtype.itemsize
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            raise DataError(f"shard {path} is {'missing' if size is None else f'{size} bytes'}, "
                            f"meta.json says {want} bytes: the data directory is damaged; prepare it again")
        return np.memmap(path, dtype=dtype, mode="r")

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:  # one epoch's permutation is small (8 bytes per window)
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.windows_per_epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def _read_window(self, w: int, out: np.ndarray) -> None:
        start, filled = w * self.window, 0
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        while filled < self.window:  # at most two iterations unless shards are shorter than a window
            off = start + filled - int(self._starts[k])
            piece = self._maps[k][off:off + self.window - filled]
            out[filled:filled + piece.size] = piece
            filled, k = filled + piece.size, k + 1

    def __iter__(self) -> TokenIterator:
        return self

    def __next__(self) -> np.ndarray:
        """This process's rows of the next global batch: int32 [batch_size // shard_count, seq_len + 1]."""
        first = self.position + self._row0
        rows = self._permutation()[first:first + self.local_batch_size]
        batch = np.empty((self.local_batch_size, self.window), dtype=np.int32)
        for i, w in enumerate(rows):
            self._read_window(int(w), batch[i])
        self.skip(1)
        return batch

    @property
    def batch_index(self) -> int:
        """Global index of the next batch in the stream (epoch-major, 0-based): the unit of data.skip_batches."""
        return self.epoch * self.batches_per_epoch + self.position // self.batch_size

    def skip(self, n_batches: int = 1) -> None:
        """Advance past n global batches without reading them (e.g. to skip a data window after an anomaly)."""
        for _ in range(n_batches):
            self.position += self.batch_size
            if self.position + self.batch_size > self.windows_per_epoch:  # drop the incomplete last batch
                self.epoch, self.position = self.epoch + 1, 0

    def state(self) -> IteratorState:
        return IteratorState(seed=self.seed, epoch=self.epoch, position=self.position, batch_size=self.batch_size,
                             seq_len=self.seq_len, windows_per_epoch=self.windows_per_epoch)

    def restore(self, state: IteratorState) -> None:
        """Continue from `state`; DataError if it was saved by an iterator over other data or with other sizes."""
        mine = self.state()
        for key in ("seed", "batch_size", "seq_len", "windows_per_epoch"):
            if getattr(state, key) != getattr(mine, key):
                raise DataError(f"data iterator state does not match: saved {key}={getattr(state, key)}, "
                                f"this run has {key}={getattr(mine, key)}")
        if state.epoch < 0 or state.position < 0 or state.position % self.batch_size \
                or state.position + self.batch_size > self.windows_per_epoch:
            raise DataError(f"data iterator state is out of range: epoch={state.epoch} position={state.position}")
        self.epoch, self.position = state.epoch, state.position

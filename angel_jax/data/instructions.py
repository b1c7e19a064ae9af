"""Instruction data (`data.format: instruction`): JSON Lines records of a prompt and a response, or of a chat,
prepared into rows of marked tokens whose loss is on the response (the assistant's turns) only.

    meta = ensure_prepared(data_dir, source, Rows(row_tokens=seq_len + 1, pack=False), tokenizer="hf",
                           tokenizer_path=hf_dir)       # then data.TokenIterator reads its rows as windows

A record {"prompt": ..., "response": ...} (the keys data.prompt_key and data.response_key, both strings) is one
document: what the tokenizer puts before a text (a Hugging Face tokenizer's BOS), the ids of prompt + response
encoded as one text (so the join tokenizes as it would in running text), then what ends a document (its EOS; the
BPE's end-of-text; nothing for bytes). The prompt's tokens are those up to where the prompt's own ids stop matching
the whole text's.

A chat record {"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]} is one document: the
conversation rendered by the Hugging Face tokenizer's chat template and encoded as transformers'
`apply_chat_template(messages, tokenize=True)` encodes it. Its scored tokens are the assistant's turns, found
conversation prefix by conversation prefix: an assistant turn k spans the characters from where the rendering of
messages[:k] with the template's prompt for a reply stops matching the whole rendering, to where the rendering of
messages[:k+1] stops matching it (its content and what the template ends a turn with); a token is scored when
its characters overlap a turn (the rule of transformers' `return_assistant_tokens_mask`). Characters, not token
ids, are compared, so a token the tokenizer merges across a turn's start does not move it. The byte and BPE
tokenizers have no template: a chat record is refused with them.

Every token carries its marks in-band (angel_jax/data/marks.py): the prompt's tokens and each document's first
token are not scored (nothing in the document predicts its first token), the response's and the end are; the
first token marks the document's start.

Rows hold row_tokens (seq_len + 1) tokens:

    pack false   one document per row, cut to the row, then padding (the tokenizer's pad id, else its EOS, else 0;
                 never scored, a document start of its own)
    pack true    documents end to end in record order; one that does not fit in what is left of a row starts the
                 next (the rest padded); the model keeps them apart (models/documents.py)

Before tokenization a record's texts are cut to what a row can use (text_bound, bounded): the work and memory of a
record are bounded by the row, and the row is the one the whole record gives. A document cut so short that none
of its response is left is dropped; meta.json's "instruction" entry counts the records, the cut, truncated and
dropped ones, those with an empty response (kept, warned about once: only their end is scored), the rows and the
scored tokens. Shards are int32 (the marks use the
sign and bit 30); the val split is the tail rows. A bad record stops preparation naming its file and line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from angel_jax.data import shards as data_lib
from angel_jax.data import marks as token_marks
from angel_jax.config import ConfigError
from angel_jax.data.sources import JSONL, DataError, json_kind, json_object, jsonl_lines, resolve_sources, source_format
from angel_jax.data.hf_tokenizer import HfTokenizer, chat_template_fingerprint, copy_files, fingerprint
from angel_jax.data.identity import sources_content

log = logging.getLogger(__name__)

SHARD_DTYPE = "int32"
MESSAGES = "messages"
"""The key of a chat record's messages."""
ASSISTANT = "assistant"
"""The role whose turns are scored."""
_BATCH = 256  # records encoded per call (encode_batch runs on every core)


@dataclass(frozen=True)
class Rows:
    """How records become rows: their keys, the row length and packing or padding."""

    row_tokens: int
    """Tokens per row: model.seq_len + 1."""
    pack: bool = False
    prompt_key: str = "prompt"
    response_key: str = "response"


@dataclass
class Counts:
    """What preparation made of the records (meta.json's "instruction" entry)."""

    records: int = 0
    cut: int = 0
    """Records whose texts were cut before tokenization, to what a row can use (text_bound)."""
    empty: int = 0
    """Records with an empty response (a chat: an empty assistant turn): only the end of it is scored."""
    truncated: int = 0
    """Documents longer than a row, cut to it."""
    dropped: int = 0
    """Documents with no response token left in a row (a prompt, or a chat's turns before the assistant's first
    one, as long as the row)."""
    rows: int = 0
    scored_tokens: int = 0


# --------------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Chat:
    """A chat record: its messages (objects with a string role and content), one of them at least the assistant's."""

    messages: tuple[dict[str, Any], ...]
    where: str
    """Its file and line, for errors."""


Record = tuple[str, str] | Chat
"""A record: (prompt, response), or a chat."""


def records(files: list[Path], rows: Rows) -> Iterator[Record]:
    """Every record of the JSON Lines `files`, in order; DataError naming the file and line of a record that is
    neither an object of two strings nor a chat."""
    for path in files:
        if source_format(path) != JSONL:
            raise DataError(f"{path}: data.format 'instruction' reads JSON Lines records (*.jsonl, *.jsonl.gz) of "
                            f"{rows.prompt_key!r} and {rows.response_key!r}, or of {MESSAGES!r}; this file is not one")
        yield from _records_of(path, rows)


def _records_of(path: Path, rows: Rows) -> Iterator[Record]:
    for lineno, line in jsonl_lines(path):
        yield parse_record(path, lineno, line, rows)


def parse_record(path: Path, lineno: int, line: bytes, rows: Rows) -> Record:
    """One JSON line's (prompt, response), or its chat (a record with 'messages' and neither key)."""
    where = f"{path}:{lineno}"
    record = json_object(path, lineno, line, f"with {rows.prompt_key!r} and {rows.response_key!r} keys (or "
                                             f"{MESSAGES!r})")
    if MESSAGES in record and rows.prompt_key not in record and rows.response_key not in record:
        return parse_chat(where, record[MESSAGES])
    out = []
    for key, config_key in ((rows.prompt_key, "data.prompt_key"), (rows.response_key, "data.response_key")):
        if key not in record:
            keys = ", ".join(repr(k) for k in record) or "none"
            raise DataError(f"{where}: no key {key!r} ({config_key}); this record's keys: {keys} (a chat record "
                            f"has {MESSAGES!r} instead)")
        if not isinstance(record[key], str):
            raise DataError(f"{where}: {key!r} ({config_key}) is {json_kind(record[key])}, not a string")
        out.append(record[key])
    return out[0], out[1]


def parse_chat(where: str, messages: Any) -> Chat:
    """A record's 'messages': a list of objects with a string 'role' and 'content', one role the assistant's."""
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if isinstance(messages, list) else json_kind(messages)
        raise DataError(f"{where}: {MESSAGES!r} is {what}, not a list of messages (objects with 'role' and "
                        f"'content')")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {MESSAGES}[{i}] is {json_kind(message)}, not an object with 'role' and "
                            f"'content'")
        for key in ("role", "content"):
            if key not in message:
                keys = ", ".join(repr(k) for k in message) or "none"
                raise DataError(f"{where}: {MESSAGES}[{i}] has no {key!r}; its keys: {keys}")
            if not isinstance(message[key], str):
                raise DataError(f"{where}: {MESSAGES}[{i}]'s {key!r} is {json_kind(message[key])}, not a string")
    if not any(m["role"] == ASSISTANT for m in messages):
        roles = ", ".join(dict.fromkeys(repr(m["role"]) for m in messages))
        raise DataError(f"{where}: no message with role {ASSISTANT!r}, whose turns the loss is on; this chat's "
                        f"roles: {roles}")
    return Chat(tuple(messages), where)


def _texts(items: Iterable[Record], tokenizer: str) -> Iterator[str]:
    """Each record's text (prompt + response), for training a BPE, in pieces the trainer's memory is bounded by
    (data_lib.split_text: whole below ENCODE_CHARS; the vocabulary is the one all of the text gives); a chat record
    is refused (no template)."""
    for item in items:
        if isinstance(item, Chat):
            raise no_template(item, tokenizer)
        yield from data_lib.split_text(item[0] + item[1])


# ---------------------------------------------------------------------------------------- bounded records

TOKEN_CHARS_FLOOR = 128
"""The least characters a BPE or Hugging Face token is assumed to span at most (text_bound)."""


def token_chars(tok: data_lib.Tokenizer) -> int:
    """At most how many characters of a text one token of `tok` covers, generously: 1 for bytes (a token is a byte,
    a character one byte or more); else twice the longest vocabulary entry, at least TOKEN_CHARS_FLOOR."""
    if isinstance(tok, data_lib.ByteTokenizer):
        return 1
    # A vocabulary entry's length bounds its token's text (byte-level entries have one character per byte, more
    # than the text's characters); the floor covers an unknown-word token (WordPiece's [UNK] stands for a word of up
    # to 100 characters) and the doubling a merge that a cut moves (a BPE word's last merges can differ when it is
    # cut, and so can a pre-tokenizer's split that looks ahead).
    longest = max((len(t) for t in tok.vocabulary()), default=1)
    return 2 * max(longest, TOKEN_CHARS_FLOOR)


def text_bound(row_tokens: int, chars_per_token: int) -> int:
    """Characters of a record's texts that can reach a row of row_tokens: past them no token is kept, so a text cut
    there gives the row it gives whole (exactly, for bytes: row_tokens + 1 characters are more than a row's bytes, so
    the document is still truncated and its end still cut off)."""
    return (row_tokens + 1) * chars_per_token


def bounded(items: Iterable[Record], chars: int, counts: Counts) -> Iterator[Record]:
    """Each record with its texts cut to `chars` characters (counted in counts.cut): a prompt and a response each
    (a document's tokens come from their join, which the cut prompt + response still begins), a chat's contents
    each and its messages after those `chars` characters of content dropped (the template renders a conversation's
    messages in order, each with at least its content's characters, so nothing past them reaches a row). The work
    and memory of tokenizing a record are then bounded by the row, not the record."""
    for item in items:
        counts.empty += _empty_response(item)
        cut = _cut(item, chars)
        if cut is not item:
            counts.cut += 1
        yield cut


def _empty_response(item: Record) -> bool:
    """Whether a record's response, or one of a chat's assistant turns, is empty."""
    if isinstance(item, Chat):
        return any(m["role"] == ASSISTANT and not m["content"] for m in item.messages)
    return not item[1]


def warn_empty(counts: Counts) -> None:
    """One warning for all the records with an empty response (they are kept: see docs/training.md)."""
    if counts.empty:
        log.warning("instruction data: %d of %d records have an empty response (or an empty assistant turn): they "
                    "are trained on, only the end of the document scored (teaching the model to stop at once); "
                    "remove them from the source if that is not meant", counts.empty, counts.records)


def _cut(item: Record, chars: int) -> Record:
    if not isinstance(item, Chat):
        prompt, response = item
        if len(prompt) + len(response) <= chars:
            return item
        return prompt[:chars], response[:max(chars - len(prompt), 0)]
    messages: list[dict[str, Any]] = []
    left = chars
    for message in item.messages:
        if left <= 0:
            break
        content = message["content"]
        messages.append(message if len(content) <= left else {**message, "content": content[:left]})
        left -= len(content)
    if len(messages) == len(item.messages) and left >= 0:
        return item
    return Chat(tuple(messages), item.where)


def no_template(chat: Chat, tokenizer: str) -> DataError:
    """The error of a chat record with a tokenizer that has no chat template (byte, BPE)."""
    return DataError(f"{chat.where}: a chat record ({MESSAGES!r}) is rendered by the chat template of a Hugging Face "
                     f"tokenizer; the {tokenizer!r} tokenizer has none: set data.tokenizer: hf (and "
                     f"data.tokenizer_path, a directory with tokenizer.json and its chat template)")


# ------------------------------------------------------------------------------------------------ documents


@dataclass(frozen=True)
class Encoder:
    """A tokenizer as instruction data uses it."""

    encode: Callable[[list[str]], list[np.ndarray]]
    """Texts -> their ids, no special tokens."""
    start: list[int] = field(default_factory=list)
    """What goes before a document (a Hugging Face tokenizer's BOS)."""
    end: list[int] = field(default_factory=list)
    """What ends a document (its EOS, the BPE's end-of-text)."""
    pad: int = 0
    """The id of padding (never scored)."""
    name: str = "byte"
    """The tokenizer (data.tokenizer), for errors."""
    render: Callable[[Sequence[dict[str, Any]], bool], str] | None = None
    """(messages, add_generation_prompt) -> the chat template's text; None: no template (byte, BPE)."""
    encode_offsets: Callable[[list[str]], list[tuple[np.ndarray, np.ndarray]]] | None = None
    """Texts -> their ids, no special tokens, and each token's [start, end) characters (with `render`)."""


def encoder_of(tok: data_lib.Tokenizer) -> Encoder:
    if isinstance(tok, data_lib.ByteTokenizer):
        return Encoder(lambda texts: [tok.encode(t) for t in texts])
    if isinstance(tok, HfTokenizer):
        pad = next((i for i in (tok.pad_id, tok.eos_id) if i is not None), 0)
        return Encoder(tok.encode_batch, tok.document_start, tok.document_end, pad, "hf", tok.render_chat,
                       tok.encode_offsets)
    end = [] if tok.eot_id is None else [tok.eot_id]
    return Encoder(tok.encode_batch, [], end, end[0] if end else 0, "bpe")


def documents(items: Iterable[Record], enc: Encoder) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, which of them are scored) of each record's document, in order."""
    batch: list[Record] = []

    def flush() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        pairs = iter(pair_documents([r for r in batch if not isinstance(r, Chat)], enc))
        chats = iter(chat_documents([r for r in batch if isinstance(r, Chat)], enc))
        for r in batch:
            yield next(chats if isinstance(r, Chat) else pairs)
        batch.clear()

    for item in items:
        batch.append(item)
        if len(batch) >= _BATCH:
            yield from flush()
    if batch:
        yield from flush()


def pair_documents(pairs: list[tuple[str, str]], enc: Encoder) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prompt/response documents: [start, prompt + response as one text, end], scored from the response on."""
    if not pairs:
        return []
    out = []
    for ids, prompt in zip(enc.encode([p + r for p, r in pairs]), enc.encode([p for p, _ in pairs])):
        doc = np.concatenate([np.asarray(enc.start, np.int64), ids.astype(np.int64), np.asarray(enc.end, np.int64)])
        out.append((doc, np.arange(doc.size) >= len(enc.start) + _common_prefix(ids, prompt)))
    return out


def chat_documents(chats: list[Chat], enc: Encoder) -> list[tuple[np.ndarray, np.ndarray]]:
    """Chat documents: the template's rendering encoded, scored where the assistant's turns are."""
    if not chats:
        return []
    if enc.render is None or enc.encode_offsets is None:
        raise no_template(chats[0], enc.name)
    rendered = []
    for chat in chats:
        try:
            rendered.append(assistant_spans(chat.messages, enc.render))
        except ConfigError as e:  # no template, or the template refuses this conversation
            raise DataError(f"{chat.where}: {e}") from None
    encoded = enc.encode_offsets([text for text, _ in rendered])
    return [(ids.astype(np.int64), overlapping(offsets, spans))
            for (_, spans), (ids, offsets) in zip(rendered, encoded)]


def assistant_spans(messages: Sequence[dict[str, Any]],
                    render: Callable[[Sequence[dict[str, Any]], bool], str]) -> tuple[str, list[tuple[int, int]]]:
    """A conversation's rendering and the [start, end) characters of each assistant turn in it: from where
    messages[:k] with the prompt for a reply stops matching the rendering, to where messages[:k+1] stops."""
    text = render(messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] == ASSISTANT:
            start = _shared_chars(text, render(messages[:k], True))
            end = _shared_chars(text, render(messages[:k + 1], False))
            if end > start:
                spans.append((start, end))
    return text, spans


def _shared_chars(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each token ([start, end) characters, one row each) overlaps one of the spans."""
    out = np.zeros(len(offsets), bool)
    for start, end in spans:
        out |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def marked(ids: np.ndarray, scored: np.ndarray) -> np.ndarray:
    """A document's tokens with their marks: those of `scored` but its first token scored, its start marked."""
    at = np.arange(ids.size)
    return token_marks.mark(ids, scored & (at > 0), at == 0)


def padding(n: int, pad: int) -> np.ndarray:
    """n padding tokens: never scored, a document of their own (so nothing after a document attends to it)."""
    return token_marks.mark(np.full(n, pad, np.int64), np.zeros(n, bool), np.arange(n) == 0)


def _fitted(docs: Iterable[tuple[np.ndarray, np.ndarray]], row_tokens: int, counts: Counts) -> Iterator[np.ndarray]:
    """Each document marked and cut to a row; those left without a scored token (past the first) dropped."""
    for ids, scored in docs:
        counts.records += 1
        if ids.size > row_tokens:
            counts.truncated += 1
            ids, scored = ids[:row_tokens], scored[:row_tokens]
        if not scored[1:].any():
            counts.dropped += 1
            continue
        yield marked(ids, scored)


def padded_rows(docs: Iterable[tuple[np.ndarray, np.ndarray]], row_tokens: int, pad: int,
                counts: Counts) -> Iterator[np.ndarray]:
    """One document per row, padded to row_tokens."""
    for doc in _fitted(docs, row_tokens, counts):
        yield np.concatenate([doc, padding(row_tokens - doc.size, pad)])


def packed_rows(docs: Iterable[tuple[np.ndarray, np.ndarray]], row_tokens: int, pad: int,
                counts: Counts) -> Iterator[np.ndarray]:
    """Documents end to end in rows of row_tokens; one that does not fit what is left starts the next row."""
    row: list[np.ndarray] = []
    fill = 0
    for doc in _fitted(docs, row_tokens, counts):
        if fill + doc.size > row_tokens:
            yield np.concatenate(row + [padding(row_tokens - fill, pad)])
            row, fill = [], 0
        row.append(doc)
        fill += doc.size
    if row:
        yield np.concatenate(row + [padding(row_tokens - fill, pad)])


# ------------------------------------------------------------------------------------------------ preparing


def spec(files: list[Path], rows: Rows, tokenizer: str, vocab_size: int, val_fraction: float | None,
         tokenizer_path: Path | None) -> dict[str, Any]:
    """What prepared instruction data depends on: the files (paths, sizes, mtimes), the tokenizer (and its chat
    template), the keys, the row length and packing."""
    hf = tokenizer == "hf"
    return {"format": "instruction", "tokenizer": tokenizer, "vocab_size": vocab_size if tokenizer == "bpe" else None,
            "fingerprint": data_lib.files_fingerprint(files), "prompt_key": rows.prompt_key,
            "response_key": rows.response_key, "row_tokens": rows.row_tokens, "pack": rows.pack,
            "val_fraction": val_fraction,
            "tokenizer_sha256": fingerprint(data_lib.hf_path(tokenizer_path)) if hf else None,
            # Absent from specs written before chat records were read: None there, like a tokenizer without one.
            "chat_template_sha256": chat_template_fingerprint(data_lib.hf_path(tokenizer_path)) if hf else None}


def _tokenizer(tokenizer: str, tmp: Path, files: list[Path], rows: Rows, vocab_size: int,
               tokenizer_path: Path | None) -> data_lib.Tokenizer:
    """The tokenizer to prepare with; its files saved in tmp (the BPE is trained on the records' texts)."""
    if tokenizer == "byte":
        return data_lib.ByteTokenizer()
    if tokenizer == "bpe":
        bpe = data_lib.BpeTokenizer.train_from_texts(_texts(records(files, rows), tokenizer), vocab_size)
        bpe.save(tmp / data_lib.TOKENIZER_FILE)
        return bpe
    if tokenizer != "hf":
        raise DataError(f"unknown tokenizer {tokenizer!r}: expected 'byte', 'bpe' or 'hf'")
    hf = HfTokenizer.load(data_lib.hf_path(tokenizer_path))
    copy_files(data_lib.hf_path(tokenizer_path), tmp)
    return hf


def prepare(files: list[Path], out_dir: Path, rows: Rows, *, tokenizer: str = "byte", vocab_size: int = 256,
            val_fraction: float = 0.0, tokenizer_path: Path | None = None,
            shard_tokens: int = 16 * 2**20) -> dict[str, Any]:
    """Tokenize the records of `files` into rows under out_dir (replaced atomically); returns the meta dict."""
    if rows.row_tokens < 2 or not 0.0 <= val_fraction < 1.0:
        raise DataError(f"bad instruction data arguments: row_tokens={rows.row_tokens} (>= 2), "
                        f"val_fraction={val_fraction} (in [0, 1))")
    if not files:
        raise DataError("no source files to prepare")
    want = spec(files, rows, tokenizer, vocab_size, val_fraction, tokenizer_path)

    def build(tmp: Path) -> dict[str, Any]:
        tok = _tokenizer(tokenizer, tmp, files, rows, vocab_size, tokenizer_path)
        enc, counts = encoder_of(tok), Counts()
        make_rows = packed_rows if rows.pack else padded_rows
        dtype = data_lib.DTYPES[SHARD_DTYPE]
        writer = data_lib.ShardWriter(tmp, "train", shard_tokens, dtype)
        cut = bounded(records(files, rows), text_bound(rows.row_tokens, token_chars(tok)), counts)
        for row in make_rows(documents(cut, enc), rows.row_tokens, enc.pad, counts):
            counts.rows += 1
            counts.scored_tokens += int(np.sum(token_marks.scored(row[1:])))
            writer.append(row)
        train = writer.close()
        warn_empty(counts)
        if counts.rows == 0:
            raise DataError(f"the {len(files)} source file(s) (first: {files[0]}) give no row with a response "
                            f"token: {counts.records} records, {counts.dropped} dropped for a prompt (or a chat's "
                            f"turns before the assistant's) as long as a row of model.seq_len+1={rows.row_tokens} "
                            f"tokens")
        n_val = int(round(counts.rows * val_fraction))
        if n_val >= counts.rows:
            raise DataError(f"val_fraction={val_fraction} leaves no training rows out of {counts.rows}")
        if n_val:
            train, val = data_lib.split_tail(tmp, train, n_val * rows.row_tokens, shard_tokens, dtype)
        else:
            val = []
        meta = data_lib.base_meta(tokenizer, tok.vocab_size, train, val)
        meta.update(dtype=SHARD_DTYPE, sources=len(files), spec=want, content=sources_content(files),
                    tokenizer_file=None if tokenizer == "byte" else data_lib.TOKENIZER_FILE,
                    instruction={"row_tokens": rows.row_tokens, "pack": rows.pack, **vars(counts)})
        if isinstance(tok, HfTokenizer):  # what a copy without config.json still needs (data.load_tokenizer)
            meta.update(tokenizer_path=str(Path(tokenizer_path).absolute()), special_tokens=tok.special_tokens)
        log.info("instruction data: %d records -> %d rows of %d tokens (%s), %d cut before tokenization, %d "
                 "truncated, %d dropped, %d with an empty response, %d scored tokens", counts.records, counts.rows,
                 rows.row_tokens, "packed" if rows.pack else "padded", counts.cut, counts.truncated,
                 counts.dropped, counts.empty, counts.scored_tokens)
        return meta

    return data_lib.publish(Path(out_dir), build)


def ensure_prepared(data_dir: Path, source: str, rows: Rows, *, tokenizer: str = "byte", vocab_size: int = 256,
                    val_fraction: float | None = None, tokenizer_path: Path | None = None) -> dict[str, Any]:
    """Reuse data_dir if it was prepared from the same records, tokenizer, keys, row length and packing; else
    prepare it (once per host group: a file lock). val_fraction None accepts whatever split exists."""
    files = resolve_sources(source)
    want = spec(files, rows, tokenizer, vocab_size, val_fraction, tokenizer_path)
    return data_lib.reuse_or_prepare(Path(data_dir), want, lambda: prepare(
        files, Path(data_dir), rows, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction or 0.0,
        tokenizer_path=tokenizer_path))

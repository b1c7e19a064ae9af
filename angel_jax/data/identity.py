"""What a run trains on, by content: the identity a checkpoint records and a resume compares.

    content = sources_content(files)           # while preparing: meta.json's "content"
    ident = identity_of(data_dir, meta, files) # {"tokenizer", "chat_template", "data", "files"} of prepared data
    changes(saved, ident)                      # what differs, one phrase each (empty: the same run)

A prepared directory is reused while its sources keep their paths, sizes and mtimes (shards.files_fingerprint:
nothing is read), so a source replaced by another of the same size is prepared again, and a resume would train the
checkpoint's model on it with nothing noticing (the iterator checks only the number of windows). Its content is
what counts: `content` is the sha256 of each source file's bytes, computed once while preparing (the files are
being read anyway; hashing costs far less than tokenizing), and of their digests in order (the same files under
another path are the same data; a touched file is too). The tokenizer is named by what decides its ids: the
Hugging Face tokenizer's fingerprint (tokenizer.json and its special tokens), the sha256 of the trained BPE's file,
or the tokenizer's name (the byte tokenizer has no file).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

NAMED_FILES = 64
"""Sources named one by one (in meta.json and in each checkpoint) up to this many; a corpus of more (the standard
library: thousands of files) is named by its combined digest alone."""
SHORT = 12
"""Hex digits of a digest a message shows."""


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sources_content(files: Iterable[Path]) -> dict[str, Any]:
    """{"sha256": the digest of every file's sha256 in order, "files": path -> sha256 (None past NAMED_FILES)}."""
    digests = [(str(Path(p).absolute()), file_sha256(Path(p))) for p in files]
    return _content(digests, hashlib.sha256("".join(d for _, d in digests).encode()).hexdigest())


def tokens_content(tokens: np.ndarray) -> dict[str, Any]:
    """The content of data written from tokens in memory (shards.write_tokens): their bytes' sha256."""
    return _content([], hashlib.sha256(np.ascontiguousarray(tokens).tobytes()).hexdigest())


def _content(digests: list[tuple[str, str]], combined: str) -> dict[str, Any]:
    return {"sha256": combined, "files": dict(digests) if len(digests) <= NAMED_FILES else None}


def identity_of(data_dir: Path, meta: dict[str, Any], sources: Callable[[], list[Path]] | None = None
                ) -> dict[str, Any]:
    """The identity of prepared data (its meta.json `meta`): the tokenizer, the chat template (instruction data
    with a Hugging Face tokenizer) and the sources' content. Data prepared before meta.json recorded its content
    has it computed from `sources` (the files it was prepared from: the directory is reused only while they are
    unchanged), or None without them."""
    spec = meta.get("spec") or {}
    content = meta.get("content") or (sources_content(sources()) if sources is not None else {})
    return {"tokenizer": tokenizer_identity(data_dir, meta), "chat_template": spec.get("chat_template_sha256"),
            "data": content.get("sha256"), "files": content.get("files")}


def tokenizer_identity(data_dir: Path, meta: dict[str, Any]) -> str:
    """'<name>' (byte, raw) or '<name>:<sha256>' (the Hugging Face fingerprint, the BPE file's digest)."""
    name = meta.get("tokenizer", "byte")
    if fp := (meta.get("spec") or {}).get("tokenizer_sha256"):
        return f"{name}:{fp}"
    file = meta.get("tokenizer_file")
    if file and (Path(data_dir) / file).is_file():
        return f"{name}:{file_sha256(Path(data_dir) / file)}"
    return name


def changes(saved: dict[str, Any], now: dict[str, Any], *, tokenizer_key: str, source_key: str) -> list[str]:
    """What differs between a checkpoint's identity and this run's, one phrase each naming the tokenizer or the
    files and both fingerprints; a field either side lacks (recorded before it existed) is not compared."""
    found = []
    if _differ(saved, now, "tokenizer"):
        found.append(f"the tokenizer ({tokenizer_key}) is another: {_short(saved['tokenizer'])} in the checkpoint, "
                     f"{_short(now['tokenizer'])} now")
    if _differ(saved, now, "chat_template"):
        found.append(f"the chat template ({tokenizer_key}) is another: sha256 {saved['chat_template'][:SHORT]} in "
                     f"the checkpoint, {now['chat_template'][:SHORT]} now")
    if _differ(saved, now, "data"):
        found.append(f"the training data's content ({source_key}) is another: {_files_changed(saved, now)}")
    return found


def _differ(saved: dict[str, Any], now: dict[str, Any], key: str) -> bool:
    return saved.get(key) is not None and now.get(key) is not None and saved[key] != now[key]


def _short(tokenizer: str) -> str:
    name, _, digest = tokenizer.partition(":")
    return f"{name} sha256 {digest[:SHORT]}" if digest else name


def _files_changed(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The files whose content differs (or that came or went), with their digests; the combined digests when
    either side names no files."""
    old, new = saved.get("files"), now.get("files")
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"sha256 {saved['data'][:SHORT]} in the checkpoint, {now['data'][:SHORT]} now"
    parts = [f"{p} sha256 {old[p][:SHORT]} in the checkpoint, {new[p][:SHORT]} now"
             for p in new if p in old and old[p] != new[p]]
    parts += [f"{p} is new" for p in new if p not in old] + [f"{p} is gone" for p in old if p not in new]
    return "; ".join(parts) or (f"the same files in another order (sha256 {saved['data'][:SHORT]} in the "
                                f"checkpoint, {now['data'][:SHORT]} now)")

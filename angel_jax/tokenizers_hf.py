"""A Hugging Face checkpoint's tokenizer: its tokenizer.json, read with the `tokenizers` library.

    directory, key = tokenizer_dir(cfg)              # data.tokenizer_path, else model.init_from (data.tokenizer: hf)
    tok = HfTokenizer.load(directory, key)           # ConfigError naming `key` when it cannot be read
    tok = load_for(cfg)                              # and refused, naming both numbers, when it has more ids than
                                                     # model.vocab_size
    tok.encode_text(text, add_special_tokens=True)   # transformers' `tokenizer(text)["input_ids"]`
    tok.encode(prompt)                               # a document's start: the checkpoint's BOS (if any), the text
    fingerprint(directory)                           # what prepared data made with this tokenizer depends on

The ids are tokenizer.json's: its normalizer, pre-tokenizer, model and post-processor, which is what transformers'
fast tokenizers run. What the post-processor puts around a text (Llama's `<s>`, nothing for GPT-2) is found by
encoding a probe with and without special tokens, so a document in the data stream is exactly
`tokenizer(text)["input_ids"]` followed by the EOS token (when the template did not already end with it). The
special tokens are named as transformers reads them: special_tokens_map.json, then tokenizer_config.json (a token
is a string or an AddedToken dict), then config.json's `bos_token_id` / `eos_token_id` / `pad_token_id` (the first
of a list), since many checkpoints (GPT-2's among them) name them only there.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from angel_jax.config import Config, ConfigError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")
"""What a checkpoint's tokenizer is made of (the last two optional): copied into prepared data and exports."""
SPECIAL = ("bos", "eos", "pad")
"""The special tokens read: `<name>_token` in the tokenizer files, `<name>_token_id` in config.json."""
_PROBES = ("a", "0", " ", ".")  # texts to find the template with: one of them encodes to at least one id


def tokenizer_dir(cfg: Config) -> tuple[Path, str]:
    """The directory of the run's Hugging Face tokenizer and the config key that named it."""
    if cfg.data.tokenizer_path:
        return Path(cfg.data.tokenizer_path), "data.tokenizer_path"
    if cfg.model.init_from:
        return Path(cfg.model.init_from), "model.init_from"
    raise ConfigError("'data.tokenizer'='hf' needs a directory with tokenizer.json: set data.tokenizer_path "
                      "(or model.init_from, whose directory is used when data.tokenizer_path is empty)")


def _read_json(path: Path, key: str) -> dict[str, Any]:
    """A JSON object file ({} when it does not exist: every file but tokenizer.json is optional)."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} ({key}): not a readable JSON file: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} ({key}): expected a JSON object, got {type(raw).__name__}")
    return raw


def _token_text(value: Any) -> str | None:
    # transformers writes a special token as its text or as an AddedToken dict ({"content": ..., "lstrip": ...}).
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def special_tokens(directory: Path, key: str) -> dict[str, str | int | None]:
    """Each of SPECIAL as its token text (from the tokenizer files) or id (from config.json), or None."""
    directory = Path(directory)
    files = [_read_json(directory / name, key) for name in ("special_tokens_map.json", "tokenizer_config.json")]
    model = _read_json(directory / "config.json", key)
    out: dict[str, str | int | None] = {}
    for name in SPECIAL:
        text = next((t for f in files if (t := _token_text(f.get(f"{name}_token"))) is not None), None)
        ids = model.get(f"{name}_token_id")
        ids = ids[0] if isinstance(ids, list) and ids else ids
        out[name] = text if text is not None else ids if type(ids) is int else None
    return out


def _tokenizer_file(directory: Path, key: str) -> Path:
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        what = "no such directory" if not Path(directory).is_dir() else f"no {TOKENIZER_FILE}"
        raise ConfigError(f"{directory} ({key}): {what}; a Hugging Face tokenizer (data.tokenizer: hf) is a "
                          f"directory with {TOKENIZER_FILE}")
    return path


def fingerprint(directory: Path, key: str = "data.tokenizer_path") -> str:
    """sha256 of tokenizer.json's bytes and the special tokens named beside it: prepared data depends on both."""
    h = hashlib.sha256(_tokenizer_file(directory, key).read_bytes())
    h.update(json.dumps(special_tokens(directory, key), sort_keys=True).encode())
    return h.hexdigest()


def _import_tokenizers() -> Any:
    import tokenizers  # a core dependency; imported here so that configs and the CLI's help stay instant

    return tokenizers


class HfTokenizer:
    """A Hugging Face tokenizer.json with the checkpoint's special tokens; the data pipeline's `hf` tokenizer."""

    name = "hf"

    def __init__(self, tok: Any, specials: dict[str, str | int | None], where: str) -> None:
        self._tok = tok
        self.where = where  # the file and config key, for error messages
        self.special_tokens = dict(specials)  # as the files name them (texts, or config.json's ids)
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # ids may have gaps: the largest one counts
        ids = {name: self._id(name, value) for name, value in specials.items()}
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        self.eot_id = self.eos_id  # what ends a document in the data and a sample
        self.prefix, self.suffix = self._template()

    def _id(self, name: str, value: str | int | None) -> int | None:
        if value is None:
            return None
        found = self._tok.token_to_id(value) if isinstance(value, str) else value
        if found is None or not 0 <= found < self.vocab_size:
            raise ConfigError(f"{self.where}: the {name} token {value!r} is not in the tokenizer's vocabulary of "
                              f"{self.vocab_size} ids")
        return int(found)

    def _template(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a single text."""
        for probe in _PROBES:
            bare = self._tok.encode(probe, add_special_tokens=False).ids
            if bare:
                break
        full = self._tok.encode(probe, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return full[:start], full[start + len(bare):]
        raise ConfigError(f"{self.where}: the tokenizer's post-processor does more than add tokens around a text "
                          f"({probe!r} -> {bare} alone, {full} with special tokens): not supported")

    @classmethod
    def load(cls, directory: Path, key: str = "data.tokenizer_path",
             specials: dict[str, str | int | None] | None = None) -> HfTokenizer:
        """The tokenizer in `directory` (tokenizer.json and the files beside it); `key` names where the directory
        came from (a config key). `specials` replaces the special tokens read beside it (a copy's, recorded)."""
        path = _tokenizer_file(directory, key)
        try:
            tok = _import_tokenizers().Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            raise ConfigError(f"{path} ({key}): not a tokenizer the `tokenizers` library reads: {e}") from None
        specials = special_tokens(directory, key) if specials is None else {n: specials.get(n) for n in SPECIAL}
        return cls(tok, specials, f"{path} ({key})")

    # ------------------------------------------------------------------------------------------ encoding

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """transformers' `tokenizer(text, add_special_tokens=...)["input_ids"]`."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode(self, text: str) -> np.ndarray:
        """A prompt: the ids a document of the training data starts with (the template's BOS, then the text's)."""
        return self._array(self.prefix + self.encode_text(text, add_special_tokens=False))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The texts' ids without special tokens (pieces of documents; `document_start` / `document_end` go
        around each document)."""
        return [self._array(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    @property
    def document_start(self) -> list[int]:
        """What the template puts before a document's text."""
        return list(self.prefix)

    @property
    def document_end(self) -> list[int]:
        """What follows a document's text: the template's suffix, then the EOS token unless it already ends so."""
        end = list(self.suffix)
        if self.eos_id is not None and end[-1:] != [self.eos_id]:
            end.append(self.eos_id)
        return end

    def _array(self, ids: Sequence[int]) -> np.ndarray:
        return np.asarray(ids, dtype=np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    # ------------------------------------------------------------------------------------------ decoding

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of `ids`, special tokens shown (as transformers' `decode` does by default)."""
        return self._tok.decode([int(i) for i in np.asarray(ids).ravel()], skip_special_tokens=False)

    def decode_after(self, prompt: Sequence[int]) -> Callable[[Sequence[int]], str]:
        """A decoder of the ids that follow `prompt`: the text they add to it. Decoded alone, a continuation can
        lose a character its context gives it (a SentencePiece decoder strips the leading space of a text)."""
        prompt = [int(i) for i in prompt]
        head = self.decode(prompt)

        def decode(ids: Sequence[int]) -> str:
            text = self.decode(prompt + [int(i) for i in ids])
            return text[len(head):] if text.startswith(head) else self.decode(ids)

        return decode

    def special_ids(self) -> dict[str, int]:
        """config.json's special token keys with this tokenizer's ids (those it has)."""
        ids = {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id}
        return {k: v for k, v in ids.items() if v is not None}


def check_fits(tok: HfTokenizer, vocab_size: int, key: str) -> None:
    """Refuse a tokenizer with more ids than the model embeds, naming both numbers."""
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"'model.vocab_size'={vocab_size} is smaller than the vocabulary of the Hugging Face "
                          f"tokenizer in {tok.where}: {tok.vocab_size} ids; the model would meet ids it has no "
                          f"embedding for (a model.vocab_size of at least {tok.vocab_size}, or another "
                          f"tokenizer: {key})")


def load_for(cfg: Config) -> HfTokenizer:
    """The run's tokenizer (data.tokenizer: hf), refused when it has more ids than model.vocab_size."""
    directory, key = tokenizer_dir(cfg)
    tok = HfTokenizer.load(directory, key)
    check_fits(tok, cfg.model.vocab_size, key)
    return tok


def copy_files(directory: Path, out_dir: Path, key: str = "data.tokenizer_path") -> list[str]:
    """Copy the tokenizer's files (TOKENIZER_FILES, those present) from `directory` into `out_dir`, where those it
    lacks are removed (an earlier tokenizer's special_tokens_map.json would contradict this one); their names."""
    _tokenizer_file(directory, key)
    names = [n for n in TOKENIZER_FILES if (Path(directory) / n).is_file()]
    for name in TOKENIZER_FILES:
        target = Path(out_dir) / name
        if name in names:
            target.write_bytes((Path(directory) / name).read_bytes())
        elif target.is_file():
            target.unlink()
    return names

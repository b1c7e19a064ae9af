"""A Hugging Face checkpoint's tokenizer: its tokenizer.json, read with the `tokenizers` library.

    directory, key = tokenizer_dir(cfg)              # data.tokenizer_path, else model.init_from (data.tokenizer: hf)
    tok = HfTokenizer.load(directory, key)           # ConfigError naming `key` when it cannot be read
    tok = load_for(cfg)                              # and refused, naming both numbers, when it has more ids than
                                                     # model.vocab_size
    tok.encode_text(text, add_special_tokens=True)   # transformers' `tokenizer(text)["input_ids"]`
    tok.encode(prompt)                               # a document's start: the checkpoint's BOS (if any), the text
    tok.render_chat(messages)                        # transformers' `apply_chat_template(messages, tokenize=False)`
    fingerprint(directory)                           # what prepared data made with this tokenizer depends on

The ids are tokenizer.json's: its normalizer, pre-tokenizer, model and post-processor, which is what transformers'
fast tokenizers run. What the post-processor puts around a text (Llama's `<s>`, nothing for GPT-2) is found by
encoding a probe with and without special tokens, so a document in the data stream is exactly
`tokenizer(text)["input_ids"]` followed by the EOS token (when the template did not already end with it). The
special tokens are named as transformers reads them: special_tokens_map.json, then tokenizer_config.json (a token
is a string or an AddedToken dict), then config.json's `bos_token_id` / `eos_token_id` / `pad_token_id` (the first
of a list), since many checkpoints (GPT-2's among them) name them only there.

The chat template is the checkpoint's Jinja template of a conversation: chat_template.jinja beside tokenizer.json
(where transformers 5 saves it), else tokenizer_config.json's `chat_template` (transformers 4.x). It is rendered
as transformers renders it (a sandboxed environment, since templates come with downloaded checkpoints; the
special tokens' texts as variables), and a rendering is encoded without special tokens, as `apply_chat_template`
encodes it: the template writes the BOS itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from angel_jax.config import Config, ConfigError

TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", CHAT_TEMPLATE_FILE)
"""What a checkpoint's tokenizer is made of (all but the first optional): copied into prepared data and exports."""
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


def chat_template(directory: Path, key: str = "data.tokenizer_path") -> tuple[str, str] | None:
    """The tokenizer's chat template and where it was read, or None: chat_template.jinja beside tokenizer.json (which
    transformers reads first), else tokenizer_config.json's `chat_template` (a text, or a list of named templates of
    which transformers uses 'default')."""
    path = Path(directory) / CHAT_TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} ({key}): not a readable UTF-8 file: {e}") from None
    config = Path(directory) / "tokenizer_config.json"
    value = _read_json(config, key).get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{config} ({key}): 'chat_template' is a {type(value).__name__}, not a template text")
    return value, f"{config}'s chat_template"


def chat_template_fingerprint(directory: Path, key: str = "data.tokenizer_path") -> str | None:
    """sha256 of the chat template's text (None without one): prepared chat records depend on it."""
    found = chat_template(directory, key)
    return None if found is None else hashlib.sha256(found[0].encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str) -> Any:
    """A chat template compiled as transformers compiles it: sandboxed (a template is code that comes with a
    download), trim_blocks and lstrip_blocks, loop controls, `{% generation %}` blocks rendered as their body (they
    only mark the assistant's text for transformers), and its globals raise_exception and strftime_now and its
    tojson filter (which does not escape HTML)."""
    import datetime

    import jinja2  # a core dependency; imported here so that configs and the CLI's help stay instant
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
        """The sandbox, and `*` / `**` held to results of a bounded size: `'A' * 4000000000` would allocate 4 GB
        (jinja2's sandbox bounds `range`, not repetition)."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_size(operator, left, right)
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


MAX_TEMPLATE_ITEMS = 2**24
"""The most characters or items a chat template's `*` may repeat a text or a list to (and bits of a `**` result)."""


def _check_size(operator: str, left: Any, right: Any) -> None:
    """SecurityError (a refusal the sandbox reports) for a `*` or `**` whose result would be too large."""
    import jinja2.exceptions

    if operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_ITEMS:
            raise jinja2.exceptions.SecurityError(f"a repetition to {len(seq) * n:,} items (at most "
                                                  f"{MAX_TEMPLATE_ITEMS:,})")
    elif isinstance(left, int) and isinstance(right, int) and right > 0 \
            and abs(left).bit_length() * right > MAX_TEMPLATE_ITEMS:
        raise jinja2.exceptions.SecurityError(f"a power of about {abs(left).bit_length() * right:,} bits (at most "
                                              f"{MAX_TEMPLATE_ITEMS:,})")


def _import_tokenizers() -> Any:
    import tokenizers  # a core dependency; imported here so that configs and the CLI's help stay instant

    return tokenizers


class HfTokenizer:
    """A Hugging Face tokenizer.json with the checkpoint's special tokens; the data pipeline's `hf` tokenizer."""

    name = "hf"

    def __init__(self, tok: Any, specials: dict[str, str | int | None], where: str,
                 template: tuple[str, str] | None = None, directory: str = "") -> None:
        self._tok = tok
        self.where = where  # the file and config key, for error messages
        self.template = template  # the chat template's text and where it was read, or None
        self.directory = directory  # the tokenizer's directory and config key, for error messages
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
        return cls(tok, specials, f"{path} ({key})", chat_template(directory, key), f"{directory} ({key})")

    def vocabulary(self) -> list[str]:
        """Every token's text as the vocabulary names it (added tokens too)."""
        return list(self._tok.get_vocab(with_added_tokens=True))

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

    def encode_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The texts' ids without special tokens, each with its token's [start, end) characters in its text."""
        return [(self._array(e.ids), np.asarray(e.offsets, np.int64).reshape(-1, 2))
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """A conversation rendered by the chat template (with the template's prompt for a reply after it when
        add_generation_prompt); ConfigError naming the directory without a template, or the template that fails."""
        if self.template is None:
            raise ConfigError(f"{self.directory} has no chat template (neither {CHAT_TEMPLATE_FILE} nor a "
                              "'chat_template' in tokenizer_config.json) to render chat records ('messages') with")
        source, where = self.template
        import jinja2

        try:
            return _compiled_template(source).render(messages=list(messages),
                                                     add_generation_prompt=add_generation_prompt,
                                                     **self._template_tokens())
        except jinja2.TemplateError as e:  # raise_exception(...), a syntax error, a sandbox refusal
            raise ConfigError(f"the chat template ({where}): {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, ArithmeticError, LookupError, AttributeError, RecursionError,
                MemoryError) as e:  # what else a template's code raises: `include` with no loader, a huge range
            raise ConfigError(f"the chat template ({where}) was refused: {type(e).__name__}: {e}") from None

    def _template_tokens(self) -> dict[str, str]:
        # transformers passes its special tokens' texts (bos_token, ...); config.json names some only by id.
        out = {}
        for name, value in self.special_tokens.items():
            text = self._tok.id_to_token(value) if isinstance(value, int) else value
            if text is not None:
                out[f"{name}_token"] = text
        return out

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

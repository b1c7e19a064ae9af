"""Binary files named as plain-text sources (issue 35, item 9): an ELF executable as data.source is refused with one
line naming the file, unless data.allow_binary; real UTF-8 text (non-ASCII too) and records train as before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from angel_jax.data import shards as D
from angel_jax.config import config_from_dict
from angel_jax.train.loop import _data
from conftest import tiny_config_dict

TEXT = "Grüße aus Köln: naïve café, 東京 and Ελληνικά.\n" * 200


def _elf(tmp_path: Path) -> Path:
    path = tmp_path / "true-binary"
    shutil.copyfile(shutil.which("true") or "/bin/true", path)
    assert path.read_bytes()[:4] == b"\x7fELF"
    return path


def _tokens(data_dir: Path) -> bytes:
    meta = D.load_meta(data_dir)
    return b"".join(np.fromfile(data_dir / s["file"], dtype=np.uint16).astype(np.uint8).tobytes()
                    for s in meta["shards"])


def test_an_elf_executable_is_refused_naming_the_file_unless_allowed(tmp_path):
    elf = _elf(tmp_path)
    with pytest.raises(D.DataError) as info:
        D.ensure_prepared(tmp_path / "refused", str(elf))
    message = str(info.value)
    assert str(elf) in message and "NUL byte" in message and "data.allow_binary" in message
    assert "\n" not in message and not (tmp_path / "refused").exists()
    meta = D.ensure_prepared(tmp_path / "allowed", str(elf), allow_binary=True)
    assert meta["total_tokens"] == elf.stat().st_size and _tokens(tmp_path / "allowed") == elf.read_bytes()


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_mostly_non_utf8_bytes_are_refused_and_utf8_text_is_not(tmp_path, tokenizer):
    pytest.importorskip("tokenizers") if tokenizer == "bpe" else None
    noise = tmp_path / "noise.txt"  # no NUL at all, but mostly bytes that are no UTF-8
    noise.write_bytes(bytes(0x80 + (i * 37) % 0x7F for i in range(4000)))
    with pytest.raises(D.DataError, match=r"noise\.txt: not UTF-8 text \(\d+% of its first 4,000 bytes"):
        D.prepare([noise], tmp_path / "noise", tokenizer=tokenizer, vocab_size=300)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    latin1 = tmp_path / "legacy.txt"  # an 8-bit legacy text: a few stray bytes, still text
    latin1.write_bytes("Grüße aus Köln, in ISO-8859-1.\n".encode("latin-1") * 50)
    big = tmp_path / "big.txt"  # a NUL past the first MiB is never looked for: the check is bounded
    big.write_bytes(b"text\n" * (2**20 // 5 + 1) + b"\0")
    meta = D.prepare([text, latin1, big], tmp_path / "ok", tokenizer=tokenizer, vocab_size=300)
    assert meta["sources"] == 3
    if tokenizer == "byte":
        assert _tokens(tmp_path / "ok") == text.read_bytes() + latin1.read_bytes() + big.read_bytes()


def test_records_are_not_sniffed_and_the_trainer_passes_the_flag(tmp_path):
    records = tmp_path / "docs.jsonl"
    records.write_text("".join(json.dumps({"text": TEXT[:60] + "\u0000"}) + "\n" for _ in range(50)))
    assert D.ensure_prepared(tmp_path / "records", str(records))["total_tokens"] > 0  # a NUL in a record's text

    elf = _elf(tmp_path)

    def config(**data):
        raw = tiny_config_dict((elf, tmp_path / "data"), tmp_path / "run")
        raw["data"].update(data)
        return config_from_dict(raw)

    with pytest.raises(D.DataError, match=f"{elf}: a binary file"):
        _data(config())
    iterator, _ = _data(config(allow_binary=True))
    assert iterator.vocab_size == 256

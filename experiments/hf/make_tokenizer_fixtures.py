"""A tiny Hugging Face tokenizer and the ids transformers gives for a dozen texts and three chats: the fixtures of
tests/test_hf_tokenizer.py and tests/test_chat_data.py, which check that our reading of a checkpoint's tokenizer,
and our rendering of its chat template, give transformers' ids.

This script is run with a separate Python (3.11) that has transformers, tokenizers and jinja2 (no torch); the
project's tests never need transformers. Set that environment up once, outside the repository:

    python3.11 -m venv /work/hftok
    /work/hftok/bin/pip install transformers tokenizers jinja2
    /work/hftok/bin/python experiments/hf/make_tokenizer_fixtures.py [--out tests/fixtures/hf/tokenizer]

The committed fixtures were made with transformers 5.24.0, tokenizers 0.23.3 and jinja2 3.1.6 (their versions are
also recorded in texts.json and chats.json); made again with these, every file comes out byte for byte as
committed.

It trains a byte-level BPE with `tokenizers` on a small built-in corpus (which holds every character of the test
texts: the byte-level alphabet is only the bytes the corpus has, so the whole vocabulary, special tokens included,
stays within 256 ids and fits the tiny fixture models of tests/fixtures/hf), with Llama's convention for special
tokens: `<s>` (BOS) is put before every encoded text by the post-processor, `</s>` is the EOS, `<pad>` pads. It is
wrapped as a `PreTrainedTokenizerFast` and saved with `save_pretrained` (tokenizer.json, tokenizer_config.json);
transformers 5 no longer writes special_tokens_map.json, which most published checkpoints (made with 4.x) have, so
it is written here as 4.x wrote it (each token an AddedToken dict) when `save_pretrained` did not. Then
`AutoTokenizer.from_pretrained` loads the directory back, the way a user of the checkpoint would, and texts.json
records for each text the ids it gives with and without special tokens and its decoding of them.

The tokenizer carries CHAT_TEMPLATE, a short template in the manner of Llama 3's (the BOS, then each message as a
role header, its trimmed content and an end of turn; the tokenizer has no header tokens, so the headers are plain
text), saved by `save_pretrained` (transformers 5 writes chat_template.jinja). chats.json records for each of
CHATS the rendering and ids of `apply_chat_template(messages, tokenize=True)` and the assistant mask transformers
derives from the template's `{% generation %}` blocks (`return_assistant_tokens_mask`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jinja2
import tokenizers
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 250
SPECIALS = ["<s>", "</s>", "<pad>"]  # ids 0, 1, 2: the trainer gives special tokens the first ids

TEXTS = [
    "Hello, world!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Café, naïve, façade, jalapeño, Ångström.",
    "emoji: 🙂 🚀 ✨ and a 👍 too",
    "tabs\tand  double  spaces,   triple   spaces\n\n\nand blank lines",
    "digits 0123456789, 3.14159 and 1,000,000",
    "  leading and trailing spaces  ",
    "UPPER lower MiXeD",
    "Straße, Œuvre, déjà vu, crème brûlée",
    "x",
    "a </s> in the text is the end-of-sequence token",
    "the quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
]
"""ASCII, accents, emoji, whitespace runs, digits, a single character, and a special token's text inside a text."""

CORPUS = TEXTS + [
    "the model reads text as tokens; a tokenizer turns text into ids and ids back into text.",
    "Numbers: 42, 7, 1999, 2024, 0.5, 100%, -3 and +8.",
    "import os\nimport sys\n\nclass Tokenizer:\n    def encode(self, text):\n        return [ord(c) for c in text]\n",
    "Voilà: él, über, señor, café, garçon, Zürich, São Paulo, Ærø.",
    "Smile 🙂, launch 🚀, sparkle ✨, thumbs up 👍.",
]
"""The training corpus: every test text (so every byte they hold is in the alphabet) and a little more."""


CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('roles are system, user and assistant, not ' + message['role']) }}
    {%- endif %}
    {{- '[' + message['role'] + ']\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{ message['content'] | trim }}{{ eos_token }}{% endgeneration %}
    {%- else %}
        {{- message['content'] | trim }}{{ eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '[assistant]\\n\\n' }}
{%- endif %}
"""
"""Llama 3's layout (header, blank line, trimmed content, end of turn) with plain-text headers; the assistant's
content and end of turn in a `{% generation %}` block, so that transformers can tell which tokens are its."""

CHATS = [
    [{"role": "user", "content": "Hello, world!"},
     {"role": "assistant", "content": "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"}],
    [{"role": "system", "content": "the model reads text as tokens."},
     {"role": "user", "content": "UPPER lower MiXeD"},
     {"role": "assistant", "content": "  Straße, Œuvre, déjà vu  "},
     {"role": "user", "content": "digits 0123456789"},
     {"role": "assistant", "content": "3.14159 and 1,000,000 🚀"}],
    [{"role": "user", "content": "emoji: 🙂 ✨"},
     {"role": "assistant", "content": "Smile 🙂, sparkle ✨ and a </s> too"},
     {"role": "user", "content": "x"}],
]
"""One turn; a system message and two turns (content to trim, digits, emoji); an end-of-turn token's text inside
an assistant's content, and a last message that is not the assistant's. Every character is in the alphabet."""


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No initial_alphabet: the 256-symbol byte alphabet alone would not leave room for merges within 256 ids.
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]),
    ])
    return tok


def write_special_tokens_map(out: Path, fast: transformers.PreTrainedTokenizerFast) -> None:
    """special_tokens_map.json as transformers 4.x's save_pretrained wrote it."""
    def added(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    tokens = {"bos_token": fast.bos_token, "eos_token": fast.eos_token, "pad_token": fast.pad_token}
    (out / "special_tokens_map.json").write_text(json.dumps({k: added(v) for k, v in tokens.items()}, indent=2) + "\n")


def dump(made_with: dict, records: list[dict]) -> str:
    """texts.json: one line per text, so a diff shows which text's ids changed."""
    lines = ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in records)
    return f'{{"made_with": {json.dumps(made_with)},\n "texts": [\n  {lines}\n ]}}\n'


def chats(tok: transformers.PreTrainedTokenizerBase) -> list[dict]:
    """Each chat's rendering, its ids and transformers' assistant mask of them."""
    out = []
    for messages in CHATS:
        text = tok.apply_chat_template(messages, tokenize=False)
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = list(enc["input_ids"])
        assert tok.decode(ids) == text, (text, tok.decode(ids))  # no character outside the alphabet
        out.append({"messages": messages, "text": text, "ids": ids, "assistant_masks": list(enc["assistant_masks"])})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "tests/fixtures/hf/tokenizer")
    out = p.parse_args().out
    tok = train()
    assert tok.get_vocab_size() <= 256, tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    if not (out / "special_tokens_map.json").exists():
        write_special_tokens_map(out, fast)
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    records = []
    for text in TEXTS:
        with_special = loaded(text)["input_ids"]
        without = loaded(text, add_special_tokens=False)["input_ids"]
        records.append({"text": text, "ids": with_special, "ids_no_special": without,
                        "decoded": loaded.decode(without), "decoded_special": loaded.decode(with_special)})
    meta = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "tokenizer_class": type(loaded).__name__, "vocab_size": len(loaded),
            "bos_token_id": loaded.bos_token_id, "eos_token_id": loaded.eos_token_id,
            "pad_token_id": loaded.pad_token_id}
    (out / "texts.json").write_text(dump(meta, records), encoding="utf-8")
    made_with = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                 "jinja2": jinja2.__version__}
    lines = ",\n  ".join(json.dumps(c, ensure_ascii=False) for c in chats(loaded))
    (out / "chats.json").write_text(f'{{"made_with": {json.dumps(made_with)},\n "chats": [\n  {lines}\n ]}}\n',
                                    encoding="utf-8")
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}; {meta}")


if __name__ == "__main__":
    main()

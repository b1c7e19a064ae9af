"""Chat records of instruction data ({"messages": [...]}): rendered by the Hugging Face tokenizer's chat template into
exactly the ids transformers' `apply_chat_template` gives, scored on exactly the tokens transformers' assistant mask
marks (tests/fixtures/hf/tokenizer/chats.json, made by experiments/hf/make_tokenizer_fixtures.py with
transformers), the template read from either file transformers reads it from, part of the prepared data's
fingerprint, and bad chats refused naming their file and line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from angel_jax.data import instructions as idata
from angel_jax.data import marks as token_marks
from angel_jax.data.sources import DataError
from angel_jax.data.hf_tokenizer import CHAT_TEMPLATE_FILE, HfTokenizer

TOKENIZER = Path(__file__).parent / "fixtures" / "hf" / "tokenizer"
RECORDED = json.loads((TOKENIZER / "chats.json").read_text(encoding="utf-8"))
CHATS = RECORDED["chats"]
ROW = 129


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _rows(out: Path, meta: dict) -> np.ndarray:
    return np.concatenate([np.fromfile(out / s["file"], "<i4") for s in meta["shards"]]).reshape(-1, ROW)


def _tokenizer_without_template(directory: Path) -> Path:
    shutil.copytree(TOKENIZER, directory)
    (directory / CHAT_TEMPLATE_FILE).unlink()
    return directory


def test_chats_render_as_transformers_and_score_the_assistant_turns(tmp_path):
    """Each recorded chat prepared in a padded row: its tokens are transformers' ids, its scored targets exactly
    the tokens of transformers' assistant mask (the content and end of each assistant turn, from the template's
    `{% generation %}` blocks: computed another way than our prefix renderings), then padding."""
    tok = HfTokenizer.load(TOKENIZER)
    assert RECORDED["made_with"]["transformers"] and all(tok.render_chat(c["messages"]) == c["text"] for c in CHATS)
    # A prompt/response record between the chats: both kinds in one file, in order.
    pair = {"prompt": "Q: up\nR:", "response": " down"}
    source = _write(tmp_path / "chats.jsonl", [{"messages": c["messages"]} for c in CHATS[:2]] + [pair] +
                    [{"messages": CHATS[2]["messages"]}])
    meta = idata.prepare([source], tmp_path / "out", idata.Rows(ROW), tokenizer="hf", tokenizer_path=TOKENIZER)
    rows = _rows(tmp_path / "out", meta)
    assert len(rows) == 4 and meta["instruction"]["dropped"] == meta["instruction"]["truncated"] == 0
    for row, chat in zip(rows[[0, 1, 3]], CHATS):
        n = len(chat["ids"])
        np.testing.assert_array_equal(token_marks.token_ids(row[:n]), chat["ids"])
        np.testing.assert_array_equal(token_marks.scored(row[:n]), np.asarray(chat["assistant_masks"], bool))
        assert set(token_marks.token_ids(row[n:]).tolist()) == {tok.pad_id} and not token_marks.scored(row[n:]).any()
        assert np.flatnonzero(token_marks.doc_starts(row)).tolist() == [0, n]
    assert tok.decode(token_marks.token_ids(rows[2])[token_marks.scored(rows[2])]) == " down</s>"
    scored = [tok.decode(np.asarray(c["ids"])[np.asarray(c["assistant_masks"], bool)]) for c in CHATS]
    assert scored[1] == "Straße, Œuvre, déjà vu</s>3.14159 and 1,000,000 🚀</s>"  # trimmed by the template
    assert scored[2] == "Smile 🙂, sparkle ✨ and a </s> too</s>"  # the last message, the user's, not scored


def test_turns_are_spans_of_characters_and_a_cut_chat_keeps_what_fits():
    """A turn is the characters of its content and end (not the header before them); a token overlapping a turn is
    scored, so one merged across its start counts. A chat cut by the row keeps the scored tokens that fit; one cut
    before any assistant text is dropped."""
    tok = HfTokenizer.load(TOKENIZER)
    enc = idata.encoder_of(tok)
    text, spans = idata.assistant_spans(CHATS[0]["messages"], tok.render_chat)
    assert text[spans[0][0]:spans[0][1]] == CHATS[0]["messages"][1]["content"].strip() + "</s>"
    offsets = np.array([[0, 2], [2, 4], [4, 6]])
    np.testing.assert_array_equal(idata.overlapping(offsets, [(3, 4)]), [False, True, False])
    docs = list(idata.documents([idata.Chat(tuple(c["messages"]), "x:1") for c in CHATS], enc))
    counts = idata.Counts()
    # Rows of 34 tokens: the assistant's text starts at token 30 of chat 0 and 28 of chat 2, past 34 in chat 1.
    rows = list(idata.padded_rows(docs, 34, enc.pad, counts))
    assert (counts.truncated, counts.dropped, len(rows)) == (3, 1, 2)
    assert [int(token_marks.scored(r).sum()) for r in rows] == [4, 6]
    np.testing.assert_array_equal(token_marks.token_ids(rows[0]), CHATS[0]["ids"][:34])


def test_the_template_is_read_as_transformers_reads_it(tmp_path):
    """chat_template.jinja (transformers 5) first; else tokenizer_config.json's chat_template, a text or a list of
    named templates (transformers 4.x)."""
    template = (TOKENIZER / CHAT_TEMPLATE_FILE).read_text()
    config = json.loads((TOKENIZER / "tokenizer_config.json").read_text())
    for value in (template, [{"name": "tool_use", "template": "{{ 1 }}"}, {"name": "default", "template": template}]):
        d = _tokenizer_without_template(tmp_path / f"t{len(value)}")
        (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": value}))
        assert HfTokenizer.load(d).render_chat(CHATS[1]["messages"]) == CHATS[1]["text"]
        (d / CHAT_TEMPLATE_FILE).write_text("{{ messages | length }}")
        assert HfTokenizer.load(d).render_chat(CHATS[1]["messages"]) == "5"
    assert HfTokenizer.load(TOKENIZER).render_chat(CHATS[0]["messages"][:1], True).endswith("</s>[assistant]\n\n")


def test_the_chat_template_is_part_of_the_fingerprint(tmp_path, monkeypatch):
    d = shutil.copytree(TOKENIZER, tmp_path / "tok")
    source = _write(tmp_path / "chats.jsonl", [{"messages": CHATS[0]["messages"]}])
    rows = idata.Rows(ROW)
    first = idata.ensure_prepared(tmp_path / "data", str(source), rows, tokenizer="hf", tokenizer_path=d)
    prepared = []
    real_prepare = idata.prepare
    monkeypatch.setattr(idata, "prepare", lambda *a, **k: prepared.append(a) or real_prepare(*a, **k))
    assert idata.ensure_prepared(tmp_path / "data", str(source), rows, tokenizer="hf", tokenizer_path=d) == first
    assert prepared == []  # the same template: the directory is reused, nothing prepared again
    (d / CHAT_TEMPLATE_FILE).write_text((TOKENIZER / CHAT_TEMPLATE_FILE).read_text().replace("\\n\\n", ":\\n"))
    again = idata.ensure_prepared(tmp_path / "data", str(source), rows, tokenizer="hf", tokenizer_path=d)
    assert len(prepared) == 1
    assert again["spec"]["chat_template_sha256"] != first["spec"]["chat_template_sha256"]
    assert again["spec"]["tokenizer_sha256"] == first["spec"]["tokenizer_sha256"]
    assert (tmp_path / "data" / CHAT_TEMPLATE_FILE).read_text() == (d / CHAT_TEMPLATE_FILE).read_text()


USER, ASSISTANT = {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "x"}


@pytest.mark.parametrize("record, problem", [
    ({"messages": "hi"}, r"'messages' is a string, not a list of messages \(objects with 'role' and 'content'\)"),
    ({"messages": []}, r"'messages' is an empty list"),
    ({"messages": [USER, "x"]}, r"messages\[1\] is a string, not an object with 'role' and 'content'"),
    ({"messages": [USER, {"content": "x"}]}, r"messages\[1\] has no 'role'; its keys: 'content'"),
    ({"messages": [USER, {"role": "assistant"}]}, r"messages\[1\] has no 'content'; its keys: 'role'"),
    ({"messages": [USER, {"role": "assistant", "content": None}]}, r"messages\[1\]'s 'content' is null, not a str"),
    ({"messages": [{"role": "system", "content": "x"}, USER]},
     r"no message with role 'assistant', whose turns the loss is on; this chat's roles: 'system', 'user'"),
    ({"messages": [{"role": "tool", "content": "x"}, ASSISTANT]},
     r"the chat template \(.*chat_template.jinja\): TemplateError: roles are system, user and assistant, not tool"),
])
def test_a_bad_chat_names_its_file_and_line(tmp_path, record, problem):
    source = _write(tmp_path / "chats.jsonl", [{"messages": [USER, ASSISTANT]}, record])
    with pytest.raises(DataError, match=rf"{source}:2: {problem}"):
        idata.prepare([source], tmp_path / "out", idata.Rows(ROW), tokenizer="hf", tokenizer_path=TOKENIZER)
    assert not (tmp_path / "out").exists()


def test_a_chat_without_a_template_is_refused_naming_what_to_set(tmp_path):
    source = _write(tmp_path / "chats.jsonl", [{"prompt": "a", "response": "b"}, {"messages": [USER, ASSISTANT]}])
    for tokenizer in ("byte", "bpe"):
        with pytest.raises(DataError, match=rf"{source}:2: a chat record \('messages'\) is rendered by the chat "
                                            rf"template of a Hugging Face tokenizer; the '{tokenizer}' tokenizer "
                                            rf"has none: set data.tokenizer: hf"):
            idata.prepare([source], tmp_path / "out", idata.Rows(ROW), tokenizer=tokenizer, vocab_size=300)
    bare = _tokenizer_without_template(tmp_path / "bare")
    with pytest.raises(DataError, match=rf"{source}:2: {bare} \(data.tokenizer_path\) has no chat template "
                                        rf"\(neither chat_template.jinja nor a 'chat_template' in "
                                        rf"tokenizer_config.json\)"):
        idata.prepare([source], tmp_path / "out", idata.Rows(ROW), tokenizer="hf", tokenizer_path=bare)
    # Prompt/response records need no template.
    only_pairs = _write(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}])
    assert idata.prepare([only_pairs], tmp_path / "out", idata.Rows(ROW), tokenizer="hf",
                         tokenizer_path=bare)["instruction"]["rows"] == 1


def test_the_template_runs_sandboxed(tmp_path):
    d = shutil.copytree(TOKENIZER, tmp_path / "tok")
    (d / CHAT_TEMPLATE_FILE).write_text("{{ messages.__class__.__mro__ }}")
    source = _write(tmp_path / "chats.jsonl", [{"messages": [USER, ASSISTANT]}])
    with pytest.raises(DataError, match=r"chats.jsonl:1: the chat template .*: SecurityError"):
        idata.prepare([source], tmp_path / "out", idata.Rows(ROW), tokenizer="hf", tokenizer_path=d)


def test_a_long_chat_is_cut_before_rendering_to_the_rows_it_gives_whole(tmp_path, monkeypatch):
    """A chat with a content longer than a row can use, and one of more messages than a row holds, are cut (the
    content to text_bound, the messages after it dropped) before the template renders them, counted as cut, and
    give the rows they gave whole; the recorded chats are untouched. A small floor scales the bound to a few KB."""
    monkeypatch.setattr(idata, "TOKEN_CHARS_FLOOR", 8)
    long = " ".join(["tea", "Ünïcode", "🙂", "words"] * 800)
    many = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}: " + "so " * 20} for i in range(60)]
    chats = [{"messages": c["messages"]} for c in CHATS] + [
        {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": long}]},
        {"messages": [{"role": "system", "content": long}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
        {"messages": many}]
    source = _write(tmp_path / "chats.jsonl", chats)
    longest: list[int] = []
    real = HfTokenizer.render_chat

    def render_chat(self, messages, add_generation_prompt=False):
        longest.append(sum(len(m["content"]) for m in messages))
        return real(self, messages, add_generation_prompt)

    monkeypatch.setattr(HfTokenizer, "render_chat", render_chat)
    meta = idata.prepare([source], tmp_path / "cut", idata.Rows(ROW), tokenizer="hf", tokenizer_path=TOKENIZER)
    bound = idata.text_bound(ROW, idata.token_chars(HfTokenizer.load(TOKENIZER)))
    assert meta["instruction"]["cut"] == 3 and max(longest) <= bound < len(long)
    monkeypatch.setattr(idata, "text_bound", lambda row_tokens, chars: 10**9)
    whole = idata.prepare([source], tmp_path / "whole", idata.Rows(ROW), tokenizer="hf", tokenizer_path=TOKENIZER)
    assert whole["instruction"]["cut"] == 0 and max(longest) > bound
    np.testing.assert_array_equal(_rows(tmp_path / "cut", meta), _rows(tmp_path / "whole", whole))
    assert meta["instruction"]["dropped"] == whole["instruction"]["dropped"] == 1  # the long system message


@pytest.mark.parametrize("template, refused", [
    ("{% include '/etc/passwd' %}", r"TypeError: no loader for this environment"),
    ("{% for i in range(10**8) %}x{% endfor %}", r"OverflowError: Range too big"),
    ("{{ 'A' * 4000000000 }}", r"SecurityError: a repetition to 4,000,000,000 items"),
    ("{{ 'A' * 4e9 }}", r"TypeError: can't multiply sequence"),
    ("{{ 7 ** 99999999 }}", r"SecurityError: a power of about"),
])
def test_a_hostile_template_is_refused_in_one_line_naming_its_file(tmp_path, capsys, template, refused):
    """A template that reads a file, loops 10**8 times or builds 4 GB is refused by `data prepare` in one line
    naming the template's file and what was refused (they gave 42-67-line tracebacks; 'A' * 4000000000 ran)."""
    from angel_jax import cli

    d = shutil.copytree(TOKENIZER, tmp_path / "tok")
    (d / CHAT_TEMPLATE_FILE).write_text(template)
    source = _write(tmp_path / "chats.jsonl", [{"messages": [USER, ASSISTANT]}])
    assert cli.main(["data", "prepare", "--format", "instruction", "--seq-len", "32", "--source", str(source),
                     "--tokenizer", "hf", "--tokenizer-path", str(d), "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(d / CHAT_TEMPLATE_FILE) in err[0], err
    assert re.search(refused, err[0]), err[0]

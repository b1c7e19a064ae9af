"""Sampling: the top-k / top-p filters on known distributions, the draw, the decode loop (determinism, greedy ==
argmax of the whole-sequence forward, the context limit, end of text, a family that cannot decode), the text
stream, the run's tokenizer, and `angel-jax sample` end to end on a trained tiny run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from angel_jax.data import shards as data_lib
from angel_jax.cli import main
from angel_jax.config import Config, ConfigError, DataConfig, ModelConfig
from angel_jax.config.sampling import SamplingOptions
from angel_jax.train.sample import Sampler, SamplingError, TextStream, filter_logits, next_token, sampling_step
from angel_jax.cli.sample import run_tokenizer
from test_decode import random_params

PROBS = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))


def _kept(filtered) -> list[int]:
    return [int(i) for i in np.flatnonzero(np.isfinite(np.asarray(filtered)))]


# ------------------------------------------------------------------------------------------------ filters


@pytest.mark.parametrize("top_k, kept", [(0, [0, 1, 2, 3, 4]), (1, [0]), (2, [0, 1]), (3, [0, 1, 2]),
                                         (9, [0, 1, 2, 3, 4])])
def test_top_k_keeps_the_k_most_likely(top_k, kept):
    filtered = filter_logits(LOGITS, top_k=top_k)
    assert _kept(filtered) == kept
    np.testing.assert_array_equal(np.asarray(filtered)[kept], np.asarray(LOGITS)[kept])  # kept logits unchanged


@pytest.mark.parametrize("top_p, kept", [(0.3, [0]), (0.5, [0]), (0.6, [0, 1]), (0.8, [0, 1, 2]),
                                         (0.9, [0, 1, 2, 3, 4]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # The tokens more likely than token i hold 0, .5, .75, .875, .9375: kept while that is below top_p. The last
    # two are tied (0.0625 each): a cut by value keeps both.
    assert _kept(filter_logits(LOGITS, top_p=top_p)) == kept


def test_top_k_then_top_p_renormalises_between_them():
    # After top-3 the distribution is 4/7, 2/7, 1/7: top_p 0.55 keeps one token (4/7 >= 0.55), where on the whole
    # distribution it keeps two (the first holds 0.5 < 0.55).
    filtered = filter_logits(LOGITS, top_k=3, top_p=0.55)
    assert _kept(filtered) == [0]
    assert _kept(filter_logits(LOGITS, top_p=0.55)) == [0, 1]
    probs = np.asarray(jax.nn.softmax(filter_logits(LOGITS, top_k=3, top_p=0.9)))
    np.testing.assert_allclose(probs, [4 / 7, 2 / 7, 1 / 7, 0, 0], rtol=1e-6)


def test_filters_work_row_by_row():
    rows = jnp.stack([LOGITS, LOGITS[::-1]])
    assert [_kept(r) for r in filter_logits(rows, top_k=2)] == [[0, 1], [3, 4]]
    assert [_kept(r) for r in filter_logits(rows, top_p=0.6)] == [[0, 1], [3, 4]]


def _frequencies(**choice) -> np.ndarray:
    keys = jax.random.split(jax.random.key(0), 20000)
    drawn = np.asarray(jax.vmap(lambda k: next_token(k, LOGITS[None], **choice)[0])(keys))
    return np.bincount(drawn, minlength=5) / len(drawn)


def test_draws_follow_the_filtered_distribution_at_the_temperature():
    np.testing.assert_allclose(_frequencies(temperature=1.0, top_p=0.8), [4 / 7, 2 / 7, 1 / 7, 0, 0], atol=0.015)
    # Temperature 2 takes the square root of the probabilities: 1/2, 1/4, ... become 4, 2*sqrt(2), 2, ... / sum.
    flat = np.sqrt(PROBS) / np.sqrt(PROBS).sum()
    np.testing.assert_allclose(_frequencies(temperature=2.0), flat, atol=0.015)
    assert int(next_token(jax.random.key(1), LOGITS[None], temperature=0.0)[0]) == 0


@pytest.mark.parametrize("option, value, flag", [
    ("max_tokens", 0, "--max-tokens"), ("temperature", -0.1, "--temperature"),
    ("temperature", float("nan"), "--temperature"), ("top_p", 0.0, "--top-p"), ("top_p", 1.5, "--top-p"),
    ("top_k", -1, "--top-k"), ("num_samples", 0, "--num-samples")])
def test_bad_options_are_refused_naming_the_flag(option, value, flag):
    with pytest.raises(ConfigError, match=f"{option} \\({flag}\\)"):
        SamplingOptions(**{option: value})


# ------------------------------------------------------------------------------------------------ the decode loop

CFG = ModelConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4, compute_dtype="float32")


@pytest.fixture(scope="module")
def model():
    """The tiny GPT with random parameters far from an initialisation, so that its distributions are not flat."""
    staged = models.get(CFG)
    return staged, random_params(staged, 3)


def _generate(model, prompt, **options):
    staged, params = model
    return Sampler(staged, params, context=CFG.seq_len, options=SamplingOptions(**options)).generate(np.asarray(prompt))


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others(model):
    prompt = [5, 9, 2]
    runs = [_generate(model, prompt, max_tokens=10, temperature=1.0, top_p=1.0, seed=s).tokens[0]
            for s in (0, 0, 1)]
    np.testing.assert_array_equal(runs[0], runs[1])
    assert runs[0].shape == (10,) and not np.array_equal(runs[0], runs[2])
    batch = _generate(model, prompt, max_tokens=10, temperature=1.0, top_p=1.0, seed=0, num_samples=3)
    assert len(batch.tokens) == 3 and len({tuple(t) for t in batch.tokens}) == 3  # drawn independently


@pytest.mark.compares_programs
def test_greedy_is_the_argmax_of_the_whole_sequence_forward_at_every_step(model):
    staged, params = model
    prompt = [7, 1, 30, 4]
    compiled = sampling_step._cache_size()
    generation = _generate(model, prompt, max_tokens=CFG.seq_len, temperature=0.0)
    tokens = generation.tokens[0]
    assert generation.stop == ["context"] and len(tokens) == CFG.seq_len - len(prompt)
    assert sampling_step._cache_size() - compiled == 2  # the prompt's length and single tokens (pos is traced)
    # The forward is causal: one pass over the prompt and every generated token gives, at each position, the
    # logits the whole-sequence forward gives for the text up to there.
    sequence = jnp.asarray([prompt + tokens.tolist()], jnp.int32)[:, :CFG.seq_len]
    logits = jax.jit(lambda p, s: staged.forward(staged.split(p), s))(params, sequence)[0]
    np.testing.assert_array_equal(np.argmax(logits[len(prompt) - 1:-1], axis=-1), tokens)


def test_generation_stops_when_the_context_is_full(model):
    generation = _generate(model, [1, 2, 3, 4, 5], max_tokens=100, temperature=0.7, top_k=8)
    assert generation.stop == ["context"] and len(generation.tokens[0]) == CFG.seq_len - 5


def test_a_sample_stops_at_the_end_of_text_token(model):
    staged, params = model
    greedy = _generate(model, [3], max_tokens=8, temperature=0.0).tokens[0]
    first = next(i for i in range(1, 8) if greedy[i] not in greedy[:i])  # its first occurrence
    sampler = Sampler(staged, params, context=CFG.seq_len, options=SamplingOptions(max_tokens=8, temperature=0.0))
    streamed: list[int] = []
    ended = sampler.generate(np.asarray([3]), end_of_text=int(greedy[first]),
                             on_tokens=lambda t: streamed.append(int(t[0])))
    assert ended.stop == ["end_of_text"]
    np.testing.assert_array_equal(ended.tokens[0], greedy[:first])
    assert streamed == greedy[:first + 1].tolist()  # the end-of-text token is reported, not kept


def test_bad_prompts_and_families_without_decoding_are_refused(model):
    staged, params = model
    sampler = Sampler(staged, params, context=CFG.seq_len, options=SamplingOptions())
    with pytest.raises(SamplingError, match="the prompt is empty"):
        sampler.generate(np.zeros(0, np.int32))
    with pytest.raises(SamplingError, match="the prompt is 16 tokens, the model's context is 16"):
        sampler.generate(np.ones(16, np.int32))
    cannot = dataclasses.replace(staged, init_cache=None, decode=None)
    with pytest.raises(SamplingError, match="the 'encoder' model family cannot sample"):
        Sampler(cannot, params, context=CFG.seq_len, options=SamplingOptions(), family="encoder")


# ------------------------------------------------------------------------------------------------ text


def test_the_text_stream_holds_back_a_character_cut_in_the_middle():
    text = "naïve € 😀!"
    tokenizer = data_lib.ByteTokenizer()
    stream = TextStream(tokenizer.decode)
    pieces = [stream.push(int(b)) for b in tokenizer.encode(text)]
    assert "".join(pieces) + stream.finish() == text
    assert not any("\ufffd" in p for p in pieces)
    assert pieces[-2:] == ["😀", "!"]  # a 4-byte character comes out whole, with its last byte


def test_the_run_tokenizer_is_bytes_or_the_prepared_bpe(tmp_path):
    byte = Config(data=DataConfig(tokenizer="byte"))
    assert isinstance(run_tokenizer(byte), data_lib.ByteTokenizer)
    source = tmp_path / "corpus.txt"
    source.write_text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 50)
    data_lib.prepare([source], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)
    bpe = Config(data=DataConfig(tokenizer="bpe", dir=str(tmp_path / "bpe")), model=ModelConfig(vocab_size=300))
    tokenizer = run_tokenizer(bpe)
    assert tokenizer.name == "bpe" and tokenizer.decode(tokenizer.encode("def fib(")) == "def fib("
    with pytest.raises(SamplingError, match=f"data directory {tmp_path / 'elsewhere'} .*--data-dir"):
        run_tokenizer(bpe, tmp_path / "elsewhere")
    with pytest.raises(SamplingError, match=f"{tokenizer.vocab_size} ids, the model only model.vocab_size=256"):
        run_tokenizer(dataclasses.replace(bpe, model=ModelConfig(vocab_size=256)))


# ------------------------------------------------------------------------------------------------ the command


@pytest.fixture(scope="module")
def run_dir(trained_tiny_run) -> Path:
    return trained_tiny_run("in_memory")[0]


def _sample(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["sample", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
def test_sample_prints_the_prompt_and_a_deterministic_continuation(run_dir, capsys):
    args = (run_dir, "--prompt", "the quick ", "--max-tokens", "12", "--seed", "3")
    code, out, err = _sample(capsys, *args)
    assert code == 0 and out.startswith("the quick ") and out.endswith("\n")
    assert "[12 tokens from step 4 of" in err and "stopped: --max-tokens reached" in err
    assert _sample(capsys, *args)[1] == out
    code, again, err = _sample(capsys, *args, "--step", "2", "--temperature", "0")
    assert code == 0 and "from step 2" in err
    code, many, _ = _sample(capsys, run_dir, "--prompt", "the ", "--num-samples", "2", "--max-tokens", "5")
    assert code == 0 and many.count("--- sample ") == 2 and many.count("\nthe ") == 2


@pytest.mark.slow
def test_sample_refuses_clearly(run_dir, tmp_path, capsys):
    code, _, err = _sample(capsys, tmp_path / "none", "--prompt", "x")
    assert code == 1 and f"run directory {tmp_path / 'none'} does not exist" in err
    code, _, err = _sample(capsys, run_dir, "--prompt", "")
    assert code == 1 and "the prompt is empty" in err
    code, _, err = _sample(capsys, run_dir, "--prompt", "x" * 32)
    assert code == 1 and "the prompt is 32 tokens, the model's context is 32" in err
    code, _, err = _sample(capsys, run_dir, "--prompt", "x", "--top-p", "2")
    assert code == 2 and "top_p (--top-p) must be in (0, 1]" in err
    code, _, err = _sample(capsys, run_dir, "--prompt", "x", "--step", "3")
    assert code == 1 and "has no checkpoint of step 3" in err
    code, out, err = _sample(capsys, run_dir, "--prompt", "x" * 28, "--max-tokens", "10")
    assert code == 0 and "generating at most 4 tokens, not 10" in err and "stopped: the model's context is full" in err
    code, out, err = _sample(capsys, run_dir, "--prompt", "x" * 28)  # the default 200: no note, it just stops
    assert code == 0 and "generating at most" not in err and "stopped: the model's context is full" in err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.yaml").write_text((run_dir / "config.yaml").read_text())  # its memory tier is run_dir's
    code, _, err = _sample(capsys, bare, "--prompt", "x")
    assert code == 1 and f"run directory {bare} has no checkpoint" in err

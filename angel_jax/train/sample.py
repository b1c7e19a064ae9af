"""Sampling text from a model with a key/value cache: filters on the next-token distribution, and the decode loop.

    sampler = Sampler(models.get(cfg.model), params, context=cfg.model.seq_len, options=SamplingOptions())
    generation = sampler.generate(prompt_ids)          # one row of new token ids per sample

The prompt goes through the model in one call (the prefill, filling the cache); after that each new token is one
call with T = 1 at the next position (`StagedModel.decode`). The step (decode + choosing the next token,
`sampling_step`) is jitted with a fixed cache shape and the position traced: two programs per model and options,
one for the prompt's length and one for single tokens, shared by every sampler that differs only in its seed. Any
family whose StagedModel provides `init_cache` and `decode` can sample; the others are refused by name.

Choosing the next token (`next_token`): temperature 0 takes the most likely token (greedy); otherwise the logits
are divided by the temperature, cut to the top-k tokens, then to the nucleus (top-p), and one token is drawn. The
key of the draw is `fold_in(key(seed), position)`, so a seed, a prompt and a checkpoint always give the same text,
and samples of one batch (`num_samples`) are drawn independently.

Context: a model is trained on at most `model.seq_len` positions (a GPT has learned positions for no more), so
generation stops when the context is full; asking for more (prompt + max_tokens > seq_len) generates fewer tokens,
and `Generation.stop` says why. A sliding window was not chosen: every token would re-run the whole window (each
token's position changes with it), and the model would continue text whose beginning it cannot see.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from angel_jax.config.sampling import SamplingOptions
from angel_jax.errors import AngelError
from models.stages import StagedModel


class SamplingError(AngelError, ValueError):
    """A sampling request that cannot be served (an empty or too long prompt, a family that cannot decode, a
    tokenizer that is not the run's); the message names the problem. Bad options are ConfigErrors
    (angel_jax/config/sampling.py)."""


# ------------------------------------------------------------------------------------------------ pure functions


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Logits [..., V] with the tokens outside the top_k (0 = no limit) and then outside the nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probabilities (after top-k) sum to at least top_p:
    a token is kept when the tokens more likely than it hold less than top_p. The most likely token is always
    kept. Tokens tied with the last one kept are kept too (a cut by value, not by rank)."""
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        ordered = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens more likely than each
        lowest_kept = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < lowest_kept, -jnp.inf, logits)
    return logits


def next_token(key: jax.Array, logits: jax.Array, *, temperature: float, top_k: int = 0,
               top_p: float = 1.0) -> jax.Array:
    """The next token of each row of logits [B, V]: greedy at temperature 0, else drawn from the filtered
    distribution at that temperature."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits.astype(jnp.float32) / temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("decode", "temperature", "top_k", "top_p", "vocab_limit"),
                   donate_argnames="cache")
def sampling_step(params: Any, cache: Any, tokens: jax.Array, pos: jax.Array, key: jax.Array, *,
                  decode: Callable, temperature: float, top_k: int, top_p: float,
                  vocab_limit: int | None) -> tuple[jax.Array, Any]:
    """Run `tokens` [B, T] at positions pos .. pos+T-1 through `decode` (the cache updated in place) and choose
    each row's next token with the key `fold_in(key, pos)`. Ids at or above `vocab_limit` are never chosen.

    One jitted function for every sampler: a program per (family, options, shapes), shared by samplers that
    differ only in seed or prompt; the position is traced, so single-token steps reuse one program."""
    logits, cache = decode(params, cache, tokens, pos)
    last = logits[:, -1]
    if vocab_limit is not None and vocab_limit < last.shape[-1]:
        last = jnp.where(jnp.arange(last.shape[-1]) < vocab_limit, last, -jnp.inf)
    chosen = next_token(jax.random.fold_in(key, pos), last, temperature=temperature, top_k=top_k, top_p=top_p)
    return chosen, cache


def generation_length(prompt_len: int, max_tokens: int, context: int) -> int:
    """New tokens that fit: positions prompt_len .. context-1 exist, so at most context - prompt_len."""
    if prompt_len < 1:
        raise SamplingError("the prompt is empty: sampling continues a prompt of at least one token")
    if prompt_len >= context:
        raise SamplingError(f"the prompt is {prompt_len} tokens, the model's context is {context} "
                            f"(model.seq_len): it must be at most {context - 1} tokens to leave room for one more")
    return min(max_tokens, context - prompt_len)


# ------------------------------------------------------------------------------------------------ the decode loop


@dataclass(frozen=True)
class Generation:
    tokens: list[np.ndarray]
    """Per sample, the new token ids (int32), without the prompt and without the end-of-text token."""
    stop: list[str]
    """Per sample, why it ended: 'max_tokens', 'context' (the model's context is full) or 'end_of_text'."""


class Sampler:
    """A model's parameters on the device and its jitted sampling step; `generate` runs the decode loop."""

    def __init__(self, staged: StagedModel, params: Any, *, context: int, options: SamplingOptions,
                 family: str = "this", vocab_limit: int | None = None):
        """`context`: the model's context length (model.seq_len), the cache's size. `vocab_limit`: ids at or above
        it are never drawn (a tokenizer smaller than the model's vocabulary cannot decode them)."""
        if staged.init_cache is None or staged.decode is None:
            raise SamplingError(f"the {family!r} model family cannot sample: its StagedModel provides no "
                                "key/value-cache decoding (init_cache / decode)")
        self.staged, self.context, self.options = staged, context, options
        self.params = jax.device_put(params)
        self._static = dict(decode=staged.decode, temperature=options.temperature, top_k=options.top_k,
                            top_p=options.top_p, vocab_limit=vocab_limit)

    def generate(self, prompt: np.ndarray, *, end_of_text: int | None = None,
                 on_tokens: Callable[[np.ndarray], None] | None = None) -> Generation:
        """Continue `prompt` (token ids) `options.num_samples` times. `on_tokens` gets each step's new token of
        every sample ([num_samples] int32) as soon as it is known; a sample stops at `end_of_text` (when given)."""
        prompt = np.asarray(prompt, np.int32).ravel()
        limit = generation_length(len(prompt), self.options.max_tokens, self.context)
        batch = self.options.num_samples
        key = jax.random.key(self.options.seed)
        cache = self.staged.init_cache(batch, self.context)
        tokens, cache = sampling_step(self.params, cache, np.broadcast_to(prompt, (batch, len(prompt))),
                                      np.int32(0), key, **self._static)
        out = np.zeros((batch, limit), np.int32)
        ended = np.full(batch, -1)  # the index of each sample's end-of-text token, -1 while it runs
        for i in range(limit):
            new = np.asarray(tokens)
            out[:, i] = new
            if end_of_text is not None:
                ended = np.where((ended < 0) & (new == end_of_text), i, ended)
            if on_tokens is not None:
                on_tokens(new)
            if (ended >= 0).all() or i == limit - 1:
                break
            tokens, cache = sampling_step(self.params, cache, new[:, None], np.int32(len(prompt) + i), key,
                                          **self._static)
        full = "max_tokens" if limit == self.options.max_tokens else "context"
        return Generation(tokens=[out[b, :ended[b]] if ended[b] >= 0 else out[b, :i + 1] for b in range(batch)],
                          stop=["end_of_text" if e >= 0 else full for e in ended])


class TextStream:
    """Text of a growing token sequence, handed out in pieces that will not change: a token sequence cut inside a
    UTF-8 character decodes to a replacement character at its end, held back until the next token completes it
    (or `finish` is called)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._sent = 0

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        text = self._decode(self._ids)
        stable = len(text) - 1 if text.endswith("\ufffd") else len(text)
        piece, self._sent = text[self._sent:stable], max(self._sent, stable)
        return piece

    def finish(self) -> str:
        text = self._decode(self._ids)
        piece, self._sent = text[self._sent:], len(text)
        return piece

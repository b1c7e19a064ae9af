"""T5's span-corruption objective, computed from a training row inside the model, with static shapes.

The engines hand a model `tokens = row[:, :-1]` (to its first stage) and `targets = row[:, 1:]` (to its loss). An
encoder-decoder corrupts `text = tokens` (seq_len ids): about `NOISE_DENSITY` of the positions, in spans of mean
length `MEAN_SPAN_LENGTH`, are dropped from the encoder's input, each span replaced by one sentinel id, and the
decoder predicts the sentinels followed by the spans they stand for (T5, Raffel et al. 2020, section 3.1.4):

    text            a b c d e f g h i j
    noise           . . x x . . . x . .
    encoder input   a b <s0> e f g <s1> i j
    decoder target  <s0> c d <s1> h

The noise mask follows T5's `random_spans_noise_mask`: exactly `noise` noise positions in exactly `spans` spans,
their lengths and those of the `spans` non-noise runs between them drawn by a random segmentation, interleaved
starting with a non-noise run. So every row's encoder input has `length - noise + spans` ids and its decoder target
`noise + spans`: fixed lengths, nothing padded, nothing masked out of the loss. The segmentation's key is a hash of
the row's ids at positions 1 .. length-1: the same row is corrupted the same way wherever it is seen, and those
positions are also `targets[:, :-1]`, so the loss rebuilds the decoder target from `targets` alone (position 0,
which the loss does not see, is never noise: the first run is non-noise and has at least one position).

Extra ids follow the tokenizer's: sentinel k is `vocab_size + k` and the decoder's start id `vocab_size + spans`
(`vocab_size`: the tokenizer's ids, model.vocab_size), so the model's embedding table has `table_size =
vocab_size + spans + 1` rows and no sentinel can be a token of the text.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

NOISE_DENSITY = 0.15
"""Share of a row's positions that are corrupted (T5's default)."""
MEAN_SPAN_LENGTH = 3.0
"""Mean length of a corrupted span (T5's default)."""


@dataclass(frozen=True)
class SpanCorruption:
    """The corruption of rows of `length` ids below `vocab_size` (the tokenizer's)."""

    length: int
    vocab_size: int

    @property
    def noise(self) -> int:
        """Corrupted positions per row (at least 1, and at least one position is kept)."""
        return min(max(1, round(self.length * NOISE_DENSITY)), self.length - 1)

    @property
    def spans(self) -> int:
        """Corrupted spans per row (at least 1)."""
        return max(1, round(self.noise / MEAN_SPAN_LENGTH))

    @property
    def encoder_length(self) -> int:
        return self.length - self.noise + self.spans

    @property
    def decoder_length(self) -> int:
        return self.noise + self.spans

    @property
    def table_size(self) -> int:
        """Ids the model embeds and predicts: the tokenizer's, the sentinels and the decoder's start id."""
        return self.vocab_size + self.spans + 1

    @property
    def start_id(self) -> int:
        return self.vocab_size + self.spans

    def sentinel(self, k: jax.Array) -> jax.Array:
        return self.vocab_size + k

    def noise_mask(self, text: jax.Array) -> jax.Array:
        """bool[B, length]: the corrupted positions of each row of `text` int32[B, length] (position 0 is never
        corrupted and does not enter the hash)."""
        seed = _row_hash(text[:, 1:])
        noise_lengths = _random_segmentation(seed, 1, self.noise, self.spans)
        kept_lengths = _random_segmentation(seed, 2, self.length - self.noise, self.spans)
        runs = jnp.stack([kept_lengths, noise_lengths], axis=2).reshape(text.shape[0], -1)  # kept, noise, ...
        rows = jnp.arange(text.shape[0])[:, None]
        starts = jnp.zeros(text.shape, jnp.int32).at[rows, jnp.cumsum(runs, axis=1)[:, :-1]].set(1)
        return jnp.cumsum(starts, axis=1) % 2 == 1

    def encoder_input(self, text: jax.Array, mask: jax.Array) -> jax.Array:
        """int32[B, encoder_length]: the kept ids, each noise span replaced by its sentinel."""
        return self._compact(text, mask, self.encoder_length)

    def decoder_target(self, text: jax.Array, mask: jax.Array) -> jax.Array:
        """int32[B, decoder_length]: the noise spans, each preceded by its sentinel (the kept runs compacted the
        way the encoder input compacts the noise spans)."""
        return self._compact(text, ~mask, self.decoder_length)

    def decoder_input(self, target: jax.Array) -> jax.Array:
        """The target shifted right by one behind the start id (teacher forcing)."""
        start = jnp.full((target.shape[0], 1), self.start_id, target.dtype)
        return jnp.concatenate([start, target[:, :-1]], axis=1)

    def _compact(self, text: jax.Array, replaced: jax.Array, width: int) -> jax.Array:
        """int32[B, width]: each run of `replaced` positions becomes one sentinel (the k-th run: sentinel k), the
        other ids stay; `width` is their count, fixed by the mask's construction."""
        first = replaced & ~jnp.pad(replaced, ((0, 0), (1, 0)))[:, :-1]
        keep = ~replaced | first
        ids = jnp.where(first, self.sentinel(jnp.cumsum(first, axis=1) - 1), text).astype(jnp.int32)
        slot = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, width)  # dropped positions land past the end
        rows = jnp.arange(text.shape[0])[:, None]
        return jnp.zeros((text.shape[0], width), jnp.int32).at[rows, slot].set(ids, mode="drop")


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _row_hash(ids: jax.Array) -> jax.Array:
    """uint32[B]: a hash of each row's ids (each id mixed with its position, summed mod 2**32, mixed again)."""
    positions = jnp.arange(ids.shape[1], dtype=jnp.uint32)
    return _mix(jnp.sum(_mix(ids.astype(jnp.uint32) ^ (positions << 16)), axis=1, dtype=jnp.uint32))


def _random_segmentation(seed: jax.Array, salt: int, items: int, segments: int) -> jax.Array:
    """int32[B, segments]: per row, `items` split into `segments` non-empty runs at random (what T5's
    `_random_segmentation` draws): the first run starts at 0, and the segments - 1 of the other items - 1
    positions with the smallest scores (a hash of the row's seed, `salt` and the position) start the others.
    Integer hashing and a sort: cheap to compile, unlike a random permutation drawn per row."""
    positions = jnp.arange(items - 1, dtype=jnp.uint32)
    scores = _mix(seed[:, None] ^ _mix(positions * jnp.uint32(2) + jnp.uint32(salt << 24)))
    chosen = jnp.argsort(scores, axis=1)[:, :segments - 1]
    rows = jnp.arange(seed.shape[0])[:, None]
    starts = jnp.zeros((seed.shape[0], items - 1), jnp.int32).at[rows, chosen].set(1)
    segment = jnp.cumsum(jnp.pad(starts, ((0, 0), (1, 0))), axis=1)  # [B, items]: each item's run
    return jnp.sum(segment[:, :, None] == jnp.arange(segments), axis=1, dtype=jnp.int32)

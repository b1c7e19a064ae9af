"""The options of `angel-jax sample` (angel_jax/train/sample.py): how the next token is chosen and how many.

Not a section of a run's config (sampling reads a finished run, it does not change it); the command line's flags
are these fields, with `_` spelled `-`. Bad values are refused when the options are made, naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from angel_jax.config.fields import ConfigError, doc


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = doc(200, "New tokens to generate at most (fewer when the model's context fills up first).")
    temperature: float = doc(0.8, "Softmax temperature; 0 = greedy (the most likely token at every step).")
    top_p: float = doc(0.95, "Nucleus: keep the most likely tokens until their probabilities reach top_p (1 = all).")
    top_k: int = doc(0, "Keep only the top_k most likely tokens (0 = no limit); applied before top_p.")
    seed: int = doc(0, "Seed of the draws: the same seed, prompt and checkpoint give the same text.")
    num_samples: int = doc(1, "Continuations of the prompt, drawn independently in one batch.")

    def __post_init__(self) -> None:
        checks = (
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be a finite number >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 = no limit)"),
            ("num_samples", self.num_samples >= 1, "must be >= 1"),
        )
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"sampling option {name} (--{flag(name)}) {rule}, got {getattr(self, name)!r}")


def flag(name: str) -> str:
    """The command-line flag of a field: top_p -> top-p."""
    return name.replace("_", "-")

"""`angel-jax sample RUN_DIR --prompt TEXT`: text from a trained run's newest valid checkpoint (or `--step`).

Everything that can be refused is checked before the parameters are read: the options, the run directory, a model
family that cannot decode, the tokenizer, an empty prompt or one that fills the model's context. The text goes to
stdout (the prompt, then the continuation as it is generated when there is one sample); notes go to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from angel_jax.data import shards as data_lib
from angel_jax.data import hf_tokenizer as tokenizers_hf
from angel_jax.config import Config, ConfigError
from angel_jax.train.loop import data_dir_for
from angel_jax.config.sampling import SamplingOptions
from angel_jax.train.sample import Sampler, SamplingError, TextStream, generation_length
from angel_jax.train.weights import load_params, run_config
import models

STOPS = {"max_tokens": "--max-tokens reached", "context": "the model's context is full",
         "end_of_text": "end of text"}


def run_tokenizer(cfg: Config, data_dir: Path | None = None) -> data_lib.Tokenizer:
    """The tokenizer the run was trained with: bytes need nothing; a BPE is read from the prepared data directory;
    a Hugging Face tokenizer from its directory (data.tokenizer_path, else model.init_from), or from the copy in
    `data_dir` when one is given."""
    if cfg.data.tokenizer == "byte":
        tokenizer: data_lib.Tokenizer = data_lib.ByteTokenizer()
    elif cfg.data.tokenizer == "hf" and data_dir is None:
        try:
            tokenizer = tokenizers_hf.HfTokenizer.load(*tokenizers_hf.tokenizer_dir(cfg))
        except ConfigError as e:
            raise SamplingError(f"{e} (--data-dir reads the copy of the tokenizer in the run's prepared data "
                                "directory instead)") from e
    else:
        directory = data_dir or data_dir_for(cfg)
        try:
            tokenizer = data_lib.load_tokenizer(directory)
        except (data_lib.DataError, ConfigError, OSError) as e:
            raise SamplingError(f"the run's {cfg.data.tokenizer} tokenizer could not be read from its data "
                                f"directory {directory} ({e}); point --data-dir at the directory the run was "
                                "trained from") from e
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise SamplingError(f"the {tokenizer.name} tokenizer has {tokenizer.vocab_size} ids, the model only "
                            f"model.vocab_size={cfg.model.vocab_size}: not the run's tokenizer")
    return tokenizer


def main(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The command; text to `out`, notes to `err` (default: stdout and stderr as they are when called)."""
    out, err = out or sys.stdout, err or sys.stderr
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingOptions) if hasattr(args, f.name)}
    options = SamplingOptions(**given)
    if not args.prompt:
        raise SamplingError("the prompt is empty (--prompt ''): sampling continues a prompt of at least one token")
    cfg = run_config(args.run_dir)
    staged = models.get(cfg.model)
    if staged.decode is None or staged.init_cache is None:
        raise SamplingError(f"the {cfg.model.name!r} model family cannot sample: its StagedModel provides no "
                            "key/value-cache decoding (init_cache / decode)")
    tokenizer = run_tokenizer(cfg, args.data_dir)
    prompt = tokenizer.encode(args.prompt).astype(np.int32)
    context = cfg.model.seq_len
    limit = generation_length(len(prompt), options.max_tokens, context)
    if limit < options.max_tokens and "max_tokens" in given:  # the default quietly stops where the context ends
        print(f"note: the model's context is {context} tokens (model.seq_len) and the prompt takes {len(prompt)}: "
              f"generating at most {limit} tokens, not {options.max_tokens}", file=err)

    weights = load_params(args.run_dir, args.step)
    sampler = Sampler(staged, weights.params, context=context, options=options, family=cfg.model.name,
                      vocab_limit=tokenizer.vocab_size)
    eot = tokenizer.eot_id
    decode = tokenizer.decode_after(prompt)  # the continuation's text in the prompt's context
    if options.num_samples == 1:
        stream = TextStream(decode)
        out.write(args.prompt)
        out.flush()

        def show(tokens: np.ndarray) -> None:
            if tokens[0] != eot:
                out.write(stream.push(int(tokens[0])))
                out.flush()

        generation = sampler.generate(prompt, end_of_text=eot, on_tokens=show)
        out.write(stream.finish() + "\n")
    else:
        generation = sampler.generate(prompt, end_of_text=eot)
        for i, tokens in enumerate(generation.tokens):
            out.write(f"--- sample {i + 1} of {options.num_samples} ---\n{args.prompt}{decode(tokens)}\n")
    out.flush()
    lengths = sorted({len(t) for t in generation.tokens})
    print(f"[{'/'.join(map(str, lengths))} tokens from step {weights.step} of {args.run_dir}; stopped: "
          f"{', '.join(sorted({STOPS[s] for s in generation.stop}))}]", file=err)
    return 0

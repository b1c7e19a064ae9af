"""`angel-jax data prepare`: text, JSON Lines or Parquet files into token shards, or instruction records into rows,
in the directory training with the same settings uses."""

from __future__ import annotations

import argparse

from angel_jax.config import ConfigError, DataConfig


def run(args: argparse.Namespace) -> int:
    from angel_jax.data import shards as data_lib
    from angel_jax.data import instructions as instruction_data
    from angel_jax.config import Config, ModelConfig
    from angel_jax.train.loop import data_dir_for

    dcfg = data_config(args)
    # The directory training would use for the same settings (model.seq_len names an instruction row's length).
    model = ModelConfig(seq_len=args.seq_len) if args.seq_len is not None else ModelConfig()
    out = args.out or data_dir_for(Config(data=dcfg, model=model))
    vocab = args.vocab_size if args.tokenizer == "bpe" else 256  # what training passes: data.bpe_vocab_size or 256
    sources = data_lib.resolve_sources(args.source)
    if dcfg.format == "instruction":
        rows = instruction_data.Rows(args.seq_len + 1, dcfg.pack, dcfg.prompt_key, dcfg.response_key)
        meta = instruction_data.prepare(sources, out, rows, tokenizer=args.tokenizer, vocab_size=vocab,
                                        val_fraction=args.val_fraction, tokenizer_path=args.tokenizer_path)
        info = meta["instruction"]
        print(f"{out}: {info['records']:,} records -> {info['rows']:,} rows of {rows.row_tokens} tokens "
              f"({'packed' if rows.pack else 'padded'}; {info['cut']:,} cut to what a row can use before "
              f"tokenization, {info['truncated']:,} truncated, {info['dropped']:,} dropped, {info['empty']:,} "
              f"with an empty response), "
              f"{info['scored_tokens']:,} scored tokens, vocabulary "
              f"{meta['vocab_size']}; training with model.seq_len={args.seq_len} data.format=instruction "
              f"data.pack={str(rows.pack).lower()} and the same source, tokenizer and keys reuses it")
        return 0
    meta = data_lib.prepare(sources, out, tokenizer=args.tokenizer, vocab_size=vocab,
                            max_bytes=args.max_bytes or None, text_key=args.text_key,
                            val_fraction=args.val_fraction, tokenizer_path=args.tokenizer_path)
    print(f"{out}: {meta['total_tokens']:,} tokens in {len(meta['shards'])} shard(s), vocabulary {meta['vocab_size']}")
    return 0


_FLAGS = {"bpe_vocab_size": "--vocab-size"}
"""The `data prepare` flag of a data.* key whose name differs (else --<key with dashes>)."""


def data_config(args: argparse.Namespace) -> DataConfig:
    """The data config of `data prepare`'s flags, checked as training checks it; ConfigError naming the flags."""
    if (args.tokenizer == "hf") != (args.tokenizer_path is not None):
        raise ConfigError("--tokenizer-path DIR goes with --tokenizer hf, and --tokenizer hf needs it (the directory "
                          "of a Hugging Face tokenizer.json)")
    instruction = args.format == "instruction"
    if instruction != (args.seq_len is not None):
        raise ConfigError("--seq-len N goes with --format instruction, and --format instruction needs it (the "
                          "model.seq_len of the training run: rows of N + 1 tokens)")
    if instruction and args.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1, got {args.seq_len}")
    given = [f for f, v in (("--pack", args.pack), ("--prompt-key", args.prompt_key),
                            ("--response-key", args.response_key)) if v]
    if given and not instruction:
        raise ConfigError(f"{', '.join(given)}: only with --format instruction")
    dcfg = DataConfig(source=args.source, tokenizer=args.tokenizer, bpe_vocab_size=args.vocab_size,
                      max_bytes=args.max_bytes, text_key=args.text_key, tokenizer_path=str(args.tokenizer_path or ""),
                      val_fraction=args.val_fraction, format=args.format, pack=args.pack,
                      prompt_key=args.prompt_key or "prompt", response_key=args.response_key or "response")
    if errors := dcfg.validate():
        raise ConfigError("; ".join(f"{_FLAGS.get(key, '--' + key.replace('_', '-'))}: {why}" for key, why in errors))
    return dcfg

"""`angel-jax`: the command line.

    angel-jax train CONFIG [key=value ...]     train (resumes from the run directory's newest checkpoint)
    angel-jax launch -n N CONFIG [key=value]   N workers under the watchdog (restarts on crash / hang)
    angel-jax worker CONFIG [key=value ...]    one worker of a multi-process job (launch, Slurm, Kubernetes)
    angel-jax data prepare [--source S] ...    turn text, JSON Lines or Parquet files into token shards (or
                                               instruction records into rows: --format instruction)
    angel-jax plan CONFIG [key=value ...]      the paged engine's plan: page table, predicted step time and timeline
    angel-jax bench io                         measure H2D/D2H/disk/memcpy bandwidths (cost-model calibration)
    angel-jax ckpt ls|verify RUN_DIR [STEP]    list a run's checkpoints per tier / check their checksums
    angel-jax import HF_DIR --config OUT.yaml  a training config that starts from a Hugging Face checkpoint
    angel-jax export RUN_DIR --hf OUT_DIR      a run's weights as a Hugging Face checkpoint
    angel-jax sample RUN_DIR --prompt TEXT     continue TEXT with a trained run's model (key/value cache)
    angel-jax config [CONFIG]                  list every config key with its type, default and meaning
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import typing
from pathlib import Path

from angel_jax.config import ConfigError, DataConfig, describe, dump_yaml, load_config
from angel_jax.config.sampling import SamplingOptions, flag
from angel_jax.errors import AngelError
from angel_jax.train.plan_args import add_plan_arguments

_TRAIN_HELP = """\
Train the model described by CONFIG (a YAML file, e.g. experiments/gpt_tiny.yaml). Any config key can be
overridden as key=value, e.g. `optimizer.lr=3e-4 train.steps=200 train.run_dir=runs/try1`. The run directory
(runs/<config name> by default) receives config.yaml (the resolved config), metrics.jsonl and checkpoints/; a
second run with the same run directory resumes from its newest checkpoint (train.resume=false starts over).
`angel-jax config` lists every key."""

_CKPT_HELP = """\
A run's checkpoints live in three tiers: memory (a RAM-backed directory, checkpoint.memory_dir), peer (a copy on
another host, checkpoint.peer_dir) and persistent (<run_dir>/checkpoints, ordinary orbax checkpoints). `ls` lists
each step's state per tier (snapshotted, backed_up, persisted, partial) without reading data; `verify` reads every
committed copy and checks every array's XXH3-64 checksum (exit status 1 if any copy is damaged)."""

_LAUNCH_HELP = """\
Train CONFIG with N worker processes that form one data-parallel job (jax.distributed; gloo collectives on the
CPU), watched by a coordinator: heartbeats (step, loss, phase) over loopback, authenticated with a per-job token.
A worker that exits non-zero or dies, a hang (no step progress within resilience.hang_timeout_min or
resilience.hang_factor x the p95 step time; resilience.slow_phase_timeout while compiling, restoring,
checkpointing or evaluating), or an anomaly asking for a restart stops the whole group (SIGTERM, resilience.stop_grace, SIGKILL)
and restarts it from the newest valid checkpoint, up to resilience.max_restarts times and
resilience.no_progress_limit restarts without progress. The run directory receives events.jsonl (every decision),
watchdog.json (state, worker pids), logs/attempt<A>-rank<R>.log and goodput.json. Exit status 0 when the job
finished, 1 when it failed."""

_IMPORT_HELP = """\
Write a training config (OUT.yaml) that starts from a Hugging Face checkpoint directory (config.json +
model.safetensors; GPT-2 and Llama): the base config (--base, default: every key's default) with the model
section's architecture keys taken from config.json and model.init_from = HF_DIR, the checkpoint's tokenizer when
HF_DIR has a tokenizer.json (data.tokenizer: hf, data.tokenizer_path = HF_DIR), then the key=value overrides. No
weight is read; training reads them (stage by stage in the paged engine)."""

_EXPORT_HELP = """\
Write the parameters of a run's newest valid checkpoint (or --step N), of either engine, as a Hugging Face
checkpoint: OUT_DIR/config.json + OUT_DIR/model.safetensors (GPT -> GPT2LMHeadModel, Llama -> LlamaForCausalLM,
head untied), or shards of at most --max-shard-size named by model.safetensors.index.json, which transformers'
AutoModelForCausalLM.from_pretrained loads, and the run's tokenizer files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) when it was trained with data.tokenizer: hf. A paged run is read and written a stage at
a time: the export holds one stage of the model, not all of it."""
_SAMPLE_HELP = """\
Continue --prompt with the model of a trained run, read from the run directory's newest valid checkpoint (or
--step) of either engine, and print the prompt and the continuation (streamed as it is generated when there is one
sample). The prompt is encoded with the run's tokenizer (bytes, the BPE in the run's data directory, or the Hugging
Face tokenizer of data.tokenizer_path / model.init_from); the prompt goes through the model once and each new token
is one step over a key/value cache. --temperature 0 is greedy; otherwise tokens are drawn from the top-k, then
top-p (nucleus) filtered distribution, and the same --seed gives the same text. Generation stops at --max-tokens,
at the end-of-text token (BPE, Hugging Face EOS), or when the model's context (model.seq_len) is full: a prompt
plus --max-tokens longer than the context generates fewer tokens, with a note."""

_DATA_HELP = """\
Tokenize text files into memory-mapped token shards (uint16 .bin files) plus meta.json. `--source stdlib` (the
default) uses this Python's standard-library sources, a corpus every machine has. JSON Lines (*.jsonl,
*.jsonl.gz) and Parquet (*.parquet) files hold one document per record, its text under --text-key; a directory
may mix them with text files (one document per file). Training prepares its data automatically when the shards
are missing; this command does it ahead of time or for another corpus.

`--format instruction` prepares instruction data (data.format: instruction): JSON Lines records of a prompt and a
response (--prompt-key, --response-key), or chats ('messages', rendered by the chat template of --tokenizer hf),
into rows of --seq-len + 1 marked tokens, padded or packed (--pack). Training with the same source, tokenizer,
model.seq_len, data.pack, keys and data.val_fraction finds the directory (its default name is the one training
uses, or data.dir=OUT) and reuses it instead of preparing it again."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="angel-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a YAML config", description=_TRAIN_HELP)
    train.add_argument("config", type=Path, help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    launch = sub.add_parser("launch", help="train with N worker processes under the watchdog",
                            description=_LAUNCH_HELP)
    launch.add_argument("-n", "--workers", type=int, required=True, help="number of worker processes")
    launch.add_argument("config", type=Path, help="YAML config file")
    launch.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    launch.add_argument("--spares", type=int, default=0,
                        help="spare worker slots that replace a slot excluded after repeated failures")
    launch.add_argument("--cpu-devices", type=int, default=None,
                        help="CPU devices per worker (CPU backend; default: JAX's, 1)")

    worker = sub.add_parser("worker", help="one worker of a multi-process job (what launch starts; or srun)",
                            description="Run one training process of a multi-process job. Under `angel-jax "
                            "launch` the ANGEL_JAX_* environment says where it belongs; without it, under Slurm "
                            "or Kubernetes, jax.distributed.initialize() reads the scheduler's environment.")
    worker.add_argument("config", type=Path, help="YAML config file")
    worker.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    data = sub.add_parser("data", help="prepare training data", description=_DATA_HELP)
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenize text into shards", description=_DATA_HELP)
    prep.add_argument("--source", default="stdlib", help="'stdlib', a file, a directory or a glob (default stdlib)")
    prep.add_argument("--out", type=Path, default=None,
                      help="output directory (default: the one training with these settings uses, "
                           "data/<source>-<tokenizer>, with -pad<N+1> or -pack<N+1> for instruction rows and "
                           "-val<F> for a val split)")
    prep.add_argument("--tokenizer", choices=["byte", "bpe", "hf"], default="byte",
                      help="byte (the default), bpe (trained on the source) or hf (a Hugging Face tokenizer.json: "
                           "--tokenizer-path)")
    prep.add_argument("--tokenizer-path", type=Path, default=None, metavar="DIR",
                      help="with --tokenizer hf: the directory holding tokenizer.json (a Hugging Face checkpoint's)")
    prep.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    prep.add_argument("--max-bytes", type=int, default=0, help="read at most this much source text (0 = all)")
    prep.add_argument("--text-key", default="text",
                      help="JSON Lines key / Parquet column of each record's text (default text)")
    prep.add_argument("--val-fraction", type=float, default=0.0,
                      help="share of the tail (of the token stream; of instruction rows) held out as the validation "
                           "split (data.val_fraction; default 0)")
    prep.add_argument("--format", choices=["text", "instruction"], default="text",
                      help="text (the default): documents as one token stream; instruction: prompt/response or chat "
                           "records as rows (data.format)")
    prep.add_argument("--seq-len", type=int, default=None, metavar="N",
                      help="with --format instruction: the model's model.seq_len (rows of N + 1 tokens)")
    prep.add_argument("--pack", action="store_true",
                      help="with --format instruction: pack records end to end into each row (data.pack)")
    prep.add_argument("--prompt-key", default=None,
                      help="with --format instruction: each record's prompt key (data.prompt_key; default prompt)")
    prep.add_argument("--response-key", default=None,
                      help="with --format instruction: each record's response key (data.response_key; default "
                           "response)")

    plan = sub.add_parser("plan", help="plan paged training without training (page table, predicted timeline)",
                          description="Print the paged engine's page table (bytes per family per tier), the "
                          "predicted step time and peak bytes per tier, and write the predicted timeline (PNG and "
                          "JSON) to the run directory or --out.")
    add_plan_arguments(plan)

    bench = sub.add_parser("bench", help="measure this machine (bench io: bandwidths for the cost model)")
    bench.add_argument("what", choices=["io"], help="io: H2D/D2H, device copy, disk tier, memcpy")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the benchmark (see --help)")

    ckpt = sub.add_parser("ckpt", help="inspect a run's checkpoints (ls, verify)", description=_CKPT_HELP)
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ls = ckpt_sub.add_parser("ls", help="steps, tiers, states and sizes", description=_CKPT_HELP)
    ls.add_argument("run_dir", type=Path, help="the run directory (e.g. runs/gpt_tiny)")
    verify = ckpt_sub.add_parser("verify", help="read every copy and check its checksums", description=_CKPT_HELP)
    verify.add_argument("run_dir", type=Path, help="the run directory (e.g. runs/gpt_tiny)")
    verify.add_argument("step", type=int, nargs="?", help="only this step (default: every committed step)")

    imp = sub.add_parser("import", help="a training config starting from a Hugging Face checkpoint",
                         description=_IMPORT_HELP)
    imp.add_argument("hf_dir", type=Path, help="the checkpoint directory (config.json + model.safetensors)")
    imp.add_argument("--config", type=Path, required=True, help="the training config to write (YAML)")
    imp.add_argument("--base", type=Path, default=None, help="the config whose other sections to use "
                     "(e.g. experiments/gpt_tiny.yaml)")
    imp.add_argument("overrides", nargs="*", help="dotted key=value overrides")

    export = sub.add_parser("export", help="a run's weights as a Hugging Face checkpoint", description=_EXPORT_HELP)
    export.add_argument("run_dir", type=Path, help="the run directory (e.g. runs/gpt_tiny)")
    export.add_argument("--hf", type=Path, required=True, metavar="OUT_DIR", help="where to write the checkpoint")
    export.add_argument("--step", type=int, default=None, help="this step's checkpoint (default: the newest valid)")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="dtype of the written tensors (default: the parameters' own)")
    export.add_argument("--overwrite", action="store_true", help="replace an export already in OUT_DIR")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest weight file, e.g. 500MB, 2GB (decimal units as huggingface_hub, or GiB) or a "
                             "number of bytes; a model larger than that is written in shards named by "
                             "model.safetensors.index.json (default: 5GB)")
    sample = sub.add_parser("sample", help="text from a trained run (its newest valid checkpoint)",
                            description=_SAMPLE_HELP)
    sample.add_argument("run_dir", type=Path, help="the run directory (e.g. runs/gpt_tiny)")
    sample.add_argument("--prompt", required=True, help="the text to continue")
    types = typing.get_type_hints(SamplingOptions)
    for option in dataclasses.fields(SamplingOptions):
        sample.add_argument(f"--{flag(option.name)}", dest=option.name, type=types[option.name],
                            default=option.default, help=f"{option.metadata['doc']} (default {option.default})")
    sample.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest valid)")
    sample.add_argument("--data-dir", type=Path, default=None,
                        help="the run's prepared data directory, which holds its BPE or a copy of its Hugging Face "
                             "tokenizer (default: the run's data.dir, else data/<source>-<tokenizer> under the "
                             "working directory; a Hugging Face tokenizer is read from data.tokenizer_path)")

    cfg = sub.add_parser("config", help="list every config key with type, default and meaning")
    cfg.add_argument("config", type=Path, nargs="?", help="show this file's resolved values instead")
    cfg.add_argument("overrides", nargs="*")
    return p


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    from angel_jax.tol.faults import FaultHooks
    from angel_jax.train.loop import persisted_text, train  # jax is imported only when needed: `--help` stays instant

    from angel_jax.schedule.pinned_limit import configure_pinned_limit
    from angel_jax.train.preemption import Preempted

    if line := configure_pinned_limit(cfg):  # before jax starts a GPU client, which reads the limit once
        logging.getLogger("angel_jax.train").info("%s", line)
    faults = FaultHooks.from_env(rank=0, vocab_size=cfg.model.vocab_size)  # ANGEL_JAX_FAULTS: tests only
    try:
        result = train(cfg, hooks=[faults] if faults else [])
    except Preempted as e:  # not an error: the run saved and stopped as asked
        print(f"{e}; run directory {cfg.run_dir}", file=sys.stderr)
        return e.exit_code
    # The newest persisted step, always: a run whose checkpoints are all in RAM must not look finished and safe.
    if result.history:
        first, last = result.history[0], result.history[-1]
        trained = f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})"
    else:  # resumed at its last step: nothing left to train
        trained = "no step trained by this run"
    print(f"done: step {result.final_step}, {trained}; run directory {result.run_dir}; "
          f"{persisted_text(result.newest_persisted)}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from angel_jax.tol.launch import launch

    if args.workers < 1 or args.spares < 0:
        print("error: -n must be >= 1 and --spares >= 0", file=sys.stderr)
        return 2
    return launch(args.config, args.overrides, workers=args.workers, spares=args.spares,
                  cpu_devices=args.cpu_devices)


def _worker(args: argparse.Namespace) -> int:
    from angel_jax.tol.worker import run

    return run(str(args.config), args.overrides)


def _data(args: argparse.Namespace) -> int:
    from angel_jax import data as data_lib
    from angel_jax import instruction_data
    from angel_jax.config import Config, ModelConfig
    from angel_jax.train.loop import data_dir_for

    dcfg = _data_config(args)
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
              f"({'packed' if rows.pack else 'padded'}), {info['scored_tokens']:,} scored tokens, vocabulary "
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


def _data_config(args: argparse.Namespace) -> DataConfig:
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


def _plan(args: argparse.Namespace) -> int:
    from angel_jax.train import plan_cli

    return plan_cli.main(args)


def _bench(args: argparse.Namespace) -> int:
    from angel_jax.memory import bench_io

    return bench_io.main(args.rest)


def _ckpt(args: argparse.Namespace) -> int:
    from angel_jax.train.ckpt_cli import list_table, verify_report

    if args.ckpt_command == "ls":
        print("\n".join(list_table(args.run_dir)))
        return 0
    ok, lines = verify_report(args.run_dir, args.step)
    print("\n".join(lines))
    return 0 if ok else 1


def _import(args: argparse.Namespace) -> int:
    from angel_jax.train import hf_cli

    return hf_cli.import_main(args)


def _export(args: argparse.Namespace) -> int:
    from angel_jax.train import hf_cli

    return hf_cli.export_main(args)
def _sample(args: argparse.Namespace) -> int:
    from angel_jax.train import sample_cli

    return sample_cli.main(args)


def _config(args: argparse.Namespace) -> int:
    if args.config is None:
        print("\n".join(describe()))
    else:
        print(dump_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    # `train CONFIG --print-config key=value`: argparse stops filling a nargs='*' positional at the first
    # optional, so overrides after one come back as extras; take them, refuse anything else.
    args, extra = parser.parse_known_args(argv)
    if argv is None and args.command in ("train", "worker"):
        from angel_jax.memory.malloc import restart_with_huge_pages

        restart_with_huge_pages(["-m", "angel_jax.cli", *sys.argv[1:]])  # host updates ~2x faster; same pid
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    handlers = {"train": _train, "launch": _launch, "worker": _worker, "data": _data, "plan": _plan,
                "bench": _bench, "ckpt": _ckpt, "import": _import, "export": _export, "sample": _sample,
                "config": _config}
    try:
        return handlers[args.command](args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except AngelError as e:  # user-facing errors get one clean line; anything else keeps its traceback
        code = getattr(e, "exit_code", 1)  # a restart request carries the status the watchdog reads
        print(f"error: {e}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())

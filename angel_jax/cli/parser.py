"""Every `angel-jax` command's arguments and help, argparse alone: `angel-jax --help` (or any command's) never
imports JAX; each command's handler (a module of this package) is imported only when that command runs."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from angel_jax.cli.plan_args import add_plan_arguments
from angel_jax.config.sampling import SamplingOptions, flag

COMMANDS = """\
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
    angel-jax plot RUN_DIR [RUN_DIR ...]       several runs' loss curves on one chart (a PNG)
    angel-jax config [CONFIG]                  list every config key with its type, default and meaning
"""

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
CPU), watched by a coordinator: heartbeats (step, loss, phase) over TCP, authenticated with a per-job token.
Inside a Slurm allocation (sbatch, salloc) each attempt runs every rank as a job step on the nodes the watchdog
trusts; nodes beyond the job's are spares, and a node whose slurmd stops answering is excluded at once.
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

_PLOT_HELP = """\
Draw the training loss (solid) and evaluation loss (dashed) of one or more runs against the step on one chart,
one colour per run, read from each run directory's metrics.jsonl (its logged records: every train.log_every
steps and each evaluation). Every run also keeps its own chart, <run_dir>/loss.png, redrawn at each evaluation and
checkpoint."""

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



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="angel-jax", description=COMMANDS, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a YAML config", description=_TRAIN_HELP)
    train.add_argument("config", type=Path, help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")

    launch = sub.add_parser("launch", help="train with N worker processes under the watchdog",
                            description=_LAUNCH_HELP)
    launch.add_argument("-n", "--workers", type=int, default=None,
                        help="number of worker processes (inside a Slurm allocation: default every node's ranks "
                             "but the spares')")
    launch.add_argument("config", type=Path, help="YAML config file")
    launch.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    launch.add_argument("--spares", type=int, default=0,
                        help="spare nodes (on one machine: worker slots) that replace one excluded after repeated "
                             "failures or lost")
    where = launch.add_mutually_exclusive_group()
    where.add_argument("--slurm", dest="slurm", action="store_true", default=None,
                       help="start each attempt as job steps of this Slurm allocation (the default inside sbatch or "
                            "salloc: SLURM_JOB_ID set)")
    where.add_argument("--local", dest="slurm", action="store_false",
                       help="start the workers on this machine even inside a Slurm allocation")
    launch.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                        help="with --slurm: workers per node (default: the allocation's --ntasks-per-node, else its "
                             "GPUs per node, else 1)")
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
    ls = ckpt_sub.add_parser("ls", help="steps, tiers, states and sizes", description=(
        "List RUN_DIR's checkpoints: one row per step, its state in each tier (memory, peer, persistent: "
        "snapshotted, backed_up, persisted, partial) and its size, from the tiers' records alone (no array is "
        "read; `verify` reads them). A run whose processes checkpoint their own shards gets a table per process."))
    ls.add_argument("run_dir", type=Path, help="the run directory (e.g. runs/gpt_tiny)")
    verify = ckpt_sub.add_parser("verify", help="read every copy and check its checksums", description=(
        "Read every committed copy of RUN_DIR's checkpoints (or of STEP only) in every tier and check every "
        "array's XXH3-64 checksum. Prints one line per copy (ok, or what is damaged and where); exit status 0 when "
        "every copy is intact, 1 when any is damaged or missing."))
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
                            default=argparse.SUPPRESS,  # absent unless given: `sample` tells asked from default
                            help=f"{option.metadata['doc']} (default {option.default})")
    sample.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest valid)")
    sample.add_argument("--data-dir", type=Path, default=None,
                        help="the run's prepared data directory, which holds its BPE or a copy of its Hugging Face "
                             "tokenizer (default: the run's data.dir, else data/<source>-<tokenizer> under the "
                             "working directory; a Hugging Face tokenizer is read from data.tokenizer_path)")

    plot = sub.add_parser("plot", help="several runs' loss curves on one chart", description=_PLOT_HELP)
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with its metrics.jsonl)")
    plot.add_argument("--out", type=Path, default=None, metavar="FILE.png",
                      help="the chart to write (default: loss_curves.png in the working directory)")

    cfg = sub.add_parser("config", help="list every config key with type, default and meaning", description=(
        "Without CONFIG: every config key, dotted (model.d_model, memory.host_budget, ...), with its type, default "
        "and one-line meaning, the same list as docs/configuration.md. With CONFIG: that file's resolved config "
        "(defaults filled in, the key=value overrides applied, everything validated) as YAML, which is what a run "
        "writes to its run directory as config.yaml."))
    cfg.add_argument("config", type=Path, nargs="?", help="a YAML config: print its resolved values instead")
    cfg.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to CONFIG "
                     "(e.g. train.steps=50)")
    return p



"""Typed configuration: one dataclass per component, loaded from YAML with dotted command-line overrides.

    cfg = load_config("experiments/gpt_tiny.yaml", ["optimizer.lr=3e-4", "train.steps=200"])

Every field carries a one-line doc (`field_doc`), shown by `angel-jax train --help-config`. Loading is strict:
an unknown key, a value of the wrong type or an impossible value raises `ConfigError` naming the dotted key and
the file (or "command line" for an override). Nothing is silently coerced except int -> float.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from angel_jax.config.anomaly import Action, ActionPolicy, AnomalyConfig
from angel_jax.config.fields import ConfigError, doc, field_doc, sub, type_name, typed  # noqa: F401

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- sections


@dataclass
class MoEConfig:
    experts: int = doc(0, "Experts per mixture-of-experts MLP; 0 = dense MLPs everywhere (no MoE).")
    top_k: int = doc(2, "Experts each token is routed to (their gates renormalised to sum to 1 when > 1).")
    capacity_factor: float = doc(1.25, "Slots per expert as a multiple of an even share, seq_len x top_k / experts "
                                       "(per sequence, at most seq_len); routings past an expert's slots are dropped.")
    aux_loss_coef: float = doc(0.01, "Weight of each MoE layer's load-balancing loss (Switch/GShard) in the loss.")
    z_loss_coef: float = doc(0.001, "Weight of each MoE layer's router z-loss (mean squared log-sum-exp of the "
                                    "router logits, ST-MoE) in the loss.")
    every: int = doc(1, "An MoE MLP in every this-many-th block (blocks every-1, 2 x every-1, ...); 1 = all blocks.")

    def validate(self, n_layers: int) -> list[tuple[str, str]]:
        errs = []
        if self.experts < 0:
            errs.append(("experts", f"must be >= 0 (0 = dense), got {self.experts}"))
        if self.top_k < 1 or self.experts and self.top_k > self.experts:
            errs.append(("top_k", f"must be between 1 and moe.experts={self.experts}, got {self.top_k}"))
        if not self.capacity_factor > 0:
            errs.append(("capacity_factor", f"must be > 0, got {self.capacity_factor!r}"))
        for key in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, key) < 0:
                errs.append((key, f"must be >= 0, got {getattr(self, key)!r}"))
        if self.every < 1:
            errs.append(("every", f"must be >= 1, got {self.every}"))
        elif self.experts and n_layers > 0 and n_layers % self.every:
            errs.append(("every", f"model.n_layers={n_layers} is not a multiple of moe.every={self.every}"))
        return errs


@dataclass
class ModelConfig:
    name: str = doc("gpt", "Model family: a name in models.FAMILIES (checked when the model is built).")
    vocab_size: int = doc(256, "Vocabulary size; must cover the tokenizer's (256 for bytes).")
    seq_len: int = doc(128, "Tokens per training sequence (context length).")
    d_model: int = doc(128, "Residual stream width.")
    n_layers: int = doc(4, "Number of transformer blocks (an encoder-decoder's encoder blocks).")
    n_decoder_layers: int = doc(0, "Decoder blocks of an encoder-decoder (T5); 0 = n_layers.")
    n_heads: int = doc(4, "Attention heads; d_model must be divisible by it.")
    n_kv_heads: int = doc(0, "Key/value heads (grouped-query attention, Llama); 0 = n_heads. Must divide n_heads.")
    mlp_ratio: float = doc(4.0, "MLP hidden width as a multiple of d_model (when mlp_hidden is 0).")
    mlp_hidden: int = doc(0, "MLP hidden width exactly (Llama's intermediate_size); 0 = mlp_ratio x d_model.")
    norm_eps: float = doc(1e-5, "Epsilon of the LayerNorm / RMSNorm layers.")
    rope_theta: float = doc(10000.0, "Base of the rotary position embedding's frequencies (Llama).")
    rope_scaling: Literal["none", "llama3"] = doc("none", "RoPE frequency scaling (Llama): none, or llama3 (Llama "
                                                          "3.1's: long wavelengths slowed by rope_factor).")
    rope_factor: float = doc(8.0, "llama3 RoPE scaling: how much longer the context is than the original one.")
    rope_low_freq_factor: float = doc(1.0, "llama3 RoPE scaling: wavelengths above original / this are slowed "
                                           "by rope_factor.")
    rope_high_freq_factor: float = doc(4.0, "llama3 RoPE scaling: wavelengths below original / this are kept; "
                                            "those between are interpolated.")
    rope_original_max_positions: int = doc(8192, "llama3 RoPE scaling: the context length the model was "
                                                 "pretrained at (original_max_position_embeddings).")
    tie_embeddings: bool = doc(False, "Unembed with the token embedding's transpose: one matrix for both (Llama).")
    qkv_bias: bool = doc(False, "Biases on the attention's q, k and v projections (Llama; Qwen2 has them).")
    o_bias: bool = doc(False, "A bias on the attention's output projection (Llama; attention_bias sets both).")
    relative_buckets: int = doc(32, "Buckets of the relative position bias (T5): half exact distances, half "
                                    "logarithmic up to relative_max_distance (per direction in the encoder).")
    relative_max_distance: int = doc(128, "Relative distance from which positions share the last bucket (T5).")
    compute_dtype: Literal["bfloat16", "float32"] = doc("bfloat16", "Dtype of activations and matmuls.")
    param_dtype: Literal["float32", "bfloat16"] = doc("float32", "Dtype of the stored (master) parameters.")
    cpu_matmul_fp32: bool = doc(True, "On the CPU backend, a bfloat16 model's matmuls compute in float32 (operands "
                                      "upcast at the dot, results back in bfloat16): XLA:CPU has no fast bfloat16 "
                                      "dot.")
    remat: bool = doc(False, "Recompute each block's activations in the backward pass (saves memory).")
    scan_blocks: bool = doc(True, "Run the blocks with one scanned body (compile time independent of depth).")
    init_from: str = doc("", "A Hugging Face checkpoint directory (config.json + model.safetensors) to start from; "
                             "its architecture must match the keys above. Empty = random init from train.seed.")
    moe: MoEConfig = sub(MoEConfig, "Mixture-of-experts MLPs (GPT, Llama); experts 0 = dense.")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        for key in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, key) <= 0:
                errs.append((key, "must be > 0"))
        if self.n_heads > 0 and self.d_model % self.n_heads:
            errs.append(("n_heads", f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"))
        if self.n_kv_heads < 0 or (self.n_kv_heads and self.n_heads > 0 and self.n_heads % self.n_kv_heads):
            errs.append(("n_kv_heads", f"must be 0 (= n_heads) or divide n_heads={self.n_heads}, "
                                       f"got {self.n_kv_heads}"))
        if self.mlp_hidden < 0 or self.mlp_hidden > 2**24:
            errs.append(("mlp_hidden", f"must be 0 (= mlp_ratio x d_model) or at most 2**24, got {self.mlp_hidden}"))
        hidden = self.mlp_ratio * self.d_model
        if not self.mlp_hidden and (self.mlp_ratio <= 0 or not 1 <= hidden <= 2**24):
            errs.append(("mlp_ratio", f"must be > 0 and give an MLP hidden width (mlp_ratio x d_model) between 1 "
                                      f"and 2**24, got {self.mlp_ratio!r} x {self.d_model} = {hidden:.4g}"))
        if not 0 < self.norm_eps < 1:
            errs.append(("norm_eps", f"must be in (0, 1), got {self.norm_eps!r}"))
        if not self.rope_theta > 0:
            errs.append(("rope_theta", f"must be > 0, got {self.rope_theta!r}"))
        errs += self._rope_scaling_errors()
        for key in ("tie_embeddings", "qkv_bias", "o_bias"):
            if getattr(self, key) and self.name != "llama":
                errs.append((key, f"only the llama family has it (model.name={self.name!r})"))
        if self.n_decoder_layers < 0:
            errs.append(("n_decoder_layers", f"must be >= 0 (0 = n_layers), got {self.n_decoder_layers}"))
        if self.relative_buckets < 4 or self.relative_buckets % 4:
            errs.append(("relative_buckets", f"must be a multiple of 4 and >= 4 (half exact, half logarithmic, "
                                             f"per direction), got {self.relative_buckets}"))
        elif self.relative_max_distance <= self.relative_buckets // 2:
            errs.append(("relative_max_distance", f"must exceed relative_buckets / 2 = {self.relative_buckets // 2} "
                                                  f"(the exact distances), got {self.relative_max_distance}"))
        if self.moe.experts and self.init_from:
            errs.append(("moe.experts", "a Hugging Face checkpoint (model.init_from) holds a dense model: "
                                        "set moe.experts to 0"))
        return errs + [("moe." + key, problem) for key, problem in self.moe.validate(self.n_layers)]

    def _rope_scaling_errors(self) -> list[tuple[str, str]]:
        # The ranges transformers' llama3 RoPE checks (it only warns; a smoothing ramp of zero width would divide
        # by zero).
        errs = []
        if not self.rope_factor >= 1:
            errs.append(("rope_factor", f"must be >= 1, got {self.rope_factor!r}"))
        if not self.rope_low_freq_factor > 0:
            errs.append(("rope_low_freq_factor", f"must be > 0, got {self.rope_low_freq_factor!r}"))
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            errs.append(("rope_high_freq_factor", f"must exceed rope_low_freq_factor={self.rope_low_freq_factor!r}, "
                                                  f"got {self.rope_high_freq_factor!r}"))
        if self.rope_original_max_positions < 1:
            errs.append(("rope_original_max_positions", f"must be >= 1, got {self.rope_original_max_positions}"))
        return errs

    @property
    def hidden(self) -> int:
        """The MLP hidden width."""
        return self.mlp_hidden or int(self.d_model * self.mlp_ratio)

    @property
    def decoder_layers(self) -> int:
        """Decoder blocks of an encoder-decoder (n_layers unless n_decoder_layers is set)."""
        return self.n_decoder_layers or self.n_layers

    @property
    def kv_heads(self) -> int:
        """Key/value heads (n_heads unless grouped-query attention)."""
        return self.n_kv_heads or self.n_heads


@dataclass
class DataConfig:
    source: str = doc("stdlib", "Text to train on: 'stdlib' (this Python's standard library source), a file, a "
                                "directory or a glob; *.jsonl, *.jsonl.gz and *.parquet files are read as records.")
    text_key: str = doc("text", "JSON Lines key / Parquet column holding each record's document text.")
    tokenizer: Literal["byte", "bpe", "hf"] = doc("byte", "'byte' (256 ids, nothing to download), 'bpe' (trained "
                                                         "locally) or 'hf' (a Hugging Face tokenizer.json: "
                                                         "data.tokenizer_path).")
    bpe_vocab_size: int = doc(4096, "Vocabulary size when training a BPE tokenizer.")
    tokenizer_path: str = doc("", "With tokenizer 'hf': the directory holding tokenizer.json (and its "
                                  "tokenizer_config.json, special_tokens_map.json); empty = model.init_from's.")
    dir: str = doc("", "Where prepared token shards live; empty = data/<source>-<tokenizer> under the working "
                       "directory (data/<source>-hf-<hash of the tokenizer> for 'hf').")
    max_bytes: int = doc(0, "Read at most this many bytes of source text (0 = all).")
    allow_binary: bool = doc(False, "Train on plain-text source files that look binary (a NUL byte or mostly not "
                                    "UTF-8 in their first MiB), which are refused otherwise.")
    seed: int = doc(0, "Seed of the data order (independent of the model seed).")
    val_fraction: float = doc(0.0, "Share of the token stream's tail (instruction data: of its rows) held out as "
                                   "the validation split (read by train.eval_every); 0 = a prepared directory's split "
                                   "as it is (none when training prepares it).")
    skip_batches: list = doc([], "Global batch index ranges [first, last] (0-based, inclusive) never trained on, "
                                 "e.g. [[120, 129]]; rollbacks record the windows they skip the same way.")
    format: Literal["text", "instruction"] = doc("text", "'text': documents as one token stream cut into windows; "
                                                         "'instruction': JSON Lines records of a prompt and a "
                                                         "response (or chat 'messages' rendered with the "
                                                         "tokenizer's chat template), the loss on the response "
                                                         "(or assistant turns) only.")
    prompt_key: str = doc("prompt", "Instruction data: the key of each record's prompt (a string; not trained on).")
    response_key: str = doc("response", "Instruction data: the key of each record's response (a string; the loss "
                                        "is on its tokens and the end of sequence).")
    pack: bool = doc(False, "Instruction data: pack whole records into each row end to end, each attending only to "
                            "itself (GPT, Llama, dense or MoE); false = one record per row, padded.")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        for r in self.skip_batches:
            if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] <= r[1]):
                errs.append(("skip_batches", f"each entry must be [first, last] with 0 <= first <= last, got {r!r}"))
        if self.max_bytes < 0:
            errs.append(("max_bytes", "must be >= 0"))
        elif self.max_bytes and self.format == "instruction":
            errs.append(("max_bytes", "caps the text of format 'text' data; instruction data reads every record: "
                                      "set it to 0"))
        if not 0.0 <= self.val_fraction < 1.0:
            errs.append(("val_fraction", f"must be in [0, 1), got {self.val_fraction!r}"))
        if self.tokenizer == "bpe" and self.bpe_vocab_size < 257:
            errs.append(("bpe_vocab_size", "must be > 256"))
        if not self.text_key:
            errs.append(("text_key", "must not be empty"))
        for key in ("prompt_key", "response_key"):
            if not getattr(self, key):
                errs.append((key, "must not be empty"))
        if self.prompt_key and self.prompt_key == self.response_key:
            errs.append(("response_key", f"must differ from data.prompt_key={self.prompt_key!r}"))
        return errs

    @property
    def packed(self) -> bool:
        """Whether rows hold several documents each (instruction data with data.pack): the model must keep them
        apart (`models.get(..., documents=True)`)."""
        return self.format == "instruction" and self.pack


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adam", "sgd", "lion", "adafactor"] = doc("adamw", "Any of these optax optimizers.")
    lr: float = doc(1e-3, "Peak learning rate.")
    warmup_steps: int = doc(50, "Linear warm-up steps from 0 to lr.")
    schedule: Literal["cosine", "constant", "linear"] = doc("cosine", "Decay after warm-up, down to lr * min_lr_ratio.")
    min_lr_ratio: float = doc(0.1, "Final learning rate as a fraction of lr.")
    b1: float = doc(0.9, "Adam/Lion beta1 (SGD momentum).")
    b2: float = doc(0.95, "Adam/Lion beta2.")
    eps: float = doc(1e-8, "Adam epsilon.")
    weight_decay: float = doc(0.1, "Decoupled weight decay (adamw, lion).")
    grad_clip: float = doc(1.0, "Clip gradients to this global norm (0 = off).")
    state_dtype: Literal["float32", "bfloat16"] = doc("float32", "Dtype the optimizer's state is stored in "
                                                      "(bfloat16 halves its bytes; the update computes in float32).")
    host_kernel: bool = doc(True, "Update host-resident stages of Adam/AdamW/Lion with the fused C++ "
                                  "kernel, built on first use with the system's g++; XLA's update where it cannot be.")
    master_weights: bool = doc(False, "With model.param_dtype=bfloat16: keep a float32 master copy of the "
                                      "parameters in the optimizer state; the update runs on it and the parameters "
                                      "are its rounding (mixed precision: 2 B per parameter to compute with and "
                                      "stream, 4 B more of optimizer state).")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        if not math.isfinite(self.lr) or self.lr <= 0:
            errs.append(("lr", f"must be a finite number > 0, got {self.lr}"))
        if self.warmup_steps < 0:
            errs.append(("warmup_steps", "must be >= 0"))
        if not 0 <= self.min_lr_ratio <= 1:
            errs.append(("min_lr_ratio", "must be in [0, 1]"))
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:
                errs.append((key, "must be in [0, 1)"))
        if self.eps <= 0:
            errs.append(("eps", "must be > 0"))
        if self.weight_decay < 0 or self.grad_clip < 0:
            errs.append(("weight_decay" if self.weight_decay < 0 else "grad_clip", "must be >= 0"))
        return errs


@dataclass
class TrainConfig:
    steps: int = doc(1000, "Optimizer steps to train for.")
    batch_size: int = doc(16, "Global batch size in sequences.")
    micro_batch_size: int = doc(0, "Sequences per micro-batch on each data-parallel rank (gradient accumulation); "
                                   "0 = the whole local batch in one go.")
    seed: int = doc(0, "Seed of parameter initialisation.")
    run_dir: str = doc("", "Run directory (config, metrics, checkpoints); empty = runs/<config name>.")
    log_every: int = doc(10, "Write metrics every this many steps (step 1 is always logged).")
    progress: bool = doc(True, "Show progress on process 0: a bar on a terminal, else a plain line every log_every "
                               "steps and at least every 30 s.")
    resume: bool = doc(True, "Resume from the newest checkpoint in the run directory if there is one.")
    allow_data_change: bool = doc(False, "Resume even when the tokenizer or the training data's content differ from "
                                         "what the checkpoint recorded (a resume on other data is refused otherwise).")
    eval_every: int = doc(0, "Evaluate the validation loss every this many steps, and after the last (0 = off).")
    eval_batches: int = doc(4, "Validation batches of batch_size sequences per evaluation: the same first ones of "
                               "the val split every time.")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        for key in ("steps", "batch_size", "log_every"):
            if getattr(self, key) <= 0:
                errs.append((key, "must be > 0"))
        for key in ("eval_every", "eval_batches"):
            if getattr(self, key) < 0:
                errs.append((key, f"must be >= 0, got {getattr(self, key)}"))
        if self.eval_every > 0 and self.eval_batches == 0:
            errs.append(("eval_batches", f"must be > 0 when eval_every={self.eval_every} asks for evaluation"))
        if self.micro_batch_size < 0:
            errs.append(("micro_batch_size", f"must be >= 0 (0 = the whole batch in one go), got "
                                             f"{self.micro_batch_size}"))
        elif self.micro_batch_size and self.batch_size > 0 and self.batch_size % self.micro_batch_size:
            errs.append(("micro_batch_size", f"train.batch_size={self.batch_size} is not a multiple of "
                                             f"train.micro_batch_size={self.micro_batch_size}"))
        return errs

    def micro_batches(self, ranks: int = 1) -> int:
        """Micro-batches per step: batch_size = micro-batches x micro_batch_size x `ranks` (data-parallel ranks:
        processes x devices); 1 when micro_batch_size is 0. A batch that does not split so is a ConfigError
        naming both keys."""
        if not self.micro_batch_size:
            return 1
        if self.batch_size % (self.micro_batch_size * ranks):
            raise ConfigError(f"'train.batch_size'={self.batch_size} must be a multiple of 'train.micro_batch_size'"
                              f"={self.micro_batch_size} x {ranks} data-parallel ranks (devices) = "
                              f"{self.micro_batch_size * ranks}")
        return self.batch_size // (self.micro_batch_size * ranks)


@dataclass
class LoggingConfig:
    tensorboard: bool = doc(False, "Also write TensorBoard event files to <run_dir>/tb.")
    jsonl: str = doc("metrics.jsonl", "Metrics file name inside the run directory (always written).")
    loss_curve: bool = doc(True, "Keep <run_dir>/loss.png, the loss curve, redrawn at evaluations, checkpoints and "
                                 "the end (~1 s of CPU for matplotlib per process, ~0.1 s per drawing).")
    wandb: bool = doc(False, "Also log to Weights & Biases, files in <run_dir>/wandb (pip install "
                             "'angel-jax[wandb]').")
    wandb_project: str = doc("angel-jax", "Weights & Biases project of the run.")
    wandb_mode: Literal["online", "offline", "disabled"] = doc(
        "offline", "W&B mode: offline (the default: a run never waits on a network or a login; `wandb sync` "
                   "uploads it later), online, or disabled.")

    def validate(self) -> list[tuple[str, str]]:
        errs = [] if self.jsonl else [("jsonl", "must not be empty")]
        if not self.wandb_project or re.search(r"[/\\#?%:]", self.wandb_project):
            errs.append(("wandb_project", f"must be a non-empty name without / \\ # ? % :, "
                                          f"got {self.wandb_project!r}"))
        return errs


@dataclass
class MemoryConfig:
    mode: Literal["auto", "in_memory", "paged"] = doc("in_memory", "auto = in-memory when the whole state fits the device.")
    page_size: int = doc(64 * 2**20, "Bytes per page (model state is split into pages of this size).")
    page_fit: bool = doc(True, "Shrink the pages below page_size until the stages' pages hold little padding (a 201 MB "
                               "block on 4 pages of 50 MB, not 4 of 64 MiB): fewer bytes in every tier and link.")
    device_budget: int = doc(0, "Bytes of device memory the paged engine may use (0 = all free HBM).")
    host_budget: int = doc(0, "Bytes of pinned host memory for pages (0 = what this machine has: available RAM "
                                 "less max(2 GiB, 10%)).")
    disk_dir: str = doc("", "Directory of the disk tier (empty = no disk tier).")
    disk_budget: int = doc(0, "Bytes the disk tier may hold (0 = no limit beyond the file system's).")
    disk_io: Literal["auto", "unbuffered", "memmap", "default", "direct"] = doc(
        "auto", "How the disk tier moves page bytes: unbuffered (O_DIRECT, no page-cache copy: the least CPU per "
                "byte), memmap / default / direct (tensorstore's file_io_mode), auto (unbuffered where disk_dir "
                "takes O_DIRECT, else memmap).")
    staleness: int = doc(0, "Paged engine: 0 = exact updates, 1 = lock-free (a stage may use one-step-old parameters).")
    lock_free_from: int = doc(100, "Paged engine, lock-free (staleness 1): the first step that may use one-step-old "
                                   "parameters; the steps before update exactly (a delayed gradient costs the most "
                                   "early in training, at the peak learning rate).")
    passes: int = doc(0, "Paged engine: accumulation passes per step, each running its share of the micro-batches "
                         "layer-major (fewer saved activations, streamed stages fetched once per pass); 0 = the "
                         "planner chooses.")
    streamed_updates: Literal["auto", "host", "device"] = doc(
        "auto", "Paged engine: where streamed stages whose pages live in host memory update: host (the CPU), device "
                "(their optimizer state crosses the link and back, exact), or auto (the faster predicted; the host "
                "on the CPU backend).")
    activations: Literal["auto", "device", "host"] = doc(
        "auto", "Paged engine: where stage inputs saved for the backward wait: device, host (pinned host memory: "
                "each crosses to the host after its forward and back before its backward, so a batch needs no "
                "accumulation passes that fetch every stage again), or auto (the faster predicted; the device on "
                "the CPU backend).")
    overlap: bool = doc(True, "Paged engine: false runs every copy, disk transfer, computation and update alone, "
                              "each waited for before the next starts: the baseline that shows what overlap "
                              "gains (slow; exact updates only).")
    accelerator_path: bool = doc(False, "Paged engine on the CPU backend: run host updates the way an accelerator "
                                        "does (pages copied to the compute device and back, never updated in "
                                        "place; ZeRO-3 shard by shard), for tests of that code; slower.")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.page_size < 4096:
            errs.append(("page_size", "must be >= 4096 bytes"))
        if self.staleness not in (0, 1):
            errs.append(("staleness", "must be 0 (exact) or 1 (lock-free)"))
        if not self.overlap and self.staleness:
            errs.append(("overlap", "false runs every update in turn, which is exact: it needs staleness 0"))
        if self.lock_free_from < 0:
            errs.append(("lock_free_from", "must be >= 0 (0 = lock-free from the first step)"))
        if self.passes < 0:
            errs.append(("passes", "must be >= 0 (0 = the planner chooses)"))
        if self.activations not in ("auto", "host", "device"):
            errs.append(("activations", f"must be auto, host or device, got {self.activations!r}"))
        if self.streamed_updates not in ("auto", "host", "device"):
            errs.append(("streamed_updates", f"must be auto, host or device, got {self.streamed_updates!r}"))
        for key in ("device_budget", "host_budget", "disk_budget"):
            if getattr(self, key) < 0:
                errs.append((key, "must be >= 0"))
        return errs


@dataclass
class MeshConfig:
    data: int = doc(0, "Data-parallel replicas of the training state; 0 = the device count / fsdp.")
    fsdp: int = doc(1, "Devices each replica's parameters and optimizer state are sharded over (ZeRO-3 / FSDP, "
                       "in-memory engine); 1 = replicated on every device, 0 = all devices / data.")

    def validate(self) -> list[tuple[str, str]]:
        return [(key, f"must be >= 0 (0 = derived from the device count), got {getattr(self, key)}")
                for key in ("data", "fsdp") if getattr(self, key) < 0]

    def shape(self, devices: int) -> tuple[int, int]:
        """(data, fsdp) for `devices` devices, their product: a 0 takes what the other leaves (both 0: all
        devices to fsdp). A split of the devices that does not come out whole is a ConfigError naming the keys."""
        data, fsdp = self.data, self.fsdp
        if not data and not fsdp:
            return 1, devices
        data, fsdp = data or devices // fsdp, fsdp or devices // data
        if data * fsdp != devices:
            raise ConfigError(f"'mesh.data'={self.data} x 'mesh.fsdp'={self.fsdp} does not split the {devices} "
                              f"devices of this run (their product, with 0 = what the other leaves, must be "
                              f"{devices})")
        return data, fsdp


@dataclass
class CheckpointConfig:
    every: int = doc(100, "Save a checkpoint every this many steps (0 = only at the end).")
    keep: int = doc(2, "Keep this many newest checkpoints in every tier (memory, peer, persistent).")
    keep_every: int = doc(0, "Also keep every persisted step divisible by this (0 = off): a long-term history.")
    at_end: bool = doc(True, "Save a checkpoint after the last step.")
    memory_dir: str = doc("", "Memory tier (a RAM-backed directory, private to this user); empty = /dev/shm/angel_jax-<uid>/<run id>. "
                              "'{node}' in it stands for the node's name (SLURMD_NODENAME): one tier per node on a shared path.")
    peer_dir: str = doc("", "Where each snapshot is copied in the background (a peer host's mount); empty = none.")
    peer_network: str = doc("auto", "Copy each snapshot to the next node's memory over TCP: 'auto' (when the launcher runs the "
                                    "job across the nodes of a Slurm allocation and peer_dir is empty), 'always' or 'never'.")
    peer_max_bytes: int = doc(0, "Most bytes of peer copies one receiver holds for the run (0 = no fixed limit; in RAM it "
                                 "always leaves 2 GiB available).")
    peer_timeout: float = doc(30.0, "Seconds a peer copy's connect, send or receive may wait on the other node before the "
                                    "copy is given up (training goes on).")
    peer_port: int = doc(0, "TCP port of process p's peer-copy receiver: this + p (0 = any free port; the processes tell "
                            "each other theirs).")
    verify_on_restore: bool = doc(True, "Check every array's XXH3-64 checksum before resuming from it.")
    max_persist_failures: int = doc(3, "Stop the run (exit status 78) once this many saves in a row failed to reach "
                                       "the persistent tier (0 = never stop).")
    on_signal: bool = doc(True, "On SIGTERM or SIGINT, finish the step in flight, save a checkpoint of it and exit "
                                "143 / 130 (false: stop at once, without a save).")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.every < 0:
            errs.append(("every", "must be >= 0"))
        if self.keep <= 0:
            errs.append(("keep", "must be > 0"))
        for key in ("keep_every", "max_persist_failures", "peer_max_bytes"):
            if getattr(self, key) < 0:
                errs.append((key, "must be >= 0"))
        if self.peer_network not in ("auto", "always", "never"):
            errs.append(("peer_network", f"must be auto, always or never, got {self.peer_network!r}"))
        elif self.peer_network == "always" and self.peer_dir:
            errs.append(("peer_network", "'always' and checkpoint.peer_dir are two peer tiers: give one"))
        if not self.peer_timeout > 0:
            errs.append(("peer_timeout", "must be > 0"))
        if not 0 <= self.peer_port <= 65535:
            errs.append(("peer_port", "must be 0 (any free port) or a TCP port"))
        return errs


@dataclass
class ResilienceConfig:
    heartbeat_interval: float = doc(1.0, "Seconds between heartbeats a worker sends to the coordinator.")
    hang_timeout_min: float = doc(60.0, "Never declare a hang before this many seconds without progress.")
    max_restarts: int = doc(5, "Restarts allowed before the job ends in 'failed'.")
    hang_factor: float = doc(10.0, "While training, a hang is max(hang_timeout_min, this x the p95 observed step time) "
                                   "without step progress.")
    slow_phase_timeout: float = doc(1800.0, "Hang timeout (s) while starting, compiling, restoring, checkpointing, "
                                            "evaluating or finishing: phases with no step progress by nature.")
    heartbeat_lost_after: float = doc(10.0, "Seconds without any message from a worker before a heartbeat_lost "
                                            "event (a warning: hangs are judged by step progress).")
    stop_grace: float = doc(10.0, "Seconds between SIGTERM and SIGKILL when the group is stopped.")
    preempt_grace: float = doc(60.0, "When the watchdog itself gets SIGTERM or SIGINT: seconds the workers have to "
                                     "save a checkpoint of a step they agree on before SIGKILL; keep it below the "
                                     "scheduler's grace period.")
    no_progress_limit: int = doc(2, "Restarts in a row that get no step past the best reached so far before the "
                                    "job ends in 'failed' (0 = no limit).")
    exclude_after: int = doc(2, "Failures blamed on the same node before it is replaced by a spare (0 = never).")
    crash_settle: float = doc(5.0, "Seconds a crash that looks like the consequence of a peer's (a broken "
                                   "collective, an abort) waits for the exit of the worker that caused it, so the "
                                   "failure is charged to that one (0 = charge the first exit).")
    compile_cache: bool = doc(True, "Use JAX's persistent compilation cache, so restarts skip recompilation.")
    compile_cache_dir: str = doc("", "Where the compilation cache lives; empty = <run_dir>/compile_cache.")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        for key in ("heartbeat_interval", "hang_timeout_min", "slow_phase_timeout", "heartbeat_lost_after"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) <= 0:
                errs.append((key, "must be a finite number > 0"))
        if not math.isfinite(self.hang_factor) or self.hang_factor < 1:
            errs.append(("hang_factor", "must be >= 1 (a hang is longer than a step)"))
        for key in ("stop_grace", "preempt_grace", "crash_settle"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 0:
                errs.append((key, "must be >= 0"))
        if self.heartbeat_lost_after <= self.heartbeat_interval:
            errs.append(("heartbeat_lost_after", f"must be longer than heartbeat_interval={self.heartbeat_interval}"))
        for key in ("max_restarts", "no_progress_limit", "exclude_after"):
            if getattr(self, key) < 0:
                errs.append((key, "must be >= 0"))
        return errs


@dataclass
class AnomalyDetectionConfig:
    enabled: bool = doc(True, "Run the anomaly detectors on every step's figures (TEE).")
    actions: dict = doc({}, "Detector -> action overrides, e.g. {loss_spike: log}. Detectors: nan, loss_spike, "
                            "grad_spike, update_spike, step_time, straggler, memory_growth; actions: log, "
                            "skip, rollback, restart, exclude.")
    thresholds: AnomalyConfig = sub(AnomalyConfig, "Detector thresholds (defaults: no false alarm on clean runs).")
    max_consecutive_skips: int = doc(20, "Stop the run after this many updates in a row were dropped.")
    max_rollbacks: int = doc(3, "Stop the run after this many rollbacks without reaching a new checkpoint.")

    def validate(self) -> list[tuple[str, str]]:


        errs = [("thresholds." + key, problem) for key, problem in self.thresholds.validate()]
        try:
            policy = ActionPolicy.from_dict(self.actions)
        except ValueError as e:
            return errs + [("actions", str(e))]
        # These detectors judge figures that differ between processes (time, memory, one rank): acting on them
        # inside the step loop would split a data-parallel group. They may log, restart or exclude.
        for name in ("step_time", "straggler", "memory_growth"):
            if policy.action_for(name) in (Action.SKIP, Action.ROLLBACK):
                errs.append((f"actions.{name}", f"{name} cannot be {policy.action_for(name).value!r}: "
                                                 "use log, restart or exclude"))
        if self.max_consecutive_skips < 1:
            errs.append(("max_consecutive_skips", "must be >= 1"))
        if self.max_rollbacks < 0:
            errs.append(("max_rollbacks", "must be >= 0"))
        return errs


@dataclass
class Config:
    name: str = doc("run", "Run name (defaults to the config file's stem).")
    model: ModelConfig = sub(ModelConfig, "The model.")
    data: DataConfig = sub(DataConfig, "Training data.")
    optimizer: OptimizerConfig = sub(OptimizerConfig, "Optimizer and learning-rate schedule.")
    train: TrainConfig = sub(TrainConfig, "The training loop.")
    logging: LoggingConfig = sub(LoggingConfig, "Metrics sinks.")
    memory: MemoryConfig = sub(MemoryConfig, "Where model state lives (paged engine).")
    mesh: MeshConfig = sub(MeshConfig, "How the devices are laid out: data-parallel replicas x FSDP shards.")
    checkpoint: CheckpointConfig = sub(CheckpointConfig, "Checkpoints.")
    resilience: ResilienceConfig = sub(ResilienceConfig, "Watchdog: heartbeats, restarts.")
    anomaly: AnomalyDetectionConfig = sub(AnomalyDetectionConfig, "Anomaly detection and the actions it takes.")

    def validate(self) -> list[tuple[str, str]]:
        errs = []
        if self.data.tokenizer == "byte" and self.model.vocab_size < 256:
            errs.append(("model.vocab_size", "must be >= 256 for the byte tokenizer"))
        if self.data.tokenizer == "bpe" and self.model.vocab_size < self.data.bpe_vocab_size:
            errs.append(("model.vocab_size", f"must be >= data.bpe_vocab_size={self.data.bpe_vocab_size}"))
        if self.data.format == "instruction" and self.model.name == "t5":
            errs.append(("data.format", "'instruction' data scores the response's tokens of each row, but "
                                        "model.name 't5' trains on span corruption, which makes its own targets "
                                        "from the whole row: use format 'text' for T5, or a decoder (gpt, llama)"))
        if self.data.tokenizer == "hf" and not (self.data.tokenizer_path or self.model.init_from):
            errs.append(("data.tokenizer_path", "must name a directory with tokenizer.json for data.tokenizer 'hf' "
                                                "(empty takes model.init_from's, which is empty too)"))
        if self.optimizer.master_weights and self.model.param_dtype == "float32":
            errs.append(("optimizer.master_weights", "keeps a float32 copy of parameters stored narrower: it needs "
                                                     "model.param_dtype=bfloat16 (float32 parameters are their own "
                                                     "master)"))
        return errs

    @property
    def run_dir(self) -> Path:
        return Path(self.train.run_dir or f"runs/{self.name}")


# --------------------------------------------------------------------------------------------- loading

_HANG_KEYS = "resilience.hang_timeout_min, resilience.hang_factor and resilience.slow_phase_timeout"

RETIRED: dict[str, str] = {
    "optimizer.staleness": "moved to 'memory.staleness'",
    "anomaly.thresholds.hang": f"was removed: nothing fed that detector; the watchdog judges hangs by {_HANG_KEYS}",
    "anomaly.actions.hang": f"was removed: a hang always restarts the group (and counts towards "
                            f"resilience.exclude_after for its node); its timeouts are {_HANG_KEYS}",
}
"""Dotted keys that no longer exist -> what to use instead; refused by name (in a file or an override)."""


def _coerce(value: Any, tp: Any, key: str, origin: str) -> Any:
    """Check `value` against the annotation `tp`; the only conversion is int -> float."""
    return typed(value, tp, f"{key!r} in {origin}")


def _build(cls: type, raw: Any, prefix: str, origin: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'!r} in {origin}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if dotted in RETIRED:
            raise ConfigError(f"{dotted!r} {RETIRED[dotted]} (in {origin})")
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"did you mean '{prefix}{close[0]}'? " if close else ""
            raise ConfigError(f"unknown key {dotted!r} in {origin}; {hint}known keys here: {', '.join(sorted(names))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, f"{dotted}.", origin)
        else:
            kwargs[key] = _coerce(value, tp, dotted, origin)
            for inner in kwargs[key] if isinstance(kwargs[key], dict) else ():
                if f"{dotted}.{inner}" in RETIRED:  # a key inside a free-form mapping (anomaly.actions)
                    raise ConfigError(f"'{dotted}.{inner}' {RETIRED[f'{dotted}.{inner}']} (in {origin})")
    return cls(**kwargs)


def merge_dicts(base: dict, updates: dict) -> dict:
    """`base` with `updates` merged in, nested dicts key by key."""
    out = dict(base)
    for key, value in updates.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_dicts(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict:
    """'optimizer.lr=3e-4' -> {'optimizer': {'lr': 0.0003}}; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} on the command line: expected key=value (e.g. train.steps=200)")
    key, _, raw = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} on the command line: malformed key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key!r} on the command line: cannot parse value {raw!r}: {e}") from None
    # YAML 1.1 reads '3e-4' as a string; accept numeric strings as numbers.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            pass
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _validate_all(cfg: Config, origin: str) -> None:
    sections = [("", cfg)] + [(f.name + ".", getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                              if dataclasses.is_dataclass(getattr(cfg, f.name))]
    for prefix, section in sections:
        for key, problem in section.validate():
            raise ConfigError(f"'{prefix}{key}' in {origin}: {problem}")


def config_from_dict(raw: dict, origin: str = "config") -> Config:
    cfg = _build(Config, raw, "", origin)
    _validate_all(cfg, origin)
    return cfg


def upgrade_recorded(raw: dict) -> tuple[dict, list[str]]:
    """A run directory's config.yaml as an earlier version wrote it (every key, retired ones included) in today's
    form: a moved key goes to its new place, a removed one is dropped. Returns (raw, what was changed). Only for
    configs this project wrote itself; a user's config with a retired key is refused by name."""
    raw = copy.deepcopy(raw)
    changed = []
    for dotted, why in RETIRED.items():
        *parents, leaf = dotted.split(".")
        node = raw
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        value = node.pop(leaf)
        moved = re.fullmatch(r"moved to '([\w.]+)'", why)
        if moved:
            *to_parents, to_leaf = moved.group(1).split(".")
            target = raw
            for key in to_parents:
                target = target.setdefault(key, {})
            target.setdefault(to_leaf, value)
        changed.append(f"{dotted} {why}")
    return raw, changed


def load_recorded_config(path: str | Path) -> Config:
    """The resolved config a run recorded in its directory (config.yaml), written by this or an earlier version."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a readable config: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw, changed = upgrade_recorded(raw)
    for note in changed:
        log.info("%s (written by an earlier version): %s", path, note)
    return config_from_dict(raw, str(path))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML file (or defaults when None) and apply dotted overrides; strict."""
    raw: dict = {}
    origin = "defaults"
    if path is not None:
        path = Path(path)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8): a config is YAML text") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
        raw.setdefault("name", path.stem)
    # Report a bad file before applying overrides so the message points at the file.
    _build(Config, raw, "", origin)
    for text in overrides:
        upd = parse_override(text)
        _build(Config, merge_dicts(raw, upd), "", f"{origin} + override {text!r}")
        raw = merge_dicts(raw, upd)
    where = origin if not overrides else f"{origin} with overrides {' '.join(overrides)}"
    return config_from_dict(raw, where)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe(cls: type = Config, prefix: str = "") -> list[str]:
    """One line per key: 'model.d_model (int, default 128): Residual stream width.'"""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines += describe(tp, f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"{prefix}{f.name} ({type_name(tp)}, default {default!r}): {f.metadata.get('doc', '')}")
    return lines

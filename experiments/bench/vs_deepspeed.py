"""angel_jax's paged engine against DeepSpeed ZeRO-Infinity on the same GPT, alternately, under the same RSS cap.

    python experiments/bench/vs_deepspeed.py --setup                  # DeepSpeed's own venv (.venv-deepspeed/)
    python experiments/bench/vs_deepspeed.py --dry                    # both systems on a tiny model (self-check)
    python experiments/bench/vs_deepspeed.py --blocks 8 --dtype fp32 bf16 --rounds 2 --write

The model is scale.py's GPT (experiments/gpt_tiny.yaml at d_model 2048, 16 heads, seq_len 128, batch 1, vocab
256, MLP 4 x d_model, untied head, blocks rematerialised, AdamW); --blocks sets n_layers. The two systems:

  angel_jax  `angel-jax train` on a config this script writes: memory.mode=paged, the disk tier in the run's own
             directory, memory.device_budget / host_budget from --device-budget-gib / --host-budget-gib (the
             issue's 1 / 4 GiB by default), evaluation and checkpoints off, memory.lock_free_from 0 (with
             --angel-set memory.staleness=1, lock-free from the first step); step times from its metrics.jsonl
  deepspeed  the same GPT written in torch (below; its parameter count is printed next to angel_jax's and must
             agree within 1%), DeepSpeed ZeRO stage 3 on its CPU accelerator (DS_ACCELERATOR=cpu, gloo, one
             rank), parameters and optimizer state offloaded to NVMe through its async I/O op (the run's own
             directory), DeepSpeedCPUAdam (AdamW), activation checkpointing (torch.utils.checkpoint per block),
             parameter prefetch off (stage3_prefetch_bucket_size 0: with prefetch and activation checkpointing
             DeepSpeed 0.19.8 asserts "param already assigned swap buffer"). Run by .venv-deepspeed's Python.

fp32 is float32 compute on both; bf16 is DeepSpeed's bf16 mode (bf16 parameters, float32 master and moments) and
the same recipe in angel_jax: model.compute_dtype=bfloat16, model.param_dtype=bfloat16, optimizer.master_weights
(the float32 master in the optimizer state). Per round, every (blocks, dtype) runs both
systems one after the other, the order flipped each round, so drift on a shared machine falls on both.

Each run is a child process (nice 10) polled every 0.2 s by this script: the RSS of its process tree, the bytes
under its disk directory and the machine's 1-minute load average. The RSS cap is this watcher's (SIGKILL of the
tree past --cap-gib): RLIMIT_AS does not suit JAX, which reserves far more address space than it touches, and a
cgroup memory limit (this VM has cgroup v1) charges the page cache too, which would penalise whichever system
writes through it rather than with O_DIRECT. Peak RSS is the larger of the polled figure and the child's own
ru_maxrss (os.wait4); a run whose peak passed the cap between two polls is failed too (`ok` false, `why_not`
says so), though it ran to the end. Each run's directory is removed afterwards. Every run does --warmup + --steps + 1 steps;
the step time is the median of the --steps after the warm-up (the last step is left out on both sides: the
paged engine's last step time leaves out its own updates, which drain after it). angel_jax's step times are the
intervals between consecutive steps in its metrics.jsonl, DeepSpeed's the child's own per-step wall times.

One JSON line per run on stdout; appended to experiments/results/vs_deepspeed_cpu.jsonl with --write.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "gpt_tiny.yaml"
DS_VENV = ROOT / ".venv-deepspeed"
PY311 = Path("/root/.pyenv/versions/3.11.7/bin/python3")
TORCH_VERSION, DEEPSPEED_VERSION = "2.14.1", "0.19.8"
GIB = 1 << 30
SYSTEMS = ("deepspeed", "angel_jax")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SHAPE = {"d_model": 2048, "n_heads": 16, "seq_len": 128, "batch_size": 1, "vocab_size": 256, "mlp_ratio": 4.0}
DRY_SHAPE = {**SHAPE, "d_model": 128, "n_heads": 4}
"""--dry: the same recipe at d_model 128."""
OPTIMIZER = {"lr": 3e-3, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
"""gpt_tiny.yaml's AdamW and angel_jax's default betas / eps, given to both systems."""


# ------------------------------------------------------------------------------------------------ setup


def setup(venv: Path = DS_VENV) -> None:
    """DeepSpeed's own environment: Python 3.11 venv, torch, deepspeed, ninja; libaio-dev for its async I/O op;
    the ops it JIT-builds (async_io, cpu_adam, the shared-memory comm op) built once here, so no measured run
    compiles them."""
    if not Path("/usr/include/libaio.h").exists():
        if os.geteuid() != 0:
            raise SystemExit("libaio-dev is missing (DeepSpeed's async I/O op needs it): apt-get install libaio-dev")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libaio-dev"], check=True)
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([str(PY311), "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
    subprocess.run(pip + [f"deepspeed=={DEEPSPEED_VERSION}", "ninja"], check=True)
    ops = ("AsyncIOBuilder", "CPUAdamBuilder", "ShareMemCommBuilder")
    build = ("from deepspeed.accelerator import get_accelerator as g; a = g(); assert a._name == 'cpu', a._name; "
             f"[a.create_op_builder(n).load() for n in {ops!r}]; print('ops built')")
    subprocess.run([str(python), "-c", build], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})


# ------------------------------------------------------------------------------------------------ DeepSpeed child


def torch_gpt(shape: dict, n_layers: int):
    """models/gpt.py's GPT in torch: token + learned position embeddings, pre-norm blocks (LayerNorm with bias,
    fused qkv and output projections with biases, causal attention, tanh-GELU MLP with biases), final LayerNorm,
    untied unembedding without bias, float32 logits. Blocks rematerialised in the backward."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    d, h, eps = shape["d_model"], shape["n_heads"], 1e-5
    hidden = int(shape["mlp_ratio"] * d)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_attn, self.qkv, self.attn_out = nn.LayerNorm(d, eps=eps), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln_mlp, self.mlp_in = nn.LayerNorm(d, eps=eps), nn.Linear(d, hidden)
            self.mlp_out = nn.Linear(hidden, d)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln_attn(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + self.attn_out(attn)
            return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(shape["vocab_size"], d)
            self.positions = nn.Parameter(torch.zeros(shape["seq_len"], d))
            self.blocks = nn.ModuleList(Block() for _ in range(n_layers))
            self.ln, self.unembed = nn.LayerNorm(d, eps=eps), nn.Linear(d, shape["vocab_size"], bias=False)

        def forward(self, batch):
            inputs, targets = batch[:, :-1], batch[:, 1:]
            x = self.tokens(inputs) + self.positions[: inputs.shape[1]]
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
            logits = self.unembed(self.ln(x)).float()
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return GPT


def ds_config(spec: dict, disk: Path, largest: int) -> dict:
    """ZeRO-Infinity: stage 3, parameters and optimizer state on NVMe, CPUAdam, prefetch off, reuse bounded."""
    o = OPTIMIZER
    return {
        "train_micro_batch_size_per_gpu": spec["shape"]["batch_size"], "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": o["lr"], "betas": [o["b1"], o["b2"]], "eps": o["eps"],
                                                  "weight_decay": o["weight_decay"]}},
        "gradient_clipping": o["grad_clip"],
        "bf16": {"enabled": spec["dtype"] == "bf16"},
        "zero_optimization": {
            "stage": 3,
            # buffer_size: elements per swap buffer, at least the largest parameter (an MLP matrix)
            "offload_param": {"device": "nvme", "nvme_path": str(disk), "pin_memory": False, "buffer_count": 8,
                              "buffer_size": largest},
            # Keep a fetched parameter only when it is used again within one MLP matrix's worth of parameters (the
            # last block's, recomputed at once in the backward). With the default (1e9 elements) DeepSpeed 0.19.8
            # stopped at 48 blocks in its parameter swapper ("Not enough buffers 0 for swapping 1"); the swapper
            # runs out when more parameters are kept for reuse than it has buffers.
            "stage3_max_reuse_distance": largest,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(disk), "pin_memory": False, "buffer_count": 4},
            "stage3_prefetch_bucket_size": 0,
            "sub_group_size": int(1e8),  # optimizer state swapped in 1e8-element groups, not the 1e9 default
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }


def deepspeed_child(spec: dict) -> dict:
    """Train the torch GPT with DeepSpeed for spec['total_steps'] steps; step times, losses, counts, versions."""
    import socket as _socket

    with _socket.socket() as s:  # a free port for the one-rank gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    import torch

    shape, n_layers, disk = spec["shape"], spec["blocks"], Path(spec["disk"])
    d = shape["d_model"]
    largest = max(d * int(shape["mlp_ratio"] * d), shape["vocab_size"] * d)
    cfg = ds_config(spec, disk, largest)
    deepspeed.init_distributed(dist_backend="gloo")
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device="nvme", pin_memory=False):
        model = torch_gpt(shape, n_layers)()
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape["vocab_size"], (shape["batch_size"], shape["seq_len"] + 1), generator=gen)
    times, losses = [], []
    for _ in range(spec["total_steps"]):
        t0 = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "loss": losses, "params": params, "ds_config": cfg,
            "optimizer": type(engine.basic_optimizer).__name__, "accelerator": deepspeed.get_accelerator()._name,
            "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__}}


# ------------------------------------------------------------------------------------------------ angel_jax


def angel_overrides(spec: dict, scratch: Path, args: argparse.Namespace) -> dict[str, object]:
    """The keys this benchmark sets on experiments/gpt_tiny.yaml."""
    import yaml

    s = spec["shape"]
    return {
        "model.d_model": s["d_model"], "model.n_heads": s["n_heads"], "model.seq_len": s["seq_len"],
        "model.vocab_size": s["vocab_size"], "model.mlp_ratio": s["mlp_ratio"], "model.n_layers": spec["blocks"],
        "model.compute_dtype": DTYPES[spec["dtype"]], "model.param_dtype": DTYPES[spec["dtype"]], "model.remat": True,
        "optimizer.master_weights": spec["dtype"] != "fp32",
        "model.tie_embeddings": False,
        "optimizer.name": "adamw", **{f"optimizer.{k}": v for k, v in OPTIMIZER.items()},
        "train.batch_size": s["batch_size"], "train.steps": spec["total_steps"], "train.log_every": 1,
        "train.eval_every": 0, "train.progress": False, "train.resume": False, "train.run_dir": str(scratch / "run"),
        "checkpoint.every": 0, "checkpoint.at_end": False, "checkpoint.memory_dir": str(scratch / "ckpt_mem"),
        "memory.mode": "paged", "memory.disk_dir": str(scratch / "disk"),
        "memory.device_budget": int(args.device_budget_gib * GIB),
        "memory.host_budget": int(args.host_budget_gib * GIB),
        "memory.lock_free_from": 0,  # (a run of a few steps: lock-free, where asked, from its first step)
        **{k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.angel_set)},  # "1" -> 1, as YAML
    }


def write_angel_config(spec: dict, scratch: Path, args: argparse.Namespace) -> Path:
    """gpt_tiny.yaml with this run's keys set, written to the run's directory (what `angel-jax train` reads)."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    for key, value in angel_overrides(spec, scratch, args).items():
        section, name = key.split(".")
        cfg.setdefault(section, {})[name] = value
    path = scratch / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def angel_params(spec: dict) -> int:
    """angel_jax's parameter count of the run's model, from its config alone."""
    import models
    from angel_jax.config import load_config

    s = spec["shape"]
    cfg = load_config(CONFIG, [f"model.d_model={s['d_model']}", f"model.n_heads={s['n_heads']}",
                               f"model.seq_len={s['seq_len']}", f"model.n_layers={spec['blocks']}",
                               f"model.mlp_ratio={s['mlp_ratio']}", f"model.vocab_size={s['vocab_size']}"])
    return int(models.get(cfg.model).param_count["total"])


def angel_result(scratch: Path) -> dict:
    """Step times and losses from the run's metrics.jsonl (every step logged)."""
    path = scratch / "run" / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])
    # Each step's own time: the interval between two logged steps (`time` is when a step's figures were taken).
    # perf/step_time is a mean over the last steps, which in a run of a few steps still holds the slow first ones.
    intervals = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    return {"step_s": [rows[0].get("perf/first_step_time") if rows else None, *intervals],
            "loss": [r["loss"] for r in rows]}


# ------------------------------------------------------------------------------------------------ the parent


def dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def watch(pid: int, cap: int, disk: Path, timeout_s: float, min_free: int) -> dict:
    """Poll a child every 0.2 s until it exits; SIGKILL its process group past the RSS cap, when the machine's
    available memory falls below `min_free`, or after `timeout_s`. Returns the figures and how it ended."""
    import psutil

    ps, t0, peak_rss, peak_disk, loads, killed = psutil.Process(pid), time.monotonic(), 0, 0, [], None
    last_disk = 0.0
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        try:
            rss = sum(p.memory_info().rss for p in [ps, *ps.children(recursive=True)])
        except psutil.Error:
            rss = 0
        peak_rss = max(peak_rss, rss)
        now = time.monotonic()
        if now - last_disk >= 1.0:
            peak_disk, last_disk = max(peak_disk, dir_bytes(disk)), now
            loads.append(os.getloadavg()[0])
        reason = (f"RSS {rss / GIB:.2f} GiB passed the cap {cap / GIB:.2f} GiB" if rss > cap else
                  "machine low on memory (other work)" if psutil.virtual_memory().available < min_free else
                  f"timeout after {timeout_s:.0f} s" if now - t0 > timeout_s else None)
        if reason and not killed:
            killed = reason
            os.killpg(pid, signal.SIGKILL)
        time.sleep(0.2)
    return {"returncode": os.waitstatus_to_exitcode(status), "killed": killed, "peak_rss_polled": peak_rss,
            "child_maxrss": usage.ru_maxrss * 1024, "peak_disk": peak_disk, "loads": loads,
            "wall_s": time.monotonic() - t0}


def child_command(system: str, spec: dict, scratch: Path, args: argparse.Namespace) -> tuple[list[str], dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if system == "deepspeed":
        (scratch / "spec.json").write_text(json.dumps(spec))
        env.update(DS_ACCELERATOR="cpu", PYTHONPATH="")
        return [str(DS_VENV / "bin" / "python"), str(Path(__file__).resolve()), "--child", str(scratch)], env
    env["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "cpu")
    exe = Path(sys.executable).parent / "angel-jax"
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "angel_jax.cli"]
    return cli + ["train", str(write_angel_config(spec, scratch, args))], env


def run_one(system: str, blocks: int, dtype: str, args: argparse.Namespace) -> dict:
    """One capped run of one system; its record."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{system}-{blocks}-{dtype}-", dir=args.scratch))
    (scratch / "disk").mkdir()
    spec = {"blocks": blocks, "dtype": dtype, "shape": DRY_SHAPE if args.dry else SHAPE,
            "total_steps": args.warmup + args.steps + 1, "disk": str(scratch / "disk")}
    cmd, env = child_command(system, spec, scratch, args)
    cap = int(args.cap_gib * GIB)
    with open(scratch / "log.txt", "w") as log:
        proc = subprocess.Popen(["nice", "-n", "10", *cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: the cap kills the whole tree
        w = watch(proc.pid, cap, scratch / "disk", args.timeout_s, int(args.min_free_gib * GIB))
    proc.returncode = w["returncode"]
    child = angel_result(scratch) if system == "angel_jax" else (
        json.loads((scratch / "result.json").read_text()) if (scratch / "result.json").exists() else {})
    times = child.get("step_s") or []
    peak = max(w["peak_rss_polled"], w["child_maxrss"])
    if peak > cap and not w["killed"]:  # the child's own high-water mark passed the cap between two polls
        w["killed"] = f"peak RSS {peak / GIB:.3f} GiB (the child's ru_maxrss) passed the cap {cap / GIB:.2f} GiB"
    ok = w["returncode"] == 0 and not w["killed"] and len(times) == spec["total_steps"]
    measured = times[args.warmup: args.warmup + args.steps] if ok else []
    step = statistics.median(measured) if measured else None
    s = spec["shape"]
    record = {
        "bench": "vs_deepspeed", "system": system, "blocks": blocks, "dtype": dtype,
        "params": child.get("params") if system == "deepspeed" else angel_params(spec),
        **{k: s[k] for k in ("d_model", "n_heads", "seq_len", "batch_size", "vocab_size")}, "ok": ok,
        "why_not": None if ok else (w["killed"] or f"exit status {w['returncode']}: "
                                    + ((scratch / "log.txt").read_text()[-600:].strip().splitlines() or ["?"])[-1]),
        "step_s": round(step, 3) if step else None,
        "tokens_per_s": round(s["batch_size"] * s["seq_len"] / step, 2) if step else None,
        "measured_steps_s": [round(t, 3) for t in measured], "all_steps_s": [round(t, 3) for t in times],
        "warmup_steps": args.warmup, "loss": child.get("loss"),
        "peak_rss_bytes": peak, "peak_rss_polled_bytes": w["peak_rss_polled"],
        "child_maxrss_bytes": w["child_maxrss"], "peak_disk_bytes": w["peak_disk"],
        "cap_bytes": cap, "cap_by": "watcher (RSS of the process tree, polled every 0.2 s)",
        "loadavg_1m_mean": round(statistics.mean(w["loads"]), 2) if w["loads"] else None,
        "loadavg_1m_max": round(max(w["loads"]), 2) if w["loads"] else None, "wall_s": round(w["wall_s"], 1),
        "versions": {**args.versions, **child.get("versions", {})}, "angel_jax": args.tree,
    }
    if system == "deepspeed":
        record.update(ds_config=child.get("ds_config"), optimizer=child.get("optimizer"),
                      accelerator=child.get("accelerator"))
    else:
        record.update(device_budget_gib=args.device_budget_gib, host_budget_gib=args.host_budget_gib,
                      overrides=angel_overrides(spec, scratch, args) | {"train.run_dir": None, "memory.disk_dir": None,
                                                                         "checkpoint.memory_dir": None})
    if args.keep_scratch:
        record["scratch"] = str(scratch)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return record


def ds_versions() -> dict:
    out = subprocess.run([str(DS_VENV / "bin" / "python"), "-c", "from importlib.metadata import version as v; "
                          "import json; print(json.dumps({p: v(p) for p in ('torch', 'deepspeed')}))"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def source_tree() -> dict:
    """The angel_jax the runs measure: the checkout's commit, and the tracked files changed on top of it (the
    working tree is shared: uncommitted engine changes are measured too, and said so)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                             text=True).stdout.split("\n")
    return {"commit": head or None, "changed": sorted(line[3:] for line in changed if line.strip())}


def machine() -> dict:
    from angel_jax.benchinfo import machine_info

    return machine_info()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="build DeepSpeed's environment (.venv-deepspeed/) and exit")
    p.add_argument("--blocks", type=int, nargs="+", default=[8], help="n_layers to run (8 = 0.40 B, 48 = 2.42 B)")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES), help="compute dtypes to run")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--steps", type=int, default=2, help="measured steps per run (after --warmup; one more is run)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps excluded (the first compiles)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the systems")
    p.add_argument("--cap-gib", type=float, default=12.0, help="RSS cap per run, the same for both systems")
    p.add_argument("--device-budget-gib", type=float, default=1.0, help="angel_jax: memory.device_budget")
    p.add_argument("--host-budget-gib", type=float, default=4.0, help="angel_jax: memory.host_budget")
    p.add_argument("--angel-set", action="append", default=[], metavar="KEY=VALUE",
                   help="angel_jax: one more config key, e.g. memory.staleness=1 (repeatable; recorded in overrides)")
    p.add_argument("--min-free-gib", type=float, default=1.0, help="kill a run when the machine's available "
                   "memory falls below this (other work grew)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    p.add_argument("--scratch", default=None, help="where the runs' directories go (default: a temp dir)")
    p.add_argument("--keep-scratch", action="store_true", help="keep each run's directory (logs, configs)")
    p.add_argument("--dry", action="store_true", help="self-check: d_model 128, 1 block, 1 round, cap 4 GiB")
    p.add_argument("--write", action="store_true", help="append to experiments/results/vs_deepspeed_cpu.jsonl")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for kv in args.angel_set:
        if "=" not in kv or "." not in kv.split("=", 1)[0]:
            p.error(f"--angel-set {kv!r}: expected SECTION.KEY=VALUE, e.g. memory.staleness=1")
    if args.child:  # inside .venv-deepspeed: no angel_jax, no jax
        scratch = Path(args.child)
        out = deepspeed_child(json.loads((scratch / "spec.json").read_text()))
        (scratch / "result.json").write_text(json.dumps(out))
        return 0
    if args.setup:
        setup()
        return 0
    if not (DS_VENV / "bin" / "python").exists() and "deepspeed" in args.systems:
        p.error(f"no DeepSpeed environment at {DS_VENV}: run this script with --setup first")
    if args.dry:
        args.blocks, args.rounds, args.cap_gib, args.write = [1], 1, min(args.cap_gib, 4.0), False
    sys.path.insert(0, str(ROOT))
    from importlib.metadata import version

    args.versions = {"jax": version("jax"), "jaxlib": version("jaxlib"),
                     **(ds_versions() if "deepspeed" in args.systems else {})}
    args.tree = source_tree()
    results = ROOT / "experiments" / "results" / "vs_deepspeed_cpu.jsonl" if args.write else None
    own = args.scratch is None
    args.scratch = args.scratch or tempfile.mkdtemp(prefix="angel_vs_ds-")
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    records = []
    try:
        for r in range(args.rounds):
            order = list(args.systems) if r % 2 == 0 else list(reversed(args.systems))
            for blocks in args.blocks:
                for dtype in args.dtype:
                    for system in order:
                        rec = {**run_one(system, blocks, dtype, args), "round": r, "machine": machine()}
                        records.append(rec)
                        print(json.dumps(rec), flush=True)
                        if results is not None:
                            with open(results, "a") as f:
                                f.write(json.dumps(rec) + "\n")
                        if (rec["why_not"] or "").startswith("machine low"):
                            raise SystemExit(f"stopped: {rec['why_not']}; try again later")
    finally:
        if own and not args.keep_scratch:
            shutil.rmtree(args.scratch, ignore_errors=True)
    return summarize(records)


def summarize(records: list[dict]) -> int:
    """Both parameter counts (must agree within 1%) and angel_jax / DeepSpeed step-time ratios, on stderr."""
    bad = 0
    for blocks in sorted({r["blocks"] for r in records}):
        counts = {r["system"]: r["params"] for r in records if r["blocks"] == blocks and r["params"]}
        line = f"{blocks} blocks: parameters " + ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items()))
        if len(counts) == 2:
            diff = abs(counts["angel_jax"] - counts["deepspeed"]) / counts["deepspeed"]
            line += f" (differ by {diff:.3%})"
            bad += diff > 0.01
        print(line, file=sys.stderr)
        for dtype in DTYPES:
            for r in sorted({r["round"] for r in records}):
                pair = {x["system"]: x for x in records if (x["blocks"], x["dtype"], x["round"]) == (blocks, dtype, r)}
                if all(pair.get(s, {}).get("step_s") for s in SYSTEMS):
                    a, d = pair["angel_jax"]["step_s"], pair["deepspeed"]["step_s"]
                    print(f"  {dtype} round {r}: angel_jax {a:.2f} s, DeepSpeed {d:.2f} s per step: angel_jax / "
                          f"DeepSpeed {a / d:.2f}x", file=sys.stderr)
    failed = [r for r in records if not r["ok"]]
    for r in failed:
        print(f"  failed: {r['system']} {r['blocks']} blocks {r['dtype']} round {r['round']}: {r['why_not']}",
              file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())

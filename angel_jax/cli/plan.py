"""`angel-jax plan CONFIG [key=value ...] [--out DIR] [--estimate]`: the scheduling pass without training.

Prints the page table (bytes of each page family on each tier), the predicted step time and the predicted peak
bytes per tier, and writes the predicted timeline (a Gantt chart per stream) as `timeline_predicted.png` and
`.json`, plus `plan.json`, to `--out` (default: the config's run directory). Nothing of the model is allocated:
layouts come from abstract shapes. Stage times are profiled on this machine's first device with zero-filled pages
(the functions training would run), or, with `--estimate`, derived from FLOPs at the target's compute rate and its
links (to plan a GPU run on a machine without that GPU: `--calibration` with the GPU machine's measured figures,
or its peak and links as flags, and the budgets it will have, e.g. memory.device_budget=80e9; train/plan_target.py
says where each figure comes from, and the report names each one's source).

`--estimate --devices N --link-gbps G` plans a data-parallel run of N ranks (ZeRO-3): every page family is
partitioned over the ranks, and the plan is one rank's. Its costs are per rank: a stage's bytes are one rank's
shard (`shard_bytes`: each page split into N equal slices, its length rounded up to a multiple of N elements),
its compute that of the rank's local rows (train.batch_size / N, the global batch), its budgets
memory.device_budget / host_budget / disk_budget (each rank's own tiers). The collectives (an all-gather of every
stage's parameters per access, a reduce-scatter of its gradients per backward) run at G GB/s per rank. Ranks
on several hosts (`--devices-per-node R --inter-node-gbps G2`): G is each rank's link inside its host, G2 its
link to other hosts, the collectives run at the two-level algorithm's figure (schedule/links.py), and the report
adds each host's peak (cli/plan_hosts.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from pathlib import Path

import jax
import numpy as np

from angel_jax.config import Config, ConfigError, config_from_dict, load_config, merge_dicts, parse_override, to_dict
from angel_jax.errors import AngelError
from angel_jax.optim.fused import host_update_by
from angel_jax.train.metrics import device_peak
from angel_jax.cli.plan_args import add_plan_arguments
from angel_jax.cli.plan_hosts import collective_link, host_line, per_host, per_node, refuse_two_level_experts
from angel_jax.train.plan_record import plan_summary, predicted_mfu
from angel_jax.train.plan_target import ASSUMED, PlanTarget, plan_target
from angel_jax.schedule.blueprint import Blueprint, blueprint, page_size_text, refuse_sharded_optimizer
from angel_jax.schedule.budgets import decide, local_batch, micro_batching, micro_sizes, plan_settings, stated_budgets
from angel_jax.schedule.runtime import plan_for
from angel_jax.schedule.staging import DEVICE_UPDATES_IN_FLIGHT
from angel_jax.schedule.timeline import save_pngs
from angel_jax.memory.layout import StageLayout
from angel_jax.schedule.plan import Bandwidths, Budgets, Plan, PlanError, StageCost, exchange_bytes, make_plan
from angel_jax.units import human_bytes
import models


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="angel-jax plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_arguments(p)
    return p


def shard_bytes(stage: StageLayout, ranks: int, apart: bool | None = None) -> int:
    """Bytes of one rank's shard of a stage's pages partitioned over `ranks`: every page split into `ranks` equal
    slices, its length rounded up to a multiple of `ranks` elements (at most ranks - 1 elements of padding per
    page), so every rank holds the same bytes and a rank's shards add up to 1/ranks of the stage and a little
    more. `apart`: only the pages set apart (True: expert weights) or only the others (False)."""
    return sum(-(-p.length // ranks) * p.dtype.itemsize for p in stage.pages if apart is None or p.apart == apart)


def target_ranks(cfg: Config, args: argparse.Namespace) -> int:
    """Data-parallel ranks of the estimated target: --devices, else mesh.data x mesh.fsdp where both are set
    (a 0 there means 'what the machine has', unknown for another machine), else 1."""
    devices = getattr(args, "devices", None)
    if devices is not None:
        if devices < 1:
            raise AngelError(f"--devices must be at least 1, got {devices}")
        return devices
    return cfg.mesh.data * cfg.mesh.fsdp if cfg.mesh.data and cfg.mesh.fsdp else 1


def estimate_costs(cfg: Config, bp: Blueprint, peak_flops: float, device_bw: float, host_bw: float,
                   ranks: int = 1) -> list[StageCost]:
    """Times of one stage call (one micro-batch of train.micro_batch_size rows, or the whole local batch: the
    global batch over `ranks`) from model FLOPs at the device's peak (forward: 2 FLOPs per weight of the stage per
    token, plus attention's QK^T and AV for a block; backward: recompute + 2x forward) and optimizer updates from the bytes they
    touch (parameters and gradients read, optimizer state read and written, parameters written) at memory
    bandwidth. A family that states its stages' forward FLOPs (`PlannerHints.forward_flops_per_row`: an
    encoder-decoder, whose stages see other lengths than seq_len) is timed by those. The weights are counted from
    the stage's page layout, so the family's shapes (grouped-query attention, a gated MLP) count as they are; norms
    and biases, a fraction of a percent, are counted as weights. With several ranks every byte is one rank's shard
    (`shard_bytes`), and so are the updates' and gradient sums' times."""
    m = cfg.model
    rows = micro_batching(cfg, local_batch(cfg, ranks))[1]
    tokens = rows * m.seq_len
    costs = []
    for idx, stage in enumerate(bp.staged.stages):
        lender = bp.staged.borrows.get(idx)  # (a tied head multiplies by the embedding stage's matrix)
        weights = sum(slot.size for i in (idx, lender) if i is not None
                      for slot in bp.params_layout.stage(bp.staged.stages[i].name).slots)
        if stage.kind in bp.staged.hints.forward_flops_per_row:  # the family's own count (an encoder-decoder's)
            fwd = rows * bp.staged.hints.forward_flops_per_row[stage.kind]
        elif stage.kind == "block":
            fwd = 2 * tokens * weights + 4 * tokens * m.seq_len * m.d_model
        elif stage.kind == "head":
            fwd = 2 * tokens * weights
        else:
            fwd = tokens * m.d_model  # an embedding lookup
        layout = bp.params_layout.stage(stage.name)
        p_bytes = shard_bytes(layout, ranks)
        o_bytes = shard_bytes(bp.opt_layout.stage(stage.name), ranks)
        touched = 3 * p_bytes + 2 * o_bytes
        fwd_s = fwd / peak_flops
        experts = ranks > 1 and layout.apart_splits(ranks)
        per_row = bp.staged.hints.exchange_values_per_row.get(stage.kind, 0.0)
        exchange = rows * per_row * np.dtype(m.compute_dtype).itemsize
        costs.append(StageCost(stage.name, p_bytes, o_bytes, 0.0 if stage.kind == "head" else fwd_s, 3 * fwd_s,
                               touched / device_bw, touched / host_bw, host_add_s=3 * p_bytes / host_bw,
                               expert_bytes=shard_bytes(layout, ranks, apart=True) if experts else 0,
                               exchange_bytes=exchange if experts else 0.0, lender=lender))
    return costs



def _estimated_plan(cfg: Config, bp: Blueprint, args: argparse.Namespace, target: PlanTarget | None = None
                    ) -> tuple[Config, Plan, list[StageCost], Budgets, Bandwidths, str]:
    device = jax.devices()[0]
    target = target or plan_target(args)
    bw = target.bandwidths
    ranks = target_ranks(cfg, args)
    if ranks > 1:
        refuse_sharded_optimizer(cfg)
    if ranks > 1 and not bw.link:
        raise AngelError(f"a plan of {ranks} data-parallel ranks (--devices) needs the bandwidth of their "
                         "collectives: give --link-gbps (GB/s each rank sends; e.g. NVLink ~150-300 per GPU within "
                         "a server, InfiniBand ~25-50 across servers)")
    bw, two_level = collective_link(bw, args, ranks)
    local = local_batch(cfg, ranks)
    # A target named by its peak, links or calibration is another machine, an accelerator with streams of its own;
    # without one the plan is for this machine, whose CPU backend computes, copies and updates on the same cores.
    shared_cpu = device.platform == "cpu" and not target.other_machine
    best = None
    errors = []
    for size in micro_sizes(cfg, ranks):  # largest first: a smaller one only when predicted faster by more than noise
        trial = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=size))
        costs = estimate_costs(trial, bp, target.compute_flops, target.device_bw, target.host_bw, ranks)
        budgets = stated_budgets(trial, device, local, bp.sizes, target.device_memory)
        try:
            plan = make_plan(costs, bw, budgets, shared_cpu=shared_cpu, micro_batches=micro_batching(trial, local)[0],
                             ranks=ranks, **plan_settings(trial))
        except PlanError as e:
            errors.append(e)
            continue
        if best is None or plan.predicted.step_time < best[1].predicted.step_time * 0.98:
            best = (trial, plan, costs, budgets)
    if best is None:
        raise errors[-1]
    trial, plan, costs, budgets = best
    refuse_two_level_experts(two_level, costs)
    chosen = "; micro-batch size chosen by the planner" if not cfg.train.micro_batch_size else ""
    return trial, plan, costs, budgets, bw, f"stage times estimated from FLOPs at {target.compute_flops / 1e12:.1f} " \
                                            f"TFLOP/s ({target.sources['compute']}); {bw.source}{chosen}" \
                                            + (f"; {two_level}" if two_level else "")


def _profiled_plan(cfg: Config, bp: Blueprint) -> tuple[Config, Plan, list[StageCost], Budgets, Bandwidths, str]:
    device = jax.devices()[0]
    decision = decide(cfg, device, cfg.train.batch_size, bp.sizes)
    cfg = decision.cfg
    example = np.zeros((cfg.train.batch_size, cfg.model.seq_len + 1), np.int32)
    plan, costs, bw = plan_for(decision, bp, example, device)
    budgets = decision.budgets
    links = bw.source.replace("; ", ", ")  # ('h2d/d2h profiled; disk from PATH': one figure of the report)
    return cfg, plan, costs, budgets, bw, f"stage times profiled on {device.device_kind}; bandwidths: {links}"


def report(cfg: Config, plan: Plan, costs: list[StageCost], budgets: Budgets, bw: Bandwidths,
           source: str, peak_flops: float | None = None, node: int | None = None) -> list[str]:
    """The lines `angel-jax plan` prints. With several ranks the bytes, times and budgets are one rank's; with
    `node` (--devices-per-node), also each host's peak."""
    counts = models.get(cfg.model).param_count
    size = f"{counts['total'] / 1e9:.2f} B" if counts["total"] >= 1e9 else f"{counts['total'] / 1e6:.2f} M"
    local = cfg.train.batch_size // plan.ranks
    ranks = [f"  data parallel: {plan.ranks} ranks (ZeRO-3: every page family partitioned over them); the table, "
             f"peak bytes and I/O below are one rank's, of its local batch of {local}"] if plan.ranks > 1 else []
    lines = [f"plan for {cfg.name}: {size} parameters ({counts['total']:,}), {len(costs)} stages, "
             f"{page_size_text(cfg)}, staleness {plan.staleness}", *ranks,
             f"  batch {cfg.train.batch_size}: {plan.micro_batches} micro-batch"
             f"{'es' if plan.micro_batches > 1 else ''} of {local // plan.micro_batches} "
             f"(train.micro_batch_size={cfg.train.micro_batch_size}), layer-major"
             + (f" in {plan.passes} accumulation passes of {plan.micro_batches // plan.passes}" if plan.passes > 1
                else ""),
             f"  {len(plan.resident)} resident, {len(plan.streamed)} streamed (prefetch {plan.prefetch}); on disk: "
             f"parameters of {plan.home.count('disk')} stages, gradients of {plan.grad_home.count('disk')}, "
             f"optimizer state of {plan.opt_home.count('disk')}"
             + (f" ({plan.opt_staging} stages staged through the host at a time)"
                if "disk" in plan.home + plan.grad_home + plan.opt_home else ""),
             "", f"  {'tier':<8}{'params':>14}{'gradients':>14}{'optimizer':>14}{'budget':>14}"
                 + ("   (one rank's)" if plan.ranks > 1 else "")]
    budget = {"device": budgets.device, "host": budgets.host, "disk": budgets.disk}
    for row in plan.table(costs):
        b = budget[row["tier"]]
        b_text = "none" if b == 0 and row["tier"] == "disk" else ("unlimited" if b is None else human_bytes(b))
        lines.append(f"  {row['tier']:<8}{human_bytes(row['params']):>14}{human_bytes(row['gradients']):>14}"
                     f"{human_bytes(row['optimizer']):>14}{b_text:>14}")
    peak = plan.peak_bytes
    lines += ["", *step_lines(cfg, plan, costs, source, peak_flops),
              f"  predicted peak bytes  device {human_bytes(peak['device'])} (of which activations and working set "
              f"{human_bytes(plan.fixed_device)}, streaming window {human_bytes(plan.window_bytes)}"
              + (f", whole stages gathered {human_bytes(plan.gather_bytes)}" if plan.ranks > 1 else "")
              + f"), host {human_bytes(peak['host'])}, disk {human_bytes(peak['disk'])}"
              + (f" per rank; all {plan.ranks} ranks: device {human_bytes(plan.ranks * peak['device'])}, host "
                 f"{human_bytes(plan.ranks * peak['host'])}, disk {human_bytes(plan.ranks * peak['disk'])}"
                 if plan.ranks > 1 else "")]
    if node and plan.ranks > 1:
        lines.append(host_line(plan, budgets, node))
    io = plan.io_per_step(costs, bw)
    lines += [f"  I/O per step          h2d {human_bytes(io['h2d_bytes'])}, d2h {human_bytes(io['d2h_bytes'])}, "
              f"disk read {human_bytes(io['disk_read_bytes'])}, disk write {human_bytes(io['disk_write_bytes'])}; "
              f"no step can be shorter than the slowest path: {io['io_bound_s']:.4f} s"]
    if plan.ranks > 1:
        lines.append(f"  collectives per step  each rank receives {human_bytes(io['collective_bytes'])} (all-gathers "
                     f"of every stage per access, reduce-scatters per backward: (ranks - 1) x shard bytes each), "
                     f"{io['collective_s']:.4f} s at {bw.link / 1e9:.4g} GB/s per rank")
        own = sum(c.expert_bytes for c in costs)
        if own:  # expert parallelism
            calls = exchange_bytes(costs, plan.micro_batches)
            lines.append(f"  expert parallelism    each rank holds {cfg.model.moe.experts // plan.ranks} of the "
                         f"{cfg.model.moe.experts} experts of every MoE layer whole ({human_bytes(own)} of its "
                         f"parameter shards, never gathered); its all-to-alls move "
                         f"{human_bytes(calls * (plan.ranks - 1) // plan.ranks)} per step, inside the stage calls "
                         f"(counted above)")
    if plan.parked_bytes:
        lines.append(f"  parked activations    stage inputs wait for their backward in host memory "
                     f"(memory.activations={cfg.memory.activations}): {human_bytes(plan.parked_bytes)} a stage, "
                     f"{human_bytes(plan.parked_bytes * (len(costs) - 1) * plan.passes)} per step each way")
    on_device = plan.streamed_device_updates
    if on_device:
        lines.append(f"  device updates        {len(on_device)} of {len(plan.streamed)} streamed stages update on the "
                     f"device (memory.streamed_updates={cfg.memory.streamed_updates}): their parameters, gradients "
                     f"and optimizer state cross the link and back, {DEVICE_UPDATES_IN_FLIGHT} stages at a time "
                     f"({human_bytes(plan.update_bytes)} of device memory)")
    if len(plan.streamed) > len(on_device):  # the other streamed stages update on the host
        lines.append(f"  host updates          {host_update_by(cfg.optimizer)}")
    return lines


def step_lines(cfg: Config, plan: Plan, costs: list[StageCost], source: str, peak_flops: float | None) -> list[str]:
    """The predicted step: a headline (step time, MFU, the bound), then one short line per figure behind it
    (`source`'s '; '-separated parts: where the stage times and each link's figure come from), the step without
    overlap, the streams' busy shares, what the compute waits for and what the MFU is stated against."""
    step, serial = plan.predicted.step_time, plan.serial_step_time
    bound, shares = plan.bound(costs[0].name)
    mfu = f", {predicted_mfu(cfg, plan, peak_flops):.1%} MFU" if peak_flops else ""
    lines = [f"  predicted step time   {step:.4g} s{mfu}, bound by {bound}"]

    def detail(label: str, text: str) -> None:
        lines.append(f"    {label:<20}{text}")

    for i, part in enumerate(source.split("; ")):
        for j, piece in enumerate(textwrap.wrap(part, 76, subsequent_indent="  ", break_on_hyphens=False)):
            detail("figures" if i == j == 0 else "", piece)
        if ASSUMED in part:
            detail("", "(assumed: name the target's with --calibration or the --*-gbps flags)")
    if not cfg.memory.overlap:
        detail("without overlap", "the same (memory.overlap=false)")
    elif serial:
        detail("without overlap", f"{serial:.4g} s (overlap hides {1 - step / serial:.0%} of it)")
    detail("streams busy", ", ".join(f"{s} {v:.0%}" for s, v in shares.items()))
    waits = plan.predicted.waits
    if waits:
        detail("compute waits", f"{sum(waits.values()):.4g} s per step: " + ", ".join(
            f"{k} {v:.4g} s" for k, v in sorted(waits.items(), key=lambda kv: -kv[1])))
    if peak_flops:
        devices = f" x {plan.ranks} devices" if plan.ranks > 1 else ""
        detail("MFU", f"model FLOPs per step (6N + attention per token) / (step x "
                      f"{peak_flops / 1e12:.1f} TFLOP/s{devices})")
    return lines


def main(args: list[str] | argparse.Namespace | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        args = _parser().parse_args(args)
    if not args.estimate and (args.devices or args.link_gbps or args.devices_per_node or args.inter_node_gbps):
        raise AngelError("--devices, --link-gbps, --devices-per-node and --inter-node-gbps describe a target to "
                         "estimate a plan for: add --estimate (a profiled plan is this process's, of one rank)")
    if getattr(args, "what_if", False) and not args.estimate:
        raise AngelError("--what-if plans other settings on paper: add --estimate")
    cfg = load_config(args.config, list(args.overrides))
    bp = blueprint(cfg)
    target = plan_target(args) if args.estimate else None
    peak = target.peak if target else device_peak(jax.devices()[0])
    cfg, plan, costs, budgets, bw, source = (_estimated_plan(cfg, bp, args, target) if target
                                             else _profiled_plan(cfg, bp))
    peak = peak.flops_per_device
    node = per_node(args, plan.ranks) if target and getattr(args, "devices_per_node", None) else None
    print("\n".join(report(cfg, plan, costs, budgets, bw, source, peak, node)))
    what_if = {}
    if getattr(args, "what_if", False):
        what_if = alternatives(cfg, args, target, peak)
        print("\n".join(what_if_lines(plan, what_if)))
    out = Path(args.out) if args.out else cfg.run_dir
    out.mkdir(parents=True, exist_ok=True)
    plan.predicted.save_json(out / "timeline_predicted.json")
    save_pngs(out, cfg.name)  # with a measured timeline there (a paged run's directory), both on one time scale
    summary = plan_summary(plan, costs, budgets, bw, source, bp.staged.param_count, cfg, peak)
    if what_if:
        summary["what_if"] = what_if
    if node and plan.ranks > 1:
        summary["per_host"] = per_host(plan, budgets, node)
    (out / "plan.json").write_text(json.dumps(summary, indent=1))
    print(f"  wrote {out / 'timeline_predicted.png'}, timeline_predicted.json and plan.json")
    return 0


WHAT_IF = {
    "updates one step behind": ["memory.staleness=1"],
    "bfloat16 parameters over a float32 master": ["model.param_dtype=bfloat16", "optimizer.master_weights=true"],
    "bfloat16 optimizer moments": ["optimizer.state_dtype=bfloat16"],
    "streamed stages updated on the device": ["memory.streamed_updates=device"],
    "stage inputs parked in host memory": ["memory.activations=host"],
}
"""The settings `--what-if` plans besides the config's own, each alone and all together: those that move a
streamed step's bound (host updates hidden behind the next step; fewer bytes over the link and through the host
update; no host update at all; one pass however large the batch)."""


def alternatives(cfg: Config, args: argparse.Namespace, target: PlanTarget, peak_flops: float) -> dict[str, dict]:
    """The run planned on paper with each of `WHAT_IF`'s settings the config does not have yet (bfloat16
    parameters only over bfloat16 compute), and with all of them: per setting, the predicted step, MFU and bound,
    or why no plan fits (a setting the config refuses, e.g. bfloat16 moments with an optimizer that keeps none,
    is left out)."""
    def new(name: str, overrides: list[str]) -> bool:
        if name.startswith("bfloat16 parameters") and cfg.model.compute_dtype != "bfloat16":
            return False  # (parameters cross in the compute dtype: float32 compute gains nothing)
        try:
            return _with(cfg, overrides) != cfg
        except ConfigError:
            return False

    options = {name: o for name, o in WHAT_IF.items() if new(name, o)}
    if len(options) > 1:
        options["all of them"] = [o for overrides in options.values() for o in overrides]
    out: dict[str, dict] = {}
    for name, overrides in options.items():
        trial = _with(cfg, overrides)
        try:
            trial, plan, costs, _, _, _ = _estimated_plan(trial, blueprint(trial), args, target)
        except AngelError as e:  # (a PlanError too)
            out[name] = {"overrides": overrides, "refused": str(e)}
            continue
        out[name] = {"overrides": overrides, "predicted_step_s": plan.predicted.step_time,
                     "predicted_mfu": predicted_mfu(trial, plan, peak_flops), "bound": plan.bound(costs[0].name)[0],
                     "staleness": plan.staleness, "micro_batch_size": trial.train.micro_batch_size,
                     "passes": plan.passes, "resident": len(plan.resident), "streamed": len(plan.streamed)}
    return out


def _with(cfg: Config, overrides: list[str]) -> Config:
    """`cfg` with dotted key=value overrides, validated as the command line's are."""
    raw = to_dict(cfg)
    for o in overrides:
        raw = merge_dicts(raw, parse_override(o))
    return config_from_dict(raw, "--what-if")


def what_if_lines(plan: Plan, what_if: dict[str, dict]) -> list[str]:
    """`--what-if`'s lines under the report."""
    if not what_if:
        return ["  what if               (the config already has every setting --what-if tries)"]
    lines = [f"  what if               (the same target and budgets; this plan: {plan.predicted.step_time:.4g} s)"]
    for name, result in what_if.items():
        settings = " ".join(result["overrides"])
        if "refused" in result:
            lines.append(f"    {name}: no plan fits ({result['refused'][:160]})")
            continue
        lines.append(f"    {name} ({settings}): {result['predicted_step_s']:.4g} s, "
                     f"{result['predicted_mfu']:.1%} MFU, bound by {result['bound']}")
    if any(int(r.get("staleness", 0)) for r in what_if.values()):
        lines.append("    (updates one step behind train on gradients one step old: measured to cost loss at "
                     "the main job's learning rates, docs/paged-training.md)")
    return lines

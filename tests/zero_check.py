"""Run by test_zero.py in its own process with four CPU devices: the paged engine with every page sharded over
the devices (ZeRO-3) against the in-memory engine on one device, and the bytes each device holds; the disk and
accumulation-pass variants through the accelerator's host-update path (memory.accelerator_path).

    python zero_check.py

Prints one JSON line: the reference's and the sharded paged engine's losses and gradient norms, how many stages the plan streams,
the training state's bytes on the reference's device, and the page bytes each device holds in the device and host
tiers (measured from the live shards of the arrays the tiers hold)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

# (Without LLVM's optimisations the programs compile in about half the time; every comparison here is between runs
# compiled alike.)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
                           " --xla_backend_optimization_level=0")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]

import jax  # noqa: E402

from angel_jax.config import MeshConfig  # noqa: E402
from angel_jax.train.engines import InMemoryEngine, build_engine  # noqa: E402
from angel_jax.train.step import StepControls  # noqa: E402
from angel_jax.train.sharding import device_bytes, make_mesh  # noqa: E402
from test_paged import batches as make_batches  # noqa: E402
from test_paged_tied import TIED, _cfg as tied_cfg  # noqa: E402
from test_zero import BATCH, DISK_STEPS, MOE_MODEL, MOE_STEPS, RANKS, cfg, data, moe_cfg, paged, tier_bytes  # noqa: E402


def run(engine, batches: list, keys: tuple[str, ...] = ("loss", "grad_norm")) -> dict[str, list[float]]:
    """Per step, the loss and the gradient norm (a gradient reduced wrongly over the ranks, e.g. summed rather than
    averaged, could leave Adam's normalised losses close but not the norm)."""
    metrics = [engine.step(jax.device_put(b, engine.batch_sharding)) for b in batches]
    return {key: [float(m[key]) for m in metrics] for key in keys}


def experts(one, mesh) -> dict:
    """The MoE model on one device and with its experts split over the ranks (2 each, expert parallelism): in the
    in-memory engine and in the paged one."""
    batches, keys = make_batches(MOE_STEPS, MOE_MODEL, BATCH), ("loss", "grad_norm", "moe/aux_loss", "moe/drop_rate")
    engine = InMemoryEngine(moe_cfg(), one)
    out = {"reference": run(engine, batches, keys)}
    engine.close()
    engine = InMemoryEngine(moe_cfg(), mesh)  # the in-memory engine's expert parallelism
    out["expert_shards"] = sorted({str(a.addressable_shards[0].data.shape) for path, a in
                                   jax.tree_util.tree_leaves_with_path(engine.state.params)
                                   if jax.tree_util.keystr(path).endswith("['w_in']")})
    out["in_memory"] = run(engine, batches, keys)
    step = engine._judge.lower(engine.state, jax.device_put(batches[0], engine.batch_sharding),
                               StepControls().as_numpy()).as_text()
    out["in_memory_all_to_alls"] = step.count("all_to_all")  # the tokens go to the experts
    engine.close()
    engine = build_engine(moe_cfg(paged=True), mesh)
    try:
        out["keeps_apart"] = engine.built.layout.stage("block.0").keeps_apart
        out["streamed"] = len(engine.built.plan.streamed)
        out["paged"] = run(engine, batches, keys)
    finally:
        engine.close()
    return out


def main() -> None:
    batches = data()
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,))
    engine = InMemoryEngine(cfg(), one)
    out = {"state": sum(device_bytes(engine.state).values()), "reference": run(engine, batches)}
    engine.close()
    mesh = make_mesh(MeshConfig(fsdp=RANKS), jax.devices())
    out["moe"] = experts(one, mesh)
    engine = build_engine(paged(), mesh)
    try:
        out["streamed"], out["stages"] = len(engine.built.plan.streamed), len(engine.built.plan.home)
        out["paged"] = run(engine, batches)
        engine.built.updater.drain()
        engine.built.store.wait_all()
        store = engine.built.store
        out["device"], out["host"] = tier_bytes(store.tiers["device"]), tier_bytes(store.tiers["host"])
        out["tier_bytes"] = {name: store.tiers[name].bytes_used for name in ("device", "host")}
        out["report"] = engine.memory_report()
    finally:
        engine.close()
    # The next two run their host updates and gradient sums the way an accelerator does (memory.accelerator_path:
    # each rank's shards copied to the compute device, updated alone, joined back; memory/shardwise.py).
    with tempfile.TemporaryDirectory() as disk:  # every page family of every stage homed on the disk tier
        out["disk"] = variant(mesh, batches[:DISK_STEPS], disk_dir=disk, host_budget=520_000, accelerator_path=True)
    out["passes"] = variant(mesh, batches[:DISK_STEPS], passes=2, micro_batch_size=1, accelerator_path=True)
    out["tied"] = tied(one, mesh)
    print(json.dumps(out), flush=True)


def tied(one, mesh) -> dict:
    """A Llama whose head is tied to the embedding on one device (in memory) and with its pages sharded over the
    ranks: the head's call gathers the embedding stage's shards too, and its gradient of them is reduce-scattered
    and added into the embedding's on each rank."""
    batches = make_batches(DISK_STEPS, TIED, RANKS)
    base = tied_cfg(model=TIED, steps=DISK_STEPS)
    config = dataclasses.replace(base, train=dataclasses.replace(base.train, batch_size=RANKS))
    engine = InMemoryEngine(dataclasses.replace(config, memory=dataclasses.replace(config.memory, mode="in_memory")),
                            one)
    out = {"reference": run(engine, batches)}
    engine.close()
    engine = build_engine(dataclasses.replace(config, mesh=MeshConfig(fsdp=RANKS)), mesh)
    try:
        out["paged"] = run(engine, batches)
    finally:
        engine.close()
    return out


def variant(mesh, batches: list, micro_batch_size: int = 0, **memory) -> dict:
    """The same sharded pages with other `memory` settings (the stage functions are the run's above, compiled
    once): where the plan homes each family, how many passes it makes, the losses."""
    base = paged()
    engine = build_engine(dataclasses.replace(
        base, memory=dataclasses.replace(base.memory, **memory),
        train=dataclasses.replace(base.train, micro_batch_size=micro_batch_size)), mesh)
    try:
        plan = engine.built.plan
        homes = {"params": plan.home.count("disk"), "gradients": plan.grad_home.count("disk"),
                 "optimizer": plan.opt_home.count("disk")}
        host = engine.built.updater.placements["host"]
        return {"homes": homes, "stages": len(plan.home), "passes": plan.passes, "streamed": len(plan.streamed),
                "micro_batches": plan.micro_batches, "shard_by_shard": host.shardwise is not None,
                "in_place": host.in_place, "losses": run(engine, batches)["loss"]}
    finally:
        engine.close()


if __name__ == "__main__":
    main()

"""`angel-jax plan`'s command-line arguments: argparse alone, so the `angel-jax` command's parser can include
them without importing JAX."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """`angel-jax plan`'s arguments (shared by `angel-jax plan` and `python -m angel_jax.cli.plan`)."""
    p.add_argument("config", type=Path, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--out", type=Path, default=None, help="where to write the timeline (default: the run directory)")
    p.add_argument("--estimate", action="store_true",
                   help="estimate stage times from FLOPs and the device's peak instead of profiling them")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="with --estimate: the target device's peak (default: this device's, from the device table "
                        "or a measured matmul)")
    p.add_argument("--what-if", action="store_true",
                   help="with --estimate: also plan the same run with host updates one step behind "
                        "(memory.staleness=1) and with bfloat16 parameters over a float32 master "
                        "(ZeRO-Offload's layout: half the bytes over the link), each alone and both, and print "
                        "their predicted step and MFU")
    target = p.add_argument_group("the target machine, with --estimate: its calibration file, or its links one by "
                                  "one (they win over the file); with neither, built-in figures labelled assumed. "
                                  "No target named at all: this machine (its peak and `angel-jax bench io` "
                                  "calibration)")
    target.add_argument("--calibration", type=Path, default=None,
                        help="the target's measured figures (experiments/bench/calibration.py builds one from a "
                             "machine's committed measurements, e.g. experiments/results/h200_calibration.json): "
                             "the compute rate stage times are estimated at, links, disk, host update speed")
    target.add_argument("--h2d-gbps", type=float, default=None, help="host -> device copies, GB/s (pinned)")
    target.add_argument("--d2h-gbps", type=float, default=None, help="device -> host copies, GB/s (default: h2d)")
    target.add_argument("--disk-read-gbps", type=float, default=None, help="disk tier reads, GB/s")
    target.add_argument("--disk-write-gbps", type=float, default=None, help="disk tier writes, GB/s")
    target.add_argument("--host-gbps", type=float, default=None,
                        help="host memory traffic (bytes read + written per second) the host optimizer and "
                             "gradient sums reach, GB/s")
    dp = p.add_argument_group("data parallelism (ZeRO-3), with --estimate: every page family partitioned over the "
                              "ranks; the plan is one rank's")
    dp.add_argument("--devices", type=int, default=None,
                    help="data-parallel ranks (devices) of the target (default: mesh.data x mesh.fsdp where both "
                         "are set, else 1); train.batch_size is the global batch, memory.*_budget are per rank")
    dp.add_argument("--link-gbps", type=float, default=None,
                    help="bytes each rank sends (and receives) per second in a collective, GB/s: e.g. NVLink "
                         "~150-300 per GPU within a server, InfiniBand ~25-50 across servers (needed with "
                         "more than one device); with --devices-per-node, each rank's link inside its host")
    dp.add_argument("--devices-per-node", type=int, default=None,
                    help="ranks on each host, when --devices spans several hosts (each host's share of host "
                         "memory is then memory.host_budget per rank; the report states each host's peak)")
    dp.add_argument("--inter-node-gbps", type=float, default=None,
                    help="with --devices-per-node: bytes each rank sends (and receives) per second to other hosts, "
                         "GB/s (its own network port, e.g. 50 for 400 Gb/s); the collectives are then timed as "
                         "the two-level algorithm (across hosts, then inside each: angel_jax/schedule/links.py)")

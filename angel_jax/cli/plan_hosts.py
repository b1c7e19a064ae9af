"""`angel-jax plan --estimate` over ranks on several hosts (`--devices-per-node R --inter-node-gbps G2`): the ranks
on each host, the link their collectives run at (the two-level figure of schedule/links.py) and each host's peak
bytes (R ranks' per-rank peak: memory.host_budget is each rank's share of its host's memory)."""

from __future__ import annotations

import argparse
import dataclasses

from angel_jax.errors import AngelError
from angel_jax.schedule.links import hierarchical_link, two_level_note
from angel_jax.schedule.plan import Bandwidths, Budgets, Plan, StageCost
from angel_jax.units import human_bytes


def per_node(args: argparse.Namespace, ranks: int) -> int:
    """Ranks on each host of the estimated target: --devices-per-node, else all of them on one."""
    given = getattr(args, "devices_per_node", None)
    inter = getattr(args, "inter_node_gbps", None)
    if given is None:
        if inter:
            raise AngelError("--inter-node-gbps is the link between hosts: give --devices-per-node (ranks on each "
                             "host) too")
        return ranks
    if given < 1 or ranks % given:
        raise AngelError(f"--devices-per-node must divide the ranks ({ranks}), got {given}")
    if given < ranks and not inter:
        raise AngelError(f"{ranks} ranks on hosts of {given} need the link between hosts: give --inter-node-gbps "
                         "(GB/s each rank sends to other hosts, e.g. 50 for 400 Gb/s)")
    return given


def collective_link(bw: Bandwidths, args: argparse.Namespace, ranks: int) -> tuple[Bandwidths, str]:
    """`bw` with the link its collectives run at, and the words that say how it was found ('' for --link-gbps as
    given: one host); over several hosts the two-level figure, --link-gbps inside each, --inter-node-gbps between."""
    node = per_node(args, ranks)
    if node >= ranks or not bw.link:
        return bw, ""
    inter = args.inter_node_gbps * 1e9
    return (dataclasses.replace(bw, link=hierarchical_link(bw.link, inter, ranks, node)),
            two_level_note(bw.link, inter, ranks, node))


def refuse_two_level_experts(two_level: str, costs: list[StageCost]) -> None:
    """AngelError for experts split over ranks on several hosts: their all-to-alls are not two-level."""
    if two_level and any(c.expert_bytes for c in costs):
        raise AngelError("--inter-node-gbps: expert all-to-alls across hosts are not modelled two-level (a "
                         "token's expert may be on any host); plan experts over several hosts with --link-gbps the "
                         "slowest link and no --devices-per-node")


def per_host(plan: Plan, budgets: Budgets, node: int) -> dict[str, int | None]:
    """Each host's peak bytes per tier (`node` ranks' per-rank peaks) and the host budget of its ranks together."""
    return {"ranks_per_host": node, "hosts": plan.ranks // node,
            **{f"{tier}_peak_bytes": node * plan.peak_bytes[tier] for tier in ("device", "host", "disk")},
            "host_budget_bytes": None if budgets.host is None else node * budgets.host}


def host_line(plan: Plan, budgets: Budgets, node: int) -> str:
    """The report's line of each host's peak."""
    h = per_host(plan, budgets, node)
    of = "" if h["host_budget_bytes"] is None else \
        f" of {human_bytes(h['host_budget_bytes'])} ({node} x memory.host_budget)"
    return (f"  per host              {h['hosts']} host{'s' if h['hosts'] > 1 else ''} of {node} ranks: host "
            f"{human_bytes(h['host_peak_bytes'])}{of}, device {human_bytes(h['device_peak_bytes'])}, disk "
            f"{human_bytes(h['disk_peak_bytes'])}")

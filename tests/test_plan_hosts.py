"""Plans of ranks on several hosts: the two-level collective figure (schedule/links.py) against the hierarchical
all-gather carried out shard by shard, and `angel-jax plan --estimate --devices N --devices-per-node R
--inter-node-gbps G2`'s link and per-host peak."""

from __future__ import annotations

import json

import pytest

from angel_jax.errors import AngelError
from angel_jax.schedule.links import hierarchical_link
from conftest import REPO_ROOT


def _hierarchical_all_gather(hosts: int, per_node: int, shard: int, intra: float, inter: float) -> float:
    """Seconds of a two-level all-gather carried out on lists: rank (h, k) starts with its own shard; phase 1
    gathers across hosts among the ranks of local index k, phase 2 inside each host. Each rank's received bytes
    per phase over its link in that phase; each phase lasts as long as its slowest rank."""
    held = {(h, k): {(h, k)} for h in range(hosts) for k in range(per_node)}
    seconds = 0.0
    for group_of, bw in ((lambda h, k: k, inter), (lambda h, k: h, intra)):
        groups: dict[int, set] = {}
        for (h, k), shards in held.items():
            groups.setdefault(group_of(h, k), set()).update(shards)
        received = {}
        for rank, shards in held.items():
            union = groups[group_of(*rank)]
            received[rank] = len(union - shards) * shard
            held[rank] = set(union)
        seconds += max(received.values()) / bw
    assert all(len(s) == hosts * per_node for s in held.values())  # everyone holds every shard
    return seconds


@pytest.mark.parametrize("hosts,per_node", [(8, 8), (2, 4), (3, 2)])
def test_the_two_level_figure_moves_every_shard_in_the_hierarchical_algorithms_time(hosts, per_node):
    shard, intra, inter = 1 << 20, 450e9, 50e9
    ranks = hosts * per_node
    link = hierarchical_link(intra, inter, ranks, per_node)
    # The planner's ring model: (ranks - 1) shards at `link` take the algorithm's time.
    assert (ranks - 1) * shard / link == pytest.approx(_hierarchical_all_gather(hosts, per_node, shard, intra, inter))
    assert link == pytest.approx((ranks - 1) / ((hosts - 1) / inter + (per_node - 1) * hosts / intra))
    assert inter < link < intra  # better than a flat ring's slowest hop, worse than one host's link


def test_one_host_is_its_own_link_and_one_rank_a_host_is_the_network():
    assert hierarchical_link(450e9, 50e9, 8, 8) == pytest.approx(450e9)
    assert hierarchical_link(450e9, 50e9, 8, 1) == pytest.approx(50e9)
    with pytest.raises(AngelError, match="--devices-per-node must divide"):
        hierarchical_link(450e9, 50e9, 8, 3)


def test_plan_over_two_hosts_runs_its_collectives_at_the_two_level_figure_and_states_each_hosts_peak(tmp_path,
                                                                                                    capsys):
    from angel_jax.cli.plan import main

    base = [str(REPO_ROOT / "experiments" / "gpt_tiny.yaml"), "train.batch_size=16", "memory.page_size=262144",
            "memory.device_budget=40000000", "memory.host_budget=300000000", "--estimate", "--peak-tflops", "100",
            "--devices", "8", "--link-gbps", "100"]
    assert main([*base, "--devices-per-node", "4", "--inter-node-gbps", "10", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    io = plan["io_per_step"]
    link = hierarchical_link(100e9, 10e9, 8, 4)
    assert io["collective_s"] == pytest.approx(io["collective_bytes"] / link, rel=1e-6)
    assert "collectives two-level over 2 hosts of 4 ranks" in text and f"{link / 1e9:.4g} GB/s per rank" in text
    host = plan["per_host"]
    assert host["hosts"] == 2 and host["ranks_per_host"] == 4
    assert host["host_peak_bytes"] == 4 * plan["peak_bytes"]["host"] and host["host_budget_bytes"] == 4 * 300000000
    assert "per host              2 hosts of 4 ranks: host" in text
    for extra, match in ((["--inter-node-gbps", "10"], "--devices-per-node"),
                         (["--devices-per-node", "3", "--inter-node-gbps", "10"], "must divide"),
                         (["--devices-per-node", "4"], "--inter-node-gbps")):
        with pytest.raises(AngelError, match=match):
            main([*base, *extra, "--out", str(tmp_path)])

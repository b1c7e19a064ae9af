"""The link figure of ZeRO-3's collectives when the ranks span several hosts: one bytes-per-second figure per rank
that the planner's ring model turns into each collective's seconds.

The planner times an all-gather of a stage (or the reduce-scatter of its gradients) as (N - 1) x s / link, s a
rank's shard bytes and N the ranks (simulate.py, `Bandwidths.link`): each rank receives the N - 1 other shards.
Inside one host that is the ring over its GPUs' links (NVLink). Across hosts the links differ: a rank reaches the
ranks of its own host over NVLink and the others over its network port, ten times slower or more. A flat ring of
the N ranks waits at every step for its slowest hop, (N - 1) x s / inter: the slow link paid for every shard.
The collectives are modelled instead as the hierarchical (two-level) algorithm, N = m hosts x n ranks per host:

- all-gather, (1) across hosts: the m ranks of one local index (each host's rank k, each through its own port:
  a rail-aligned network) gather their shards, each receiving (m - 1) x s bytes at `inter`; (2) inside each
  host: its n ranks, each now holding m shards, gather them, each receiving (n - 1) x m x s bytes at `intra`.
- reduce-scatter: the same two phases in the other order (inside the host first, on m x s bytes of partial sums;
  then across hosts, on s), the same bytes.

So one collective takes t = s x ((m - 1) / inter + (n - 1) x m / intra), and a rank receives
(m - 1) x s + (n - 1) x m x s = (N - 1) x s bytes, as in the flat ring: the figure the planner uses is
link = (N - 1) x s / t = (N - 1) / ((m - 1) / inter + (n - 1) x m / intra). One host (m = 1) gives `intra`, one
rank per host (n = 1) gives `inter`. The two phases are timed one after the other (their sum); an implementation
that pipelines them could approach the larger of the two, so the figure is the conservative one of the two.
Expert all-to-alls are not two-level (a token's expert is anywhere), and are refused by the caller.
"""

from __future__ import annotations

from angel_jax.errors import AngelError


def hierarchical_link(intra: float, inter: float, ranks: int, per_node: int) -> float:
    """Bytes per second per rank at which a two-level all-gather or reduce-scatter of `ranks` ranks, `per_node` of
    them on each host, moves the (ranks - 1) shards each rank receives: `intra` is each rank's link inside its host,
    `inter` its link to other hosts (the module's doc gives the formula)."""
    if per_node < 1 or ranks % per_node:
        raise AngelError(f"--devices-per-node must divide --devices ({ranks}), got {per_node}")
    if intra <= 0 or inter <= 0:
        raise AngelError(f"a two-level collective needs both links above 0, got intra {intra:g} and inter "
                         f"{inter:g} B/s")
    hosts, n = ranks // per_node, per_node
    if ranks == 1:
        return intra
    return (ranks - 1) / ((hosts - 1) / inter + (n - 1) * hosts / intra)


def two_level_note(intra: float, inter: float, ranks: int, per_node: int) -> str:
    """The report's words for the two-level figure: the hosts, both links and the figure the plan uses."""
    hosts = ranks // per_node
    link = hierarchical_link(intra, inter, ranks, per_node)
    return (f"collectives two-level over {hosts} hosts of {per_node} ranks: {hosts - 1} shards across hosts at "
            f"{inter / 1e9:g} GB/s (--inter-node-gbps), then {(per_node - 1) * hosts} inside each at "
            f"{intra / 1e9:g} GB/s (--link-gbps): {link / 1e9:.1f} GB/s per rank for the {ranks - 1} shards")

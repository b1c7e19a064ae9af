"""How much of the paged runtime's disk traffic is held in host memory at a time: the bounds the runtime keeps
(`schedule/updater.py`, `schedule/execute.py`) and the host memory the plan reserves for them (`schedule/plan.py`,
`schedule/simulate.py`). Constants only, so the planner does not import the runtime for them."""

OPT_STAGING = 2
"""Stages of disk-homed pages (parameters, gradients, optimizer state) held in host memory around their update
(read ahead, or being written back): the bound the updater keeps and the host memory the plan reserves for it, at
least. With two, the next stage's reads queue behind the last one's write-back, and the disk does one after the
other."""

OPT_STAGING_DEEP = 3
"""...and where the host budget has room for one more stage with at most more optimizer state on disk
(`Plan.opt_staging`): the next stage's reads are then issued while the update before it computes, before its
write-back. Measured on a 2-core VM's disk (2.4 B GPT, 47 disk-homed stages, 40 stages' gradients on disk in both
runs, lock-free): 46 s a step against 55 s with two."""

GRAD_SPILL = 2
"""Stages of disk-homed gradients on their way from the backward to the disk at a time (the executor waits for the
oldest before it sends more): the host memory the plan reserves for them."""

ACTIVATIONS_IN_FLIGHT = 2
"""Saved stage inputs on their way to pinned host memory at a time (`memory.activations: host`): the executor
waits for the oldest before it parks another. With the stage computing and those the prefetch brings back for
their backward, the device memory the plan reserves for parked activations (`Budgets.fixed_parked`)."""

DEVICE_UPDATES_IN_FLIGHT = 2
"""Streamed stages updated on the device (`memory.streamed_updates`) whose pages are on the device at a time: one
stage's inputs arrive while the previous one's new pages go home (the updater waits for the oldest before it sends
more); the device memory the plan reserves for them, each stage its parameters, gradients and optimizer state."""

PENDING_VERSIONS = 4
"""Lock-free mode, stages whose parameters live in host memory: new versions kept in host memory until the stage in
use is released (`PageUpdater.release`). The updater waits before it keeps one more; with the one update computing,
the host memory the plan reserves for second versions (`PENDING_VERSIONS + 1` of the largest such stages, not a
second version of every stage)."""


def update_order(lock_free: list[bool]) -> tuple[int, ...]:
    """The order the stages update in, given which may run one update behind: stage order in exact mode; in
    lock-free mode the stages updated exactly (device-resident: the head, the embedding) first, in stage order, then
    the others from the last stage back. Last, the exact ones waited for the whole disk chain and the next step's
    head with them. Backwards, the chain meets the stages as the backward releases them (the last block first), so
    few new versions wait in host memory for a stage in use; the next step reads each of them only a step later."""
    exact = tuple(i for i, free in enumerate(lock_free) if not free)
    return exact + tuple(i for i in reversed(range(len(lock_free))) if lock_free[i])

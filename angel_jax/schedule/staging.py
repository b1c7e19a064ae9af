"""How much of the paged runtime's disk traffic is held in host memory at a time: the bounds the runtime keeps
(`schedule/updater.py`, `schedule/execute.py`) and the host memory the plan reserves for them (`schedule/plan.py`,
`schedule/simulate.py`). Constants only, so the planner does not import the runtime for them."""

OPT_STAGING = 2
"""Stages of disk-homed pages (parameters, gradients, optimizer state) held in host memory around their update
(read ahead, or being written back): the bound the updater keeps and the host memory the plan reserves for it."""

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

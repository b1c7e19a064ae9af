"""The scheduling pass (Angel-PTM): train a model larger than device memory by paging its state.

    trace.py         the stage accesses of one training step
    costs.py         stage compute and copy times, profiled on the real functions
    simulate.py      the predicted timeline of a placement (the executor's rules on the costs)
    plan.py          what stays on the device, what streams from host or disk, how far ahead to prefetch
    stagefns.py      jitted forward / backward per stage kind over pages (and the pure stage update)
    execute.py       PagedExecutor: one step at a time, transfers overlapping compute; updates by updater.py
    updater.py       PageUpdater: each stage's optimizer update where its pages live, exact or lock-free
    staging.py       the bounds on disk traffic held in host memory (shared by the runtime and the planner)
    timeline.py      predicted and measured timelines (JSON, Gantt PNG)
    engine.py        build_paged_runtime: config -> layouts -> profile -> plan -> page store -> executor

It sees stages (models/stages.py) and pages (angel_jax/memory), never a model family or Flax module. The training
loop drives it through train/paged.py (`PagedTrainEngine`); `angel-jax plan` is cli/plan.py.
"""

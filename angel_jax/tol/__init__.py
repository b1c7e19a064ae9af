"""TRANSOM TOL: the watchdog (a pure state machine in coordinator.py), the launcher that runs it over a group of
worker processes, the worker entry point, authenticated heartbeats, goodput accounting and the fault injectors
that tests and benchmarks use. It sits above the trainer: it starts, watches and restarts training processes;
the trainer only reports to it through hooks."""

"""The worker: one training process of a data-parallel job, under `angel-jax launch` or under a cluster scheduler.

    angel-jax worker CONFIG [key=value ...]        (what `angel-jax launch` runs N times)

It reads its place in the job from the environment, joins the job with `jax.distributed.initialize`, and runs the
ordinary training loop (angel_jax.train.loop.train) with a heartbeat client as one of its hooks.

Environment set by `angel-jax launch` (all ANGEL_JAX_*):
    COORDINATOR_ADDRESS   host:port of JAX's coordination service (process 0 serves it; a fresh port per attempt)
    NUM_PROCESSES, PROCESS_ID
    HEARTBEAT_ADDR        host:port of the watchdog's heartbeat server;  JOB_TOKEN  the job's secret
    ATTEMPT               0 for the first start of the job, +1 per restart
    NODE                  the worker slot this rank runs on (what the watchdog excludes)
    PLACEMENT             'local' (this machine's processes) or 'slurm' (job steps of an allocation: snapshots are
                          copied to the next node's memory, checkpoint.peer_network)
    CPU_DEVICES           CPU devices per process (CPU backend only)
    WATCHDOG_PID          the launcher: the worker dies with it (PR_SET_PDEATHSIG), so no worker is orphaned

Without COORDINATOR_ADDRESS the worker runs under a cluster scheduler: `jax.distributed.initialize()` without
arguments detects Slurm (srun) or Kubernetes (an indexed Job / JobSet, with the `kubernetes` package) and takes
the process count, id and coordinator from there; heartbeats go out only if HEARTBEAT_ADDR and JOB_TOKEN are set.
With neither, it trains as a single process.

On the CPU the collectives are gloo's, between real processes. JAX's persistent compilation cache lives in the
run directory (resilience.compile_cache_dir), so a restarted worker loads its executables instead of compiling.

Exit status: 0 when every step is done and the last checkpoint is committed; 75/76 when an anomaly asked for a
restart / exclusion; 1 on any other error (its traceback in the log, its last line in the exit report); 143 after
SIGTERM. A failed worker leaves with os._exit: JAX's exit-time shutdown waits for peers that may be gone.

Fault injection for the watchdog's tests: ANGEL_JAX_FAULTS (angel_jax.tol.faults: raise@S, hang@S, ... with
rank= and attempt=), and ANGEL_JAX_CKPT_KILL_AT=<point>[@<step>][:attempt=A], the checkpoint manager's SIGKILL
point, here optionally limited to one attempt so the restart does not die the same way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from angel_jax.config import Config, ConfigError, load_config
from angel_jax.errors import EXIT_CONFIG, AngelError

log = logging.getLogger("angel_jax.worker")

PREFIX = "ANGEL_JAX_"
CKPT_KILL_ENV = "ANGEL_JAX_CKPT_KILL_AT"
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerEnv:
    """A worker's place in the job, from the environment."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_addr: str | None = None
    token: str | None = None
    attempt: int = 0
    node: str = ""
    cpu_devices: int | None = None
    watchdog_pid: int | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> WorkerEnv:
        def get(name: str) -> str | None:
            return env.get(PREFIX + name) or None

        def integer(name: str) -> int | None:
            raw = get(name)
            if raw is None:
                return None
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{PREFIX}{name}={raw!r} is not an integer") from None

        out = cls(coordinator_address=get("COORDINATOR_ADDRESS"), num_processes=integer("NUM_PROCESSES"),
                  process_id=integer("PROCESS_ID"), heartbeat_addr=get("HEARTBEAT_ADDR"), token=get("JOB_TOKEN"),
                  attempt=integer("ATTEMPT") or 0, node=get("NODE") or env.get("SLURMD_NODENAME", ""), cpu_devices=integer("CPU_DEVICES"),
                  watchdog_pid=integer("WATCHDOG_PID"))
        if out.coordinator_address and (out.num_processes is None or out.process_id is None):
            raise ValueError(f"{PREFIX}COORDINATOR_ADDRESS needs {PREFIX}NUM_PROCESSES and {PREFIX}PROCESS_ID")
        return out

    @property
    def launched(self) -> bool:
        """Started by `angel-jax launch` (else: a cluster scheduler, or a plain single process)."""
        return self.coordinator_address is not None


def cluster_detected(env: Mapping[str, str]) -> str | None:
    """The scheduler `jax.distributed.initialize()` will find, by the variables it looks for."""
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
        return "slurm"
    if "KUBERNETES_SERVICE_HOST" in env and ("JOB_COMPLETION_INDEX" in env or "JOBSET_NAME" in env):
        return "kubernetes"
    if "OMPI_MCA_orte_hnp_uri" in env or "PMIX_RANK" in env:
        return "openmpi"
    return None


def scheduler_rank(env: Mapping[str, str]) -> int:
    """This process's rank as the scheduler numbers it, before jax.distributed says so (for early heartbeats)."""
    for name in ("SLURM_PROCID", "JOB_COMPLETION_INDEX", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0


def ckpt_kill_for_attempt(value: str, attempt: int) -> str | None:
    """'snapshot.copy@8:attempt=0' -> 'snapshot.copy@8' in attempt 0, None (no fault) in the others."""
    point, sep, option = value.partition(":")
    if not sep:
        return value
    key, _, wanted = option.partition("=")
    if key != "attempt" or not wanted.isdigit():
        raise ValueError(f"{CKPT_KILL_ENV}={value!r}: expected <point>[@<step>][:attempt=A]")
    return point if int(wanted) == attempt else None


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL when the launcher dies (Linux), so a killed watchdog leaves no workers behind."""
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def _configure_jax(cfg: Config, wenv: WorkerEnv) -> Any:
    import jax

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms in ("", "cpu") and wenv.cpu_devices:
        jax.config.update("jax_num_cpu_devices", wenv.cpu_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # used only by the CPU backend
    # JAX's preemption service (on by default) takes SIGTERM over once jax.distributed is initialized: it only
    # records the notice and tells every process, and the training loop asks it at every step for the step they all
    # stop and save at (`preemption.SyncedStop`). Before that, and throughout with checkpoint.on_signal false (stop
    # at once, without a save), `_on_sigterm` ends the worker.
    if not cfg.checkpoint.on_signal:
        jax.config.update("jax_enable_preemption_service", False)
    from angel_jax.schedule.pinned_limit import configure_pinned_limit

    if line := configure_pinned_limit(cfg, wenv.num_processes or 1):  # (before the GPU client starts)
        log.info("%s", line)
    if cfg.resilience.compile_cache:
        cache = Path(cfg.resilience.compile_cache_dir or cfg.run_dir / "compile_cache").absolute()
        cache.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small programs too: restarts add up
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return jax


class CacheCounter:
    """Lookups and hits of JAX's persistent compilation cache in this process (for the heartbeats)."""

    def __init__(self) -> None:
        self.counts = {"requests": 0, "hits": 0}

    def install(self) -> CacheCounter:
        from jax import monitoring

        def listener(event: str, **_: Any) -> None:
            if event == "/jax/compilation_cache/compile_requests_use_cache":
                self.counts["requests"] += 1
            elif event == "/jax/compilation_cache/cache_hits":
                self.counts["hits"] += 1

        monitoring.register_event_listener(listener)
        return self

    def __call__(self) -> dict[str, int]:
        return dict(self.counts)


def _on_sigterm(signum: int, frame: Any) -> None:
    # Until jax.distributed's preemption service takes SIGTERM over (see _configure_jax): an exception in the main
    # thread. A thread stuck in a collective never gets here; the watchdog's SIGKILL after the grace period ends it.
    raise SystemExit(143)


def exit_status(e: BaseException) -> int:
    """A failed worker's exit status: EXIT_CONFIG for what no restart can mend (the engine refuses the config, the
    checkpoint does not fit it), the status an error names for itself (`exit_code`: a persistent tier that keeps
    refusing checkpoints), 130 for an interrupt, 1 for anything else (the watchdog restarts those)."""
    from angel_jax.train.protocol import StateMismatch

    if isinstance(e, (ConfigError, StateMismatch)):
        return EXIT_CONFIG
    if isinstance(e, AngelError) and isinstance(getattr(e, "exit_code", None), int):
        return e.exit_code
    return 130 if isinstance(e, KeyboardInterrupt) else 1


def run(config: str, overrides: list[str]) -> int:
    wenv = WorkerEnv.from_environ(os.environ)
    _die_with_parent(wenv.watchdog_pid)
    cfg = load_config(config, overrides)
    if CKPT_KILL_ENV in os.environ:
        scoped = ckpt_kill_for_attempt(os.environ[CKPT_KILL_ENV], wenv.attempt)
        if scoped is None:
            del os.environ[CKPT_KILL_ENV]
        else:
            os.environ[CKPT_KILL_ENV] = scoped
    rank = wenv.process_id if wenv.process_id is not None else scheduler_rank(os.environ)
    client = None
    if wenv.heartbeat_addr and wenv.token:
        from angel_jax.tol.heartbeat import HeartbeatClient

        # Started before jax is imported (seconds): the watchdog hears from the worker at once.
        client = HeartbeatClient(wenv.heartbeat_addr, wenv.token, rank=rank, attempt=wenv.attempt,
                                 interval=cfg.resilience.heartbeat_interval, node=wenv.node).start()
    jax = _configure_jax(cfg, wenv)
    if client is not None:
        client.extra = CacheCounter().install()
    from angel_jax.train.anomaly import RestartRequested

    signal.signal(signal.SIGTERM, _on_sigterm)
    code, error = 0, ""
    try:
        if wenv.launched:
            jax.distributed.initialize(coordinator_address=wenv.coordinator_address,
                                       num_processes=wenv.num_processes, process_id=wenv.process_id)
        elif cluster_detected(os.environ):
            jax.distributed.initialize()  # Slurm / Kubernetes / Open MPI: JAX reads the scheduler's variables
            rank = jax.process_index()
            if client is not None:
                client.rank = rank
        log.info("worker %d of %d (attempt %d, node %s): %d devices here, %d in the job", jax.process_index(),
                 jax.process_count(), wenv.attempt, wenv.node or "-", jax.local_device_count(), jax.device_count())
        from angel_jax.tol.faults import FaultHooks
        from angel_jax.train.loop import train

        hooks: list[Any] = [h for h in (client, FaultHooks.from_env(rank=jax.process_index(),
                                                                    vocab_size=cfg.model.vocab_size)) if h]
        # SIGTERM (the watchdog stopping the job, or a preempted host) stops every process of the group at the
        # same step, with a checkpoint of it (jax's preemption service agrees on the step; see train)
        result = train(cfg, hooks=hooks)
        log.info("worker %d done: step %d", jax.process_index(), result.final_step)
    except RestartRequested as e:
        code, error = e.exit_code, f"{type(e).__name__}: {e}"
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) and e.code else 1
        error = "stopped by SIGTERM" if code == 143 else f"SystemExit({e.code})"
    except BaseException as e:  # noqa: BLE001 - every failure becomes an exit status and a one-line report
        if exit_status(e) in (1, 130):  # (errors that name their own status state the problem: no traceback)
            traceback.print_exc()
        code, error = exit_status(e), f"{type(e).__name__}: {e}"
    if code:
        print(f"worker {rank} (attempt {wenv.attempt}) exits with status {code}: {error}", file=sys.stderr,
              flush=True)
        if client is not None:
            client.stop(exit_code=code, error=error)
        sys.stdout.flush()
        os._exit(code)  # skip JAX's exit-time shutdown barrier: the peers may be gone
    if client is not None:
        client.stop(exit_code=0)
    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="angel-jax worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("absl", "jax._src", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return run(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())

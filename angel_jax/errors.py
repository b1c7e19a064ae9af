"""The base of every user-facing error: the command line prints its message on one line, without a traceback.

A subclass per component (ConfigError, DataError, PageStoreError, CheckpointError, TrainingDiverged, ...); each
message names what is wrong (the key and file, the path, the page, the step).
"""


class AngelError(Exception):
    """A problem the user can act on; its message says what and where."""


EXIT_RESTART = 75
"""Exit status of a worker that asks the watchdog for a restart (the trainer's RestartRequested; EX_TEMPFAIL)."""
EXIT_EXCLUDE = 76
"""Exit status of a worker that asks the watchdog to restart without its node."""
EXIT_CONFIG = 78
"""Exit status of a worker whose run cannot go on as configured (a config the engine refuses, a checkpoint that does
not fit the config, a persistent checkpoint directory that refused checkpoint.max_persist_failures saves in a row):
the watchdog fails the job at once, since a restart would fail the same way (EX_CONFIG)."""
# Why a persistent tier that keeps failing is EXIT_CONFIG and not EXIT_RESTART: by the time the run stops, the
# persistent directory has refused several saves in a row, `checkpoint.every` steps apart. A full disk, a broken
# orbax or a path that cannot be a directory is still there after a restart, on this node and on any other that
# shares the directory, so a restart would train another max_persist_failures checkpoints that exist only in RAM,
# and again for each restart of the budget: the very pretence the limit is there to end. Tolerating a passing
# outage is what max_persist_failures itself is for (raise it, or 0 never stops); what it takes beyond that is an
# operator, and resuming after the fix loses nothing: the memory-tier snapshots are kept.

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
not fit the config): the watchdog fails the job at once, since a restart would fail the same way (EX_CONFIG)."""

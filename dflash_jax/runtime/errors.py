"""The errors a user can cause, each reported by the command-line entry points as one `error: ...` line.

Every class derives from `UserError` (a `ValueError`), so an entry point catches that one class; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad input the user can fix: the message is a complete sentence naming what and where."""


class ConfigError(UserError):
    """A training or evaluation config that cannot work; the message names the field."""


class DataError(UserError):
    """A bad record or corpus, reported as `where: reason` (where = `path:line` when known)."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class CheckpointError(UserError):
    """A checkpoint directory or file that cannot be used, with the reason."""


class OutputDirError(UserError):
    """An output directory a command may not write into or replace (--out), with the reason."""


class WorkdirLockedError(UserError):
    """A training workdir that another live run holds; the message names its host and process id."""


class DiskFullError(UserError):
    """A local directory (a cache, a staging directory) that ran out of space; the message names it."""

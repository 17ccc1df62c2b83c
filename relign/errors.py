"""The errors the CLI reports in one line, on the ground floor so that every module can raise them.

``ConfigError`` is re-exported by ``relign.config`` (``from relign.config import ConfigError``
keeps working); the CLI prints it as one line and exits with status 2. ``SyncMismatch`` is a
failure found while the run runs, not a setting to fix: one line and status 3
(``SyncMismatch.exit_status``).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem a user can fix; the CLI prints it as one line."""


class SyncMismatch(RuntimeError):
    """After a weight sync the engine does not hold the trainer's weights (rollout/sync_check.py): the run
    stops, and the CLI prints the one line and exits with ``exit_status``."""

    exit_status = 3


__all__ = ["ConfigError", "SyncMismatch"]

"""The errors a user can fix, on the ground floor so that every module can raise them.

``ConfigError`` is re-exported by ``relign.config`` (``from relign.config import ConfigError``
keeps working); the CLI prints it as one line and exits with status 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem a user can fix; the CLI prints it as one line."""


__all__ = ["ConfigError"]

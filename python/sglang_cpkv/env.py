"""Environment switches of the distribution, read one way."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(name, "").strip().lower() in _TRUE

"""Environment switches of the distribution, read one way."""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``
    (any case); ``default`` when unset or empty. Any other value is an error naming the variable."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(_TRUE + _FALSE)}")

"""Environment switches of the distribution, read one way."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_text(name: str) -> str:
    """The environment variable ``name`` as set; ``""`` when unset."""
    return os.environ.get(name, "")


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment variable ``name``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``
    (any case); ``default`` when unset or empty. Any other value is an error naming the variable."""
    value = env_text(name).strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected one of {', '.join(_TRUE + _FALSE)}")


@contextlib.contextmanager
def environment(values: Mapping[str, str] = {}, keep: tuple[str, ...] = ()) -> Iterator[None]:
    """For the block only: ``values`` set in ``os.environ``; those names and ``keep`` (names the block itself may
    set) are put back as they were after it, an unset one unset."""
    saved = {name: os.environ.get(name) for name in (*values, *keep)}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

"""Setting environment variables for a block of code (reading them: :mod:`sglang_cpkv.envs`, the registry)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


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

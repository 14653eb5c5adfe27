"""Secret values out of every argument list, environment line and message the launcher prints or logs.

A flag is secret-looking when its name has a word ``key`` (``--api-key``, ``--admin-api-key``,
``--hf-key``), contains ``token`` other than in ``tokens``/``tokenizer`` (``--hf-token``,
``--authtoken``; not ``--max-new-tokens``, ``--tokenizer-path``), or contains ``secret``,
``password`` or ``passwd``. Its value is redacted in both forms, ``--flag value`` (the next argument,
unless that is another ``--flag``) and ``--flag=value``. An environment variable is secret when its name
has one of those words (``HF_TOKEN``, ``SGLANG_API_KEY``). Free text (a parser's error, a log tail) is
scrubbed of every secret value found in the argument lists it may quote.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence

REDACTED = "<redacted>"
_TOKEN = re.compile(r"token(?!s|izer)")
_SECRET_ENV_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD")
# Variables holding argument lists (PD_PREFILL_EXTRA_ARGS, ...): redacted as arguments, not as one value.
_ARGS_ENV_SUFFIX = "_EXTRA_ARGS"


def is_secret_flag(flag: str) -> bool:
    """Whether ``flag`` (``--name`` or ``--name=value``) names a secret-looking option."""
    if not flag.startswith("--"):
        return False
    name = flag[2:].split("=", 1)[0].lower()
    return (
        "key" in name.split("-")
        or bool(_TOKEN.search(name))
        or any(word in name for word in ("secret", "password", "passwd"))
    )


def is_secret_env(name: str) -> bool:
    upper = name.upper()
    return any(word in upper for word in _SECRET_ENV_WORDS)


def secret_values(argv: Sequence[str]) -> list[str]:
    """The values of the secret-looking flags in ``argv``."""
    values = []
    for i, arg in enumerate(argv):
        if not is_secret_flag(arg):
            continue
        if "=" in arg:
            values.append(arg.split("=", 1)[1])
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
    return [v for v in values if v]


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret-looking flag replaced by ``<redacted>``."""
    out = list(argv)
    for i, arg in enumerate(argv):
        if not is_secret_flag(arg):
            continue
        if "=" in arg:
            out[i] = arg.split("=", 1)[0] + "=" + REDACTED
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[i + 1] = REDACTED
    return out


def redact_env_value(name: str, value: str) -> str:
    if is_secret_env(name):
        return REDACTED
    if name.endswith(_ARGS_ENV_SUFFIX):
        try:
            return shlex.join(redact_argv(shlex.split(value)))
        except ValueError:  # not splittable: nothing can tell its secrets apart
            return REDACTED
    return value


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret value replaced (longest first: one may contain another)."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text

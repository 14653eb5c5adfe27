"""Secret values out of every argument list, environment line, message and server output the launcher handles.

Secret-looking flags: a word ``key``/``keys``, ``token`` (not ``tokens``/``tokenizer``), ``secret``, ``password`` or
``passwd`` in the name, or a URL flag that may carry credentials; their values are redacted as ``--flag v ...`` (up
to the next flag) and ``--flag=v``. Secret variables: a ``_``-word of the name ends in ``TOKEN``, ``KEY(S)``,
``SECRET``, ``PASSWORD`` or ``PASSWD``. Free text (errors, log tails, the servers' output) is scrubbed of every known
secret value as written, ``repr``-quoted and JSON-quoted (values under ``MIN_SCRUB_CHARS`` only in commands), and a
URL's credentials (``scheme://user:password@host``) are redacted wherever it appears. Used by :mod:`.commands`,
:mod:`.dry_run` and :mod:`.lifecycle`; operations: ``docs/operations.md``, "Secrets".
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence

REDACTED = "<redacted>"
MIN_SCRUB_CHARS = 4
_TOKEN = re.compile(r"token(?!s|izer)")
_SECRET_ENV_WORD = re.compile(r"(TOKEN|KEYS?|SECRET|PASSWORD|PASSWD)$")
# Flags whose value is a connection URL that may carry a password (user:password@host).
_CREDENTIAL_URL_FLAGS = frozenset({"postgres-db-url", "redis-url"})
# Variables holding argument lists (PD_PREFILL_EXTRA_ARGS, ...): redacted as arguments, not as one value.
_ARGS_ENV_SUFFIX = "_EXTRA_ARGS"
# A URL's scheme and authority (up to the path, query or fragment, a space or a quote): its userinfo is everything up
# to the authority's last "@".
_URL_AUTHORITY = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^\s/?#'\"]+)")
_URL_AUTHORITY_BYTES = re.compile(_URL_AUTHORITY.pattern.encode())


def _without_userinfo(match: re.Match) -> str | bytes:
    scheme, authority = match.group(1), match.group(2)
    at = "@" if isinstance(authority, str) else b"@"
    if at not in authority:
        return match.group(0)
    redacted = REDACTED if isinstance(authority, str) else REDACTED.encode()
    return scheme + redacted + at + authority.rsplit(at, 1)[1]


def redact_urls(text: str) -> str:
    """``text`` with the credentials of every URL in it (``scheme://user:password@host``) replaced by ``<redacted>``."""
    return _URL_AUTHORITY.sub(_without_userinfo, text)


def url_credentials(text: str) -> list[str]:
    """The credentials of every URL in ``text``: its userinfo (``user:password``) and the password alone."""
    found = []
    for match in _URL_AUTHORITY.finditer(text):
        authority = match.group(2)
        if "@" in authority:
            userinfo = authority.rsplit("@", 1)[0]
            found += [userinfo, userinfo.partition(":")[2]]
    return [value for value in found if value and value != REDACTED]


def is_secret_flag(flag: str) -> bool:
    """Whether ``flag`` (``--name`` or ``--name=value``) names a secret-looking option."""
    if not flag.startswith("--"):
        return False
    name = flag[2:].split("=", 1)[0].lower()
    words = name.split("-")
    return (
        "key" in words
        or "keys" in words
        or bool(_TOKEN.search(name))
        or any(word in name for word in ("secret", "password", "passwd"))
        or name in _CREDENTIAL_URL_FLAGS
    )


def is_secret_env(name: str) -> bool:
    return any(_SECRET_ENV_WORD.search(word) for word in name.upper().split("_"))


def _secret_spans(argv: Sequence[str]) -> list[tuple[int, bool]]:
    """(index, inline) of every secret value in ``argv``: ``inline`` for ``--flag=value``."""
    spans = []
    for i, arg in enumerate(argv):
        if not is_secret_flag(arg):
            continue
        if "=" in arg:
            spans.append((i, True))
            continue
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            spans.append((j, False))
            j += 1
    return spans


def secret_values(argv: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """The values of the secret-looking flags in ``argv`` and of the secret variables in ``env``."""
    values = [argv[i].split("=", 1)[1] if inline else argv[i] for i, inline in _secret_spans(argv)]
    for arg in argv:
        values += url_credentials(arg)
    for name, value in (env or {}).items():
        values += url_credentials(value)
        if is_secret_env(name):
            values.append(value)
        elif name.endswith(_ARGS_ENV_SUFFIX):
            with contextlib.suppress(ValueError):  # not splittable: the launcher refuses it before anything runs
                values += secret_values(shlex.split(value))
    return [v for v in values if v]


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with every value of every secret-looking flag, and every URL's credentials, replaced by
    ``<redacted>``."""
    out = [redact_urls(arg) for arg in argv]
    for i, inline in _secret_spans(argv):
        out[i] = argv[i].split("=", 1)[0] + "=" + REDACTED if inline else REDACTED
    return out


def redact_env_value(name: str, value: str) -> str:
    if is_secret_env(name):
        return REDACTED
    if name.endswith(_ARGS_ENV_SUFFIX):
        try:
            return shlex.join(redact_argv(shlex.split(value)))
        except ValueError:  # not splittable: nothing can tell its secrets apart
            return REDACTED
    return redact_urls(value)


def scrub_forms(secrets: Iterable[str]) -> list[str]:
    """Each secret as written and as ``repr`` and JSON quote it, longest first (one may contain another)."""
    forms = set()
    for secret in secrets:
        if len(secret) >= MIN_SCRUB_CHARS:
            forms.update({secret, repr(secret)[1:-1], json.dumps(secret)[1:-1]})
    return sorted(forms, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every occurrence of each secret value, and every URL's credentials, replaced."""
    for form in scrub_forms(secrets):
        text = text.replace(form, REDACTED)
    return redact_urls(text)


class StreamScrubber:
    """Scrubs a byte stream that arrives in arbitrary chunks: a secret split across two chunks is still found.

    ``feed`` returns what is safe to emit: complete lines, or (for a long run without a newline) all but
    the last ``longest secret - 1`` bytes, which may be the start of a secret; ``flush`` returns the rest.
    """

    MAX_PENDING = 64 * 1024

    def __init__(self, secrets: Iterable[str]):
        self._forms = [form.encode() for form in scrub_forms(secrets)]
        self._hold = max((len(f) for f in self._forms), default=1) - 1
        self._pending = b""

    def _scrub(self, data: bytes) -> bytes:
        for form in self._forms:
            data = data.replace(form, REDACTED.encode())
        return _URL_AUTHORITY_BYTES.sub(_without_userinfo, data)

    def feed(self, chunk: bytes) -> bytes:
        data = self._scrub(self._pending + chunk)
        cut = data.rfind(b"\n") + 1
        if cut == 0 and len(data) > self.MAX_PENDING:
            cut = len(data) - self._hold
        self._pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        data, self._pending = self._pending, b""
        return data

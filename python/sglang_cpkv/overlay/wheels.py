"""Upstream wheels: the download cache, verified downloads, and reading a wheel without installing it.

A wheel is used only once its sha256 is known to be right: the pinned one against ``UPSTREAM.toml``,
any other release (``rebase``, ``show|diff --upstream``) against the sha256 the package index publishes
for that file (``$SGLANG_CPKV_INDEX_URL``, default PyPI's simple API), cached copies included.
"""

from __future__ import annotations

import base64
import dataclasses
import email.parser
import html.parser
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from sglang_cpkv.envs import envs
from sglang_cpkv.overlay.common import PACKAGE_DIR, OverlayError, log, sha256_file
from sglang_cpkv.overlay.pin import Pin

VERSION_FILES = ("_version.py", "version.py")
INDEX_URL_ENV = envs.SGLANG_CPKV_INDEX_URL.name
REDACTED = "<redacted>"
DEFAULT_INDEX_URL = envs.SGLANG_CPKV_INDEX_URL.default
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691; PEP 503 HTML is the fallback
INDEX_TIMEOUT_S = 60


def cache_dir(root: Path) -> Path:
    """Downloads: ``$SGLANG_CPKV_CACHE``, else ``<queue root>/.cache/upstream``."""
    return Path(envs.SGLANG_CPKV_CACHE.get() or root / ".cache" / "upstream")


def default_python_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


# ---------------------------------------------------------------------------------- the index


@dataclasses.dataclass(frozen=True)
class IndexFile:
    """One file of a project page of the package index."""

    filename: str
    sha256: str | None
    requires_python: str | None
    yanked: bool


class _LinkCollector(html.parser.HTMLParser):
    """The anchors of a PEP 503 project page: ``href``, ``data-requires-python``, ``data-yanked``."""

    def __init__(self) -> None:
        super().__init__()
        self.anchors: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a" and dict(attrs).get("href"):
            self.anchors.append(dict(attrs))


def _html_files(page: str) -> list[IndexFile]:
    collector = _LinkCollector()
    collector.feed(page)  # HTMLParser unescapes attribute values (``&gt;=3.9``)
    files = []
    for anchor in collector.anchors:
        parts = urllib.parse.urlsplit(anchor["href"])
        algorithm, _, digest = parts.fragment.partition("=")
        files.append(
            IndexFile(
                urllib.parse.unquote(parts.path.rsplit("/", 1)[-1]),
                digest if algorithm == "sha256" and digest else None,
                anchor.get("data-requires-python") or None,
                "data-yanked" in anchor,
            )
        )
    return files


def index_request(url: str) -> tuple[urllib.request.Request, str]:
    """The request for ``url`` and the form of ``url`` any output may show.

    A private index's URL may carry a credential: ``user:password@`` (sent as HTTP basic authentication, never
    as part of the URL: urllib would take it for a port) or a query string (a token). The shown form has
    ``<redacted>`` in their place."""
    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": f"{SIMPLE_JSON}, text/html;q=0.1"}
    shown = parts
    if "@" in parts.netloc:
        userinfo, host = parts.netloc.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        credential = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(credential).decode("ascii")
        parts, shown = parts._replace(netloc=host), parts._replace(netloc=f"{REDACTED}@{host}")
    if parts.query:
        shown = shown._replace(query=REDACTED)
    return urllib.request.Request(urllib.parse.urlunsplit(parts), headers=headers), urllib.parse.urlunsplit(shown)


def index_files(package: str) -> list[IndexFile]:
    """Every file the package index lists for ``package`` (PEP 691 JSON, else PEP 503 HTML).

    The one place the overlay tool reads the index (``$SGLANG_CPKV_INDEX_URL``, default PyPI's simple API).
    """
    base = urllib.parse.urlsplit(envs.SGLANG_CPKV_INDEX_URL.get())
    page = base._replace(path=f"{base.path.rstrip('/')}/{canonicalize_name(package)}/")
    request, shown = index_request(urllib.parse.urlunsplit(page))
    try:
        with urllib.request.urlopen(request, timeout=INDEX_TIMEOUT_S) as response:
            content_type = response.headers.get_content_type()
            body = response.read()
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections; a URL urllib cannot parse
        reason = str(getattr(exc, "reason", exc)).replace(request.full_url, shown)
        raise OverlayError(
            f"cannot read {shown} ({reason}): the overlay tool reads the sha256 of upstream "
            f"wheels and the versions of the packages it pins there (another index: ${INDEX_URL_ENV})"
        ) from None
    if content_type != SIMPLE_JSON:
        return _html_files(body.decode("utf-8", "replace"))
    return [
        IndexFile(
            entry["filename"],
            entry.get("hashes", {}).get("sha256"),
            entry.get("requires-python") or None,
            bool(entry.get("yanked")),  # false, true or the reason
        )
        for entry in json.loads(body)["files"]
    ]


def published_sha256(package: str, filename: str) -> str:
    """The sha256 the package index publishes for ``filename``."""
    hashes = {f.filename: f.sha256 for f in index_files(package)}
    where = f"the index's page of {canonicalize_name(package)}"
    if filename not in hashes:
        raise OverlayError(f"{where} lists no {filename}")
    if not hashes[filename]:
        raise OverlayError(f"{where} publishes no sha256 for {filename}")
    return hashes[filename]


# ---------------------------------------------------------------------------------- downloads


def pip_download(package: str, version: str, tag: str, platform: str, dest: Path) -> Path:
    """``pip download --no-deps`` one wheel for ``tag``/``platform`` into ``dest``; return its path.

    The download lands in a temporary directory first so the cache never holds a partial file; the
    caller checks its sha256.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--implementation",
            "cp",
            "--python-version",
            f"{tag[2]}.{tag[3:]}",
            "--abi",
            tag,
            "--platform",
            platform,
            "--dest",
            tmp,
            f"{package}=={version}",
        ]
        log(f"downloading {package}=={version} ({tag}, {platform})")
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        got = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(got) != 1:
            raise OverlayError(
                f"pip download of {package}=={version} for {tag}/{platform} failed (exit {proc.returncode})"
            )
        target = dest / got[0].name
        os.replace(got[0], target)
    return target


def fetch_pinned(pin: Pin, tag: str, dest: Path) -> Path:
    """A copy of the pinned wheel for ``tag`` in ``dest`` whose sha256 is the pin's, downloaded if needed."""
    if tag not in pin.wheels:
        raise OverlayError(f"UPSTREAM.toml pins no wheel for {tag} (pinned: {', '.join(sorted(pin.wheels))})")
    want = pin.wheels[tag]
    path = dest / want.filename
    if path.is_file():
        found = sha256_file(path)
        if found == want.sha256:
            log(f"using cached {path}")
            return path
        log(f"cached {path} has sha256 {found}, expected {want.sha256}: downloading again")
        path.unlink()
    path = pip_download(pin.package, pin.version, tag, want.platform, dest)
    if path.name != want.filename:
        raise OverlayError(f"pip downloaded {path.name}, expected {want.filename}")
    found = sha256_file(path)
    if found != want.sha256:
        path.unlink()
        raise OverlayError(f"{want.filename}: sha256 mismatch: expected {want.sha256} (UPSTREAM.toml), found {found}")
    return path


def pinned_wheel(root: Path, pin: Pin) -> Path:
    """The verified pinned wheel: this interpreter's Python tag if pinned, else the first pinned tag."""
    return fetch_pinned(pin, default_tag(pin), cache_dir(root))


def default_tag(pin: Pin) -> str:
    """This interpreter's Python tag if the pin has a wheel for it, else the pin's first tag.

    The tool reads only the ``.py`` files the queue touches, which every Python tag's wheel has alike.
    """
    return default_python_tag() if default_python_tag() in pin.wheels else next(iter(pin.wheels))


def fetch_release(package: str, version: str, tag: str, platform: str, dest: Path) -> Path:
    """The wheel of a release that is not pinned (yet), whose sha256 is the one the index publishes.

    A cached copy with another sha256 is refused and downloaded again; a download with another
    sha256 is an error and is not kept.
    """
    for cached in sorted(dest.glob(f"{package}-{version}-{tag}-{tag}-{platform}.whl")):
        published, found = published_sha256(package, cached.name), sha256_file(cached)
        if found == published:
            log(f"using cached {cached} (sha256 as the index publishes it)")
            return cached
        log(f"refusing cached {cached}: sha256 {found}, the index publishes {published}; downloading again")
        cached.unlink()
    path = pip_download(package, version, tag, platform, dest)
    published, found = published_sha256(package, path.name), sha256_file(path)
    if found != published:
        path.unlink()
        raise OverlayError(f"{path.name}: the download has sha256 {found}, the index publishes {published}")
    return path


# ---------------------------------------------------------------------------------- reading wheels


def read_wheel_files(wheel: Path, rel_paths: Iterable[str]) -> dict[str, bytes | None]:
    """Bytes of ``sglang/<rel>`` members of ``wheel`` (``None`` for a member it lacks)."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        return {rel: zf.read(f"{PACKAGE_DIR}/{rel}") if f"{PACKAGE_DIR}/{rel}" in names else None for rel in rel_paths}


def _marker_environment(tag: str, platform: str) -> dict[str, str]:
    """The marker variables of the machine a ``tag``/``platform`` wheel installs on, for a plain install (no extra)."""
    python = f"{tag[2]}.{tag[3:]}"
    env = {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython"}
    env["platform_python_implementation"] = "CPython"
    linux = re.match(r"^(?:many|musl)?linux(?:_\d+_\d+|1|2010|2014)?_(.+)$", platform)
    if linux:
        env.update(sys_platform="linux", platform_system="Linux", os_name="posix", platform_machine=linux.group(1))
    env["extra"] = ""
    return env


def plain_requirements(wheel: Path, tag: str, platform: str) -> list[Requirement]:
    """The ``Requires-Dist`` of a plain install of ``wheel`` (no extra) on a ``tag``/``platform`` machine.

    Parsed with ``packaging``: extras of a dependency (``name[cu13]==1.0``) and the old parenthesized
    form are understood, markers are evaluated for the wheel's own Python and platform, and
    requirements of an extra (``; extra == "test"``) or of another platform are left out.
    """
    with zipfile.ZipFile(wheel) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise OverlayError(f"{wheel.name}: no .dist-info/METADATA")
        message = email.parser.BytesParser().parsebytes(zf.read(meta))
    env = _marker_environment(tag, platform)
    requirements = []
    for line in message.get_all("Requires-Dist") or []:
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise OverlayError(f"{wheel.name}: unreadable Requires-Dist {line!r} ({exc})") from exc
        if req.marker is None or req.marker.evaluate(env):
            requirements.append(req)
    return requirements


def wheel_requirements(wheel: Path, tag: str, platform: str) -> dict[str, str]:
    """``name -> version`` (names normalized) for every :func:`plain_requirements` entry that pins exactly one version."""
    pins: dict[str, str] = {}
    for req in plain_requirements(wheel, tag, platform):
        exact = [s.version for s in req.specifier if s.operator in ("==", "===") and "*" not in s.version]
        if len(exact) == 1:
            pins.setdefault(canonicalize_name(req.name), exact[0])
    return pins


def unpack_subset(wheel: Path, rel_paths: Iterable[str], dest: Path) -> Path:
    """Write the version files and ``rel_paths`` of the wheel's ``sglang/`` under ``dest``; return the package dir."""
    root = dest / PACKAGE_DIR
    for rel, data in read_wheel_files(wheel, [*VERSION_FILES, *rel_paths]).items():
        if data is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
    return root


def tree_version(sglang_root: Path) -> str:
    """The upstream version of an installed or unpacked ``sglang`` dir, read without importing it."""
    pattern = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
    for name in VERSION_FILES:
        path = sglang_root / name
        if path.is_file():
            match = pattern.search(path.read_text(encoding="utf-8"))
            if match:
                return match.group(1)
    for meta in sorted(sglang_root.parent.glob(f"{PACKAGE_DIR}-*.dist-info/METADATA")):
        match = re.search(r"^Version: (\S+)", meta.read_text(encoding="utf-8"), re.M)
        if match:
            return match.group(1)
    raise OverlayError(
        f"{sglang_root}: cannot read the upstream version (no {' / '.join(VERSION_FILES)} with __version__, no dist-info)"
    )

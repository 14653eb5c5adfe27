"""The pin, ``UPSTREAM.toml``, and the queue root that holds it beside ``patches/``.

Read here with the standard library only, so that ``apply`` and ``verify`` run wherever our package is
installed; ``rebase`` rewrites the pin (:mod:`sglang_cpkv.overlay.repin`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from sglang_cpkv.envs import envs
from sglang_cpkv.overlay.common import OverlayError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PIN_FILE = "UPSTREAM.toml"


def _is_queue_root(path: Path) -> bool:
    return (path / PIN_FILE).is_file() and (path / "patches").is_dir()


def find_queue_root(explicit: str | None = None) -> Path:
    """The directory holding ``UPSTREAM.toml`` and ``patches/``.

    ``--queue-root``, else ``$SGLANG_CPKV_ROOT``, else the repo around this file (editable install),
    else the current directory or one of its parents.
    """
    for source, value in (("--queue-root", explicit), (envs.SGLANG_CPKV_ROOT.name, envs.SGLANG_CPKV_ROOT.get())):
        if value:
            root = Path(value).resolve()
            if not _is_queue_root(root):
                raise OverlayError(f"{source}={value}: no {PIN_FILE} and patches/ there")
            return root
    repo = Path(__file__).resolve().parents[3]  # python/sglang_cpkv/overlay/pin.py
    for candidate in [repo, Path.cwd(), *Path.cwd().parents]:
        if _is_queue_root(candidate):
            return candidate
    raise OverlayError(f"cannot find the queue root ({PIN_FILE} + patches/): pass --queue-root or set SGLANG_CPKV_ROOT")


@dataclasses.dataclass(frozen=True)
class WheelPin:
    tag: str
    filename: str
    sha256: str

    @property
    def platform(self) -> str:
        """The platform tag of the wheel file name (``name-ver-py-abi-platform.whl``)."""
        return self.filename[: -len(".whl")].split("-")[4]


@dataclasses.dataclass(frozen=True)
class Pin:
    package: str
    version: str
    wheels: dict[str, WheelPin]


def load_pin(root: Path) -> Pin:
    path = root / PIN_FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise OverlayError(f"{path}: not valid TOML ({exc})") from exc
    try:
        upstream = data["upstream"]
        wheels = {
            tag: WheelPin(tag, entry["filename"], entry["sha256"]) for tag, entry in upstream.get("wheels", {}).items()
        }
        pin = Pin(upstream["package"], upstream["version"], wheels)
    except (KeyError, TypeError, AttributeError) as exc:
        raise OverlayError(f"{path}: malformed [upstream] table ({exc!r})") from exc
    texts = [pin.package, pin.version, *[v for w in wheels.values() for v in (w.filename, w.sha256)]]
    if not wheels or not all(isinstance(text, str) and text for text in texts):
        raise OverlayError(f"{path}: [upstream] needs a package, a version and at least one [upstream.wheels.TAG]")
    for wheel in wheels.values():
        if not wheel.filename.endswith(".whl") or len(wheel.filename.split("-")) != 5:
            raise OverlayError(f"{path}: [upstream.wheels.{wheel.tag}] filename {wheel.filename!r} is not a wheel name")
    return pin

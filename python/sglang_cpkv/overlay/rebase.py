"""``overlay rebase --to VERSION``: move the pin, the queue and every version reference onto another release.

Every patch is tried in series order against the new release's files: strictly (applies cleanly), then
with offsets (refreshed, its header comment kept), then reversed (already contained upstream: retired
into the manifest's history); a patch that passes none of these conflicts, and the report lists every
hunk that fails with offsets allowed, in every file. GNU ``patch --dry-run -F0`` cross-checks each
verdict when it is installed. The requirement files that pin upstream's import closure move with the pin
(:mod:`sglang_cpkv.overlay.closure`). Files change only when every patch survives and every closure pin
that must move has a version to move to; else the report ends with the commands to run next. A rebase
onto the pinned version itself changes nothing.
"""

from __future__ import annotations

import difflib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name

from sglang_cpkv.overlay.closure import ClosureEntry, closure_files, plan_closure, rewrite_closure
from sglang_cpkv.overlay.common import OverlayError, log, sha256_bytes, sha256_file, write_if_changed
from sglang_cpkv.overlay.patches import Patch, Verdict, classify, make_diff, split_lines
from sglang_cpkv.overlay.pin import PIN_FILE, WheelPin, load_pin
from sglang_cpkv.overlay.pin_rewrite import rewrite_pin_toml, rewrite_version_references
from sglang_cpkv.overlay.queue import Queue, dump_manifest, load_queue, require_valid
from sglang_cpkv.overlay.wheels import (
    cache_dir,
    fetch_pinned,
    fetch_release,
    index_files,
    read_wheel_files,
    tree_version,
    unpack_subset,
    wheel_requirements,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


VERDICT_TEXT = {
    "clean": "applies cleanly",
    "offsets": "applies with offsets",
    "contained": "already contained upstream (reverse-applies): retirement candidate",
    "conflict": "CONFLICT",
}
VERDICT_ACTION = {"offsets": "refreshed", "contained": "retired: moved to the manifest's history"}


def _hunk_names(hunks: set[tuple[str, int]]) -> str:
    return ", ".join(f"{path} hunk {number}" for path, number in sorted(hunks)) or "none"


def gnu_patch_rejects(files: dict[str, list[str]], patch_text: str) -> set[tuple[str, int]] | None:
    """``(path, hunk number)`` of every hunk ``patch --dry-run -F0`` rejects; ``None`` without GNU patch."""
    exe = shutil.which("patch")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory(prefix="cpkv-rebase-patch-") as tmp:
        for rel, lines in files.items():
            (Path(tmp) / "sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / "sglang" / rel).write_text("".join(lines), encoding="utf-8")
        (Path(tmp) / "queue.patch").write_text(patch_text, encoding="utf-8")
        # --force: never guess that a patch is reversed (the reverse is our own "contained" check)
        cmd = [exe, "--dry-run", "--force", "-p1", "-F0", "-i", "queue.patch"]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 1: some hunks failed; 2: trouble
        raise OverlayError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    rejects, current = set(), ""
    for line in proc.stdout.splitlines():
        opened = re.match(r"^(?:checking|patching) file (.+)$", line)
        if opened:
            current = opened.group(1).strip("'\"").removeprefix("sglang/")
        failed = re.match(r"^Hunk #(\d+) FAILED", line)
        if failed:
            rejects.add((current, int(failed.group(1))))
    return rejects


def cross_check(verdict: Verdict, rejects: set[tuple[str, int]]) -> str:
    """Where GNU patch's rejects disagree with ``verdict`` (empty when they agree or do not apply to it)."""
    if verdict.kind == "contained" or (verdict.kind == "conflict" and not verdict.failures):
        return ""  # a contained patch fails forward by definition; a missing file has no hunks to compare
    ours = {(f.path, f.index + 1) for f in verdict.failures}
    return "" if rejects == ours else f"`patch --dry-run -F0` disagrees: it rejects {_hunk_names(rejects)}"


def _diff(before: str, after: str, name: str) -> str:
    return "".join(difflib.unified_diff(split_lines(before), split_lines(after), name, name))


def render_report(
    old: str,
    new: str,
    root: Path,
    wheels: dict[str, WheelPin],
    verdicts: list[Verdict],
    ok: bool,
    disagreements: dict[str, str] | None,
    unpinned_kernels: list[str],
    closure: list[ClosureEntry] | None,
    changes_diff: str,
    next_steps: list[str],
) -> str:
    """The markdown report; ``disagreements`` is ``None`` when GNU patch did not run, ``closure`` when the
    pin has no ``[closure]`` table."""
    if disagreements is None:
        checked = "not run: GNU patch is not installed"
    elif disagreements:
        checked = f"`patch --dry-run -F0` DISAGREES on {len(disagreements)} patches (see their details)"
    else:
        checked = "`patch --dry-run -F0` agrees with every verdict"
    result = (
        "SUCCESS: UPSTREAM.toml, manifest, refreshed patches, version references and closure pins updated"
        if ok
        else "FAILED: nothing was changed (see Next steps)"
    )
    if closure is None:
        requirements = f"not checked: {PIN_FILE} has no [closure] table"
    else:
        counts = {action: sum(e.action == action for e in closure) for action in ("moved", "flagged", "kept")}
        requirements = (
            f"{counts['moved']} closure pins {'moved' if ok else 'to move'}, {counts['flagged']} FLAGGED, "
            f"{counts['kept']} kept as deliberate divergences (see Requirements)"
            if closure
            else f"every closure pin ({PIN_FILE} [closure]) is allowed by the {new} wheel's Requires-Dist"
        )
    lines = [
        f"# Rebase report: sglang {old} -> {new}",
        "",
        f"- queue: `{root}` ({len(verdicts)} patches in `patches/series`)",
        *[
            f"- wheel {tag}: `{w.filename}` sha256 `{w.sha256}` (as the index publishes it)"
            for tag, w in sorted(wheels.items())
        ],
        f"- result: {result}",
        f"- cross-check: {checked}",
        f"- requirements: {requirements}",
        *(
            [
                f"- [kernels] not pinned by the {new} wheel's metadata, left as they were (check them): {', '.join(unpinned_kernels)}"
            ]
            if unpinned_kernels
            else []
        ),
        "",
        "| # | patch | verdict | details |",
        "|---|---|---|---|",
    ]
    for i, v in enumerate(verdicts, 1):
        action = f"; {VERDICT_ACTION[v.kind]}" if ok and v.kind in VERDICT_ACTION else ""
        detail = "; ".join(part for part in (v.detail, (disagreements or {}).get(v.patch)) if part)
        lines.append(f"| {i} | `{v.patch}` | {VERDICT_TEXT[v.kind]}{action} | {detail} |")
    for v in verdicts:
        if not v.failures:
            continue
        agreed = disagreements is not None and v.patch not in disagreements
        confirmed = " `patch --dry-run -F0` rejects the same hunks." if agreed else ""
        lines += ["", f"## Conflict: `{v.patch}`: {len(v.failures)} failing hunks", ""]
        lines += [f"Each hunk's old lines are nowhere in the file, offsets allowed.{confirmed}"]
        for failure in v.failures:
            lines += [
                "",
                f"### {failure.path} hunk {failure.index + 1}",
                "",
                "```diff",
                failure.hunk.render().rstrip("\n"),
                "```",
            ]
    if closure:
        lines += [
            "",
            "## Requirements",
            "",
            f"Pins of upstream's import closure ({PIN_FILE} [closure]) that the {new} wheel's Requires-Dist does not allow.",
            "",
            f"| pin | package | pinned | {new} requires | action |",
            "|---|---|---|---|---|",
        ]
        for e in closure:
            action = {
                "moved": f"{'moved' if ok else 'to move'} to {e.version}: {e.detail}",
                "kept": f"kept: {old} required {e.detail}, which this pin did not meet either (a deliberate divergence)",
                "flagged": f"FLAGGED: {e.detail}; pin a version that `{e.required}` allows by hand",
            }[e.action]
            where = f"`{e.pin.file}:{e.pin.line}`"
            lines.append(f"| {where} | {e.pin.name} | {e.pin.version} | `{e.required}` | {action} |")
    if ok:
        lines += ["", "## Changes", "", "```diff", changes_diff.rstrip("\n"), "```"]
    else:
        lines += ["", "## Next steps", "", *next_steps]
    return "\n".join(lines) + "\n"


def next_steps(
    root: Path, new: str, verdicts: list[Verdict], closure: list[ClosureEntry], report_path: Path | None
) -> list[str]:
    """The commands a maintainer runs after a failed rebase: redo each conflicting patch, pin each flagged
    requirement, run the rebase again (markdown lines)."""
    tool = f"python -m sglang_cpkv.overlay --queue-root {shlex.quote(str(root))}"
    commands = []
    for v in verdicts:
        if v.kind != "conflict":
            continue
        if not v.failures:  # a file of the patch is not in the new release: nothing to show
            commands += [f"# {v.patch}: {v.detail}: redo it by hand, or drop it from series and the manifest"]
            continue
        files = list(dict.fromkeys(f.path for f in v.failures))
        redo = root / ".cache" / "rebase-redo" / new / v.patch.removesuffix(".patch")
        edited = {rel: shlex.quote(str(redo / rel)) for rel in files}
        commands += [
            f"# {v.patch}: {', '.join(files)}",
            "mkdir -p " + " ".join(sorted({shlex.quote(str((redo / rel).parent)) for rel in files})),
            *[f"{tool} show --upstream {new} --patch {v.patch} --file {rel} > {edited[rel]}" for rel in files],
            *[f"$EDITOR {edited[rel]}  # make the patch's change to {rel} again" for rel in files],
            f"{tool} diff --upstream {new} --patch {v.patch} "
            + " ".join(f"--file {rel} --edited {edited[rel]}" for rel in files),
        ]
    for e in closure:
        if e.action == "flagged":
            commands.append(
                f"# {e.pin.file}:{e.pin.line}: pin {e.pin.name} to a version that `{e.required}` allows "
                f"(now {e.pin.version}{', with its --hash' if e.pin.hashed else ''})"
            )
    report = f" --report {shlex.quote(str(report_path))}" if report_path is not None else ""
    commands.append(f"{tool} rebase --to {new}{report}")
    intro = (
        f"Redo each conflicting patch against {new} in series order (`show` of a file waits only for the "
        "earlier conflicting patches that touch that file), pin each flagged requirement, then run the rebase again:"
    )
    return [intro, "", "```sh", *commands, "```"]


def _try_queue(
    patches: list[Patch], files: dict[str, list[str]], patch_texts: dict[str, str]
) -> tuple[list[Verdict], dict[str, str], dict[str, str] | None]:
    """Every patch in order on the new release's ``files``: the verdicts, the refreshed texts of the
    patches that moved, and GNU patch's disagreements (``None`` when it is not installed)."""
    verdicts: list[Verdict] = []
    refreshed: dict[str, str] = {}
    disagreements: dict[str, str] | None = {}
    conflicted: dict[str, str] = {}  # file -> the first conflicting patch that touches it
    for patch in patches:
        before = {rel: list(files[rel]) for rel in dict.fromkeys(patch.touches) if rel in files}
        verdict = classify(files, patch)
        if verdict.kind == "conflict":
            earlier = sorted({conflicted[f.path] for f in verdict.failures if f.path in conflicted})
            if earlier:  # that patch's lines are missing from the file this one was tried on
                names = ", ".join(earlier)
                verdict.detail += f"; the earlier conflicting {names} also touches that file (redo it first where this one stacks on it)"
            for rel in patch.touches:
                conflicted.setdefault(rel, patch.name)
        rejects = gnu_patch_rejects(before, patch_texts[patch.name])
        if rejects is None:
            disagreements = None
        elif disagreements is not None:
            disagreement = cross_check(verdict, rejects)
            if disagreement:
                disagreements[patch.name] = disagreement
        verdicts.append(verdict)
        if verdict.kind == "offsets":
            refreshed[patch.name] = patch.header + "".join(
                make_diff(rel, "".join(before[rel]), "".join(files[rel])) for rel in before
            )
    return verdicts, refreshed, disagreements


def _moved_manifest(
    queue: Queue, patches: list[Patch], retired: set[str], package: str, version: str, base: dict[str, bytes | None]
) -> dict:
    """The manifest on ``version``, its own order of entries and keys kept."""
    entries = {e["patch"]: e for e in queue.manifest["patches"]}
    manifest = dict(queue.manifest)
    manifest["patches"] = [
        {**e, "last_refreshed": version} for e in queue.manifest["patches"] if e["patch"] not in retired
    ]
    manifest["history"] = [
        *queue.manifest["history"],
        *[
            {
                "patch": name,
                "description": entries[name]["description"],
                "retired_in": version,
                "reason": f"contained upstream in {package} {version} (reverse-applies); retire_when was: {entries[name]['retire_when']}",
            }
            for name in queue.series
            if name in retired
        ],
    ]
    still_touched = {p for patch in patches if patch.name not in retired for p in patch.touches}
    manifest["pristine_sha256"] = {
        rel: sha256_bytes(blob) for rel, blob in sorted(base.items()) if rel in still_touched and blob is not None
    }
    return manifest


def rebase(root: Path, version: str, report_path: Path | None = None) -> tuple[bool, str]:
    """Move the queue onto upstream ``version``; change files only when every patch survives."""
    pin = load_pin(root)
    queue = load_queue(root)
    require_valid(queue, pin)
    patches = queue.parsed()
    paths = {
        tag: fetch_release(pin.package, version, tag, old.platform, cache_dir(root)) for tag, old in pin.wheels.items()
    }
    new_wheels = {tag: WheelPin(tag, path.name, sha256_file(path)) for tag, path in paths.items()}
    first_tag = next(iter(paths))
    first = paths[first_tag]
    touched = sorted({p for patch in patches for p in patch.touches})
    blobs = {tag: read_wheel_files(path, touched) for tag, path in paths.items()}
    differing = [rel for rel in touched if len({b[rel] for b in blobs.values()}) > 1]
    if differing:
        raise OverlayError(
            f"{pin.package} {version} wheels differ between Python tags in touched files: {', '.join(differing)}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        found = tree_version(unpack_subset(first, [], Path(tmp)))
    if found != version:
        raise OverlayError(f"{first.name} reports version {found}, expected {version}")
    base = blobs[first_tag]
    files = {rel: split_lines(blob.decode()) for rel, blob in base.items() if blob is not None}
    patch_texts = {name: queue.patch_text(name) for name in queue.series}
    verdicts, refreshed, disagreements = _try_queue(patches, files, patch_texts)
    ok = all(v.kind != "conflict" for v in verdicts)

    pin_text = (root / PIN_FILE).read_text(encoding="utf-8")
    closure_table = closure_files(pin_text, pin)
    closure = None
    if closure_table:
        old_wheel = fetch_pinned(pin, first_tag, cache_dir(root))
        closure = plan_closure(root, pin, closure_table, old_wheel, first, index_files)
        ok = ok and all(e.action != "flagged" for e in closure)
    requirements = wheel_requirements(first, first_tag, new_wheels[first_tag].platform)
    kernels_table = tomllib.loads(pin_text).get("kernels", {})
    kernels = {k: requirements[canonicalize_name(k)] for k in kernels_table if canonicalize_name(k) in requirements}
    unpinned_kernels = [k for k in kernels_table if k not in kernels]
    new_pin_text = rewrite_pin_toml(pin_text, pin.version, version, new_wheels, kernels)
    _check_pin_text(new_pin_text, version, new_wheels, kernels)
    rewrites = {root / PIN_FILE: (pin_text, new_pin_text)} if new_pin_text != pin_text else {}
    rewrites.update(rewrite_version_references(root, pin.version, version))
    rewrites.update(rewrite_closure(root, closure or []))
    changes_diff = "".join(_diff(a, b, path.relative_to(root).as_posix()) for path, (a, b) in rewrites.items())
    steps = [] if ok else next_steps(root, version, verdicts, closure or [], report_path)
    report = render_report(
        pin.version,
        version,
        root,
        new_wheels,
        verdicts,
        ok,
        disagreements,
        unpinned_kernels,
        closure,
        changes_diff,
        steps,
    )
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(report, encoding="utf-8")
    if not ok:
        return False, report

    retired = {v.patch for v in verdicts if v.kind == "contained"}
    manifest = _moved_manifest(queue, patches, retired, pin.package, version, base)
    series_text = "".join(
        line
        for line in (queue.patches_dir / "series").read_text(encoding="utf-8").splitlines(keepends=True)
        if line.split("#", 1)[0].strip() not in retired
    )
    for name, text in refreshed.items():
        write_if_changed(queue.patches_dir / name, text.encode())
    for name in retired:
        (queue.patches_dir / name).unlink()
    write_if_changed(queue.patches_dir / "series", series_text.encode())
    write_if_changed(queue.patches_dir / "manifest.json", dump_manifest(manifest).encode())
    for path, (_, text) in rewrites.items():
        write_if_changed(path, text.encode())
        log(f"rewrote {path.relative_to(root)} for {pin.package} {version}")
    return True, report


def _check_pin_text(text: str, version: str, wheels: dict[str, WheelPin], kernels: dict[str, str]) -> None:
    """The rewritten pin, read back, says what the rebase means it to (before anything is written)."""
    data = tomllib.loads(text)
    upstream = data.get("upstream", {})
    got = {
        "version": upstream.get("version"),
        "wheels": {tag: (w.get("filename"), w.get("sha256")) for tag, w in upstream.get("wheels", {}).items()},
        "kernels": {k: v for k, v in data.get("kernels", {}).items() if k in kernels},
    }
    want = {
        "version": version,
        "wheels": {tag: (w.filename, w.sha256) for tag, w in wheels.items()},
        "kernels": kernels,
    }
    if got != want:
        raise OverlayError(
            f"rewriting {PIN_FILE} went wrong: it would read {got}, expected {want}; nothing was changed"
        )

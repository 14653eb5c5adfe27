"""The patch format and the applier: ``-p1`` unified diffs of files of the ``sglang`` package.

Patches apply strictly: every hunk's old lines must sit exactly at the stated line numbers (no fuzz,
no offsets), and a run changes files only once every hunk of every patch has applied. Only on another
release are offsets allowed (:func:`classify`: how a patch meets it, for ``rebase`` and ``show|diff
--upstream``), and a patch that conflicts there is reported with every hunk that fails even so
(:func:`failing_hunks`). The applier is pure Python because the Docker image may lack
``patch``; its offset search follows GNU patch's, so ``patch --dry-run -F0`` can cross-check it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Sequence

from sglang_cpkv.overlay.common import PACKAGE_DIR, OverlayError

DIFF_CONTEXT = 3


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split at ``\\n`` only (``str.splitlines`` also splits at form feeds etc.)."""
    parts = text.split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


@dataclasses.dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]]  # (" " | "-" | "+", text with its line ending)

    @property
    def old_lines(self) -> list[str]:
        return [text for op, text in self.lines if op != "+"]

    @property
    def new_lines(self) -> list[str]:
        return [text for op, text in self.lines if op != "-"]

    def reversed(self) -> Hunk:
        flip = {"+": "-", "-": "+", " ": " "}
        return Hunk(self.new_start, self.new_len, self.old_start, self.old_len, [(flip[op], t) for op, t in self.lines])

    def render(self) -> str:
        out = [f"@@ -{self.old_start},{self.old_len} +{self.new_start},{self.new_len} @@\n"]
        for op, text in self.lines:
            out.append(op + text if text.endswith("\n") else f"{op}{text}\n\\ No newline at end of file\n")
        return "".join(out)


@dataclasses.dataclass
class FilePatch:
    path: str  # relative to the sglang package, e.g. srt/server_args.py
    hunks: list[Hunk]
    text: str = ""  # the section as the patch file writes it, from its '---' line


@dataclasses.dataclass
class Patch:
    name: str
    header: str  # text before the first diff (a comment), kept by refreshes
    files: list[FilePatch]

    @property
    def touches(self) -> list[str]:
        return [fp.path for fp in self.files]


class HunkFailure(OverlayError):
    """A hunk whose old lines are not where (or anywhere) the patch says."""

    def __init__(self, patch: str, path: str, index: int, hunk: Hunk, reason: str):
        super().__init__(f"{patch}: {path} hunk {index + 1} ({hunk.render().splitlines()[0]}): {reason}")
        self.patch, self.path, self.index, self.hunk, self.reason = patch, path, index, hunk, reason


def _diff_path(raw: str, prefix: str, where: str) -> str:
    if "\t" in raw:
        raise OverlayError(f"{where}: timestamps are not allowed in patch headers ({raw.strip()!r})")
    raw = raw.strip()
    if raw == "/dev/null":
        raise OverlayError(f"{where}: patches may only modify existing upstream files (found /dev/null)")
    if not raw.startswith(f"{prefix}{PACKAGE_DIR}/"):
        raise OverlayError(f"{where}: path {raw!r} must start with {prefix}{PACKAGE_DIR}/")
    return raw[len(prefix) + len(PACKAGE_DIR) + 1 :]


def parse_patch(text: str, name: str) -> Patch:
    """Parse a ``-p1`` unified diff with ``a/sglang/...`` and ``b/sglang/...`` paths."""
    lines = split_lines(text)
    header: list[str] = []
    files: list[FilePatch] = []
    i = 0
    while i < len(lines) and not lines[i].startswith(("--- ", "diff --git ")):
        header.append(lines[i])
        i += 1
    while i < len(lines):
        line = lines[i]
        if line.startswith(("diff --git ", "index ")):
            i += 1
            continue
        if not line.startswith("--- "):
            raise OverlayError(f"{name}:{i + 1}: expected '--- a/{PACKAGE_DIR}/...', found {line.rstrip()!r}")
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise OverlayError(f"{name}:{i + 2}: expected '+++ b/{PACKAGE_DIR}/...' after {line.rstrip()!r}")
        old = _diff_path(line[4:], "a/", f"{name}:{i + 1}")
        new = _diff_path(lines[i + 1][4:], "b/", f"{name}:{i + 2}")
        if old != new:
            raise OverlayError(f"{name}:{i + 1}: renames are not supported ({old} -> {new})")
        start = i
        i += 2
        file_patch = FilePatch(old, [])
        while i < len(lines) and lines[i].startswith("@@"):
            m = re.match(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[i])
            if not m:
                raise OverlayError(f"{name}:{i + 1}: malformed hunk header {lines[i].rstrip()!r}")
            hunk = Hunk(int(m[1]), 1 if m[2] is None else int(m[2]), int(m[3]), 1 if m[4] is None else int(m[4]), [])
            i += 1
            old_seen = new_seen = 0
            while old_seen < hunk.old_len or new_seen < hunk.new_len:
                if i >= len(lines):
                    raise OverlayError(f"{name}: {old} hunk at -{hunk.old_start} ends early (file truncated?)")
                body = lines[i]
                op, text = (" ", "\n") if body in ("\n", "\r\n") else (body[0], body[1:])
                if op not in " -+":
                    raise OverlayError(f"{name}:{i + 1}: unexpected line in hunk: {body.rstrip()!r}")
                hunk.lines.append((op, text))
                old_seen += op != "+"
                new_seen += op != "-"
                i += 1
                if i < len(lines) and lines[i].startswith("\\"):
                    hunk.lines[-1] = (op, text.rstrip("\r\n"))
                    i += 1
            if old_seen != hunk.old_len or new_seen != hunk.new_len:
                raise OverlayError(f"{name}: {old} hunk at -{hunk.old_start}: line counts do not match its header")
            file_patch.hunks.append(hunk)
        if not file_patch.hunks:
            raise OverlayError(f"{name}: {old} has no hunks")
        file_patch.text = "".join(lines[start:i])
        files.append(file_patch)
    if not files:
        raise OverlayError(f"{name}: no diff found")
    return Patch(name, "".join(header), files)


def _find_block(
    lines: Sequence[str], block: Sequence[str], expected: int, lower: int, allow_offset: bool
) -> int | None:
    """Index where ``block`` occurs in ``lines``: at ``expected`` or, with offsets, the nearest one at/after ``lower``.

    At equal distance the later spot wins, as in GNU patch's search.
    """

    def matches(at: int) -> bool:
        return lower <= at <= len(lines) - len(block) and list(lines[at : at + len(block)]) == list(block)

    if matches(expected):
        return expected
    if not allow_offset:
        return None
    for distance in range(1, len(lines) + 1):
        for at in (expected + distance, expected - distance):
            if matches(at):
                return at
    return None


def _apply_hunks(
    lines: list[str], fp: FilePatch, patch_name: str, allow_offset: bool
) -> tuple[list[str], list[int], list[HunkFailure]]:
    """Apply one file's hunks, skipping those that fail; return the new lines, each applied hunk's offset
    (0 when exact) and the failures.

    A failed hunk leaves the search where it was: the next hunk is looked for after the last applied
    one, with that one's offset carried forward, as GNU patch does.
    """
    out: list[str] = []
    cursor = 0  # next unconsumed index of ``lines``
    carried = 0
    offsets: list[int] = []
    failures: list[HunkFailure] = []
    for index, hunk in enumerate(fp.hunks):
        stated = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        at = _find_block(lines, hunk.old_lines, stated + carried, cursor, allow_offset)
        if at is None:
            reason = (
                "context not found anywhere in the file"
                if allow_offset
                else "context does not match at the stated line"
            )
            failures.append(HunkFailure(patch_name, fp.path, index, hunk, reason))
            continue
        carried = at - stated
        offsets.append(carried)
        out.extend(lines[cursor:at])
        out.extend(hunk.new_lines)
        cursor = at + len(hunk.old_lines)
    out.extend(lines[cursor:])
    return out, offsets, failures


def _file_patches(files: dict[str, list[str]], patch: Patch, reverse: bool) -> list[FilePatch]:
    missing = [fp.path for fp in patch.files if fp.path not in files]
    if missing:
        raise OverlayError(f"{patch.name}: {', '.join(missing)} does not exist upstream")
    if reverse:
        return [FilePatch(fp.path, [h.reversed() for h in fp.hunks]) for fp in patch.files]
    return patch.files


def apply_patch(
    files: dict[str, list[str]], patch: Patch, allow_offset: bool = False, reverse: bool = False
) -> dict[str, list[int]]:
    """Apply ``patch`` to ``files`` (``path -> lines``) in place, all or nothing; return offsets per file.

    Raises the first :class:`HunkFailure` when a hunk does not apply.
    """
    staged: dict[str, list[str]] = {}
    offsets: dict[str, list[int]] = {}
    for fp in _file_patches(files, patch, reverse):
        staged[fp.path], offsets[fp.path], failures = _apply_hunks(
            staged.get(fp.path, files[fp.path]), fp, patch.name, allow_offset
        )
        if failures:
            raise failures[0]
    files.update(staged)
    return offsets


def failing_hunks(files: dict[str, list[str]], patch: Patch) -> list[HunkFailure]:
    """Every hunk of ``patch`` whose old lines are nowhere in its file, offsets allowed (``files`` is not changed)."""
    staged: dict[str, list[str]] = {}
    failed: list[HunkFailure] = []
    for fp in _file_patches(files, patch, reverse=False):
        staged[fp.path], _, failures = _apply_hunks(staged.get(fp.path, files[fp.path]), fp, patch.name, True)
        failed.extend(failures)
    return failed


def make_diff(rel_path: str, before: str, after: str) -> str:
    """A ``-p1`` unified diff of one upstream file, quilt-refresh style (no timestamps, 3 lines of context)."""
    out = []
    for line in difflib.unified_diff(
        split_lines(before),
        split_lines(after),
        f"a/{PACKAGE_DIR}/{rel_path}",
        f"b/{PACKAGE_DIR}/{rel_path}",
        n=DIFF_CONTEXT,
    ):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


@dataclasses.dataclass
class Verdict:
    """How a patch meets another release's files (:func:`classify`)."""

    patch: str
    kind: str  # clean | offsets | contained | conflict
    detail: str = ""
    failures: list[HunkFailure] = dataclasses.field(default_factory=list)  # every failing hunk of a conflict


def classify(files: dict[str, list[str]], patch: Patch) -> Verdict:
    """Try ``patch`` on another release's ``files``: strictly, then with offsets (``files`` updated in place when
    either applies), then reversed (already contained: ``files`` unchanged); else it conflicts, with every
    failing hunk."""
    trial = dict(files)
    try:
        apply_patch(trial, patch)
        files.update(trial)
        return Verdict(patch.name, "clean")
    except HunkFailure:
        pass
    except OverlayError as exc:  # a file the patch touches is not in the release
        return Verdict(patch.name, "conflict", str(exc))
    trial = dict(files)
    try:
        offsets = apply_patch(trial, patch, allow_offset=True)
        files.update(trial)
        moved = "; ".join(
            f"{path} hunk {i + 1}: {o:+d} lines" for path, offs in offsets.items() for i, o in enumerate(offs) if o
        )
        return Verdict(patch.name, "offsets", moved)
    except HunkFailure:
        pass
    try:
        apply_patch(dict(files), patch, allow_offset=True, reverse=True)
        return Verdict(patch.name, "contained", "every hunk reverse-applies to the new release")
    except HunkFailure:
        pass
    failures = failing_hunks(files, patch)
    names = ", ".join(f"{f.path} hunk {f.index + 1}" for f in failures)
    detail = f"{len(failures)} hunks fail with offsets allowed: {names}; the patch does not reverse-apply"
    return Verdict(patch.name, "conflict", detail, failures)

"""Writing a patch: ``show`` prints the base a contributor edits, ``diff`` turns the edited copy into a patch.

The base is the pinned file with the whole series applied (a new patch stacks on the queue), or the
pristine file (``--pristine``), or the file just before one patch of the series (``--patch NAME``, to
redo that patch; ``diff --patch`` then rewrites it in place, keeping its header comment and the
sections of the files it is not given). ``--upstream VERSION`` takes the files from another release
instead, to redo a patch that conflicted in a rebase; the patches before ``--patch`` then meet it as
the rebase meets them (with offsets allowed; one already contained upstream leaves the files alone).
Only their sections of the files asked for count: a file is refused only while an earlier patch's
section of that very file conflicts, so conflicting patches can be redone in any order their files allow.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from sglang_cpkv.overlay.common import OverlayError
from sglang_cpkv.overlay.patches import Patch, apply_patch, classify, make_diff, parse_patch, split_lines
from sglang_cpkv.overlay.pin import load_pin
from sglang_cpkv.overlay.queue import load_queue
from sglang_cpkv.overlay.wheels import cache_dir, default_tag, fetch_release, pinned_wheel, read_wheel_files


def base_texts(
    root: Path,
    rel_paths: Iterable[str],
    pristine: bool = False,
    upstream: str | None = None,
    before_patch: str | None = None,
) -> dict[str, str]:
    """Texts of ``rel_paths`` as the base of an edit (see the module docstring)."""
    pin = load_pin(root)
    queue = load_queue(root)
    rel_paths = sorted(set(rel_paths))
    if before_patch is not None and before_patch not in queue.series:
        raise OverlayError(f"--patch {before_patch}: not in patches/series")
    other_release = upstream is not None and upstream != pin.version
    if other_release:
        tag = default_tag(pin)
        wheel = fetch_release(pin.package, upstream, tag, pin.wheels[tag].platform, cache_dir(root))
        source = f"{pin.package} {upstream}"
    else:
        wheel, source = pinned_wheel(root, pin), f"the pinned {pin.package} {pin.version}"
    if pristine:
        patches = []
    elif before_patch is not None:
        patches = queue.parsed()[: queue.series.index(before_patch)]
    else:
        patches = [] if other_release else queue.parsed()
    data = read_wheel_files(wheel, rel_paths)
    missing = [rel for rel in rel_paths if data[rel] is None]
    if missing:
        raise OverlayError(f"not in {source} wheel: {', '.join(missing)}")
    files = {rel: split_lines(blob.decode()) for rel, blob in data.items() if blob is not None}
    for patch in patches:
        sections = Patch(patch.name, patch.header, [fp for fp in patch.files if fp.path in files])
        if not sections.files:
            continue
        if not other_release:
            apply_patch(files, sections)  # the queue applies strictly to its pin (`overlay check`)
            continue
        verdict = classify(files, sections)  # as the rebase meets it: a contained patch leaves the files alone
        if verdict.kind == "conflict":
            conflicting = ", ".join(dict.fromkeys(f.path for f in verdict.failures))
            raise OverlayError(
                f"{patch.name} comes before {before_patch} in the series and its section of {conflicting} "
                f"conflicts with {source} ({verdict.detail}): redo it first "
                f"(show --upstream {upstream} --patch {patch.name} --file {conflicting.split(', ')[0]})"
            )
    return {rel: "".join(files[rel]) for rel in rel_paths}


def diff_files(
    root: Path,
    pairs: list[tuple[str, Path]],
    pristine: bool = False,
    upstream: str | None = None,
    patch_name: str | None = None,
) -> str:
    """A patch from edited copies of upstream files, against :func:`base_texts`.

    With ``patch_name``, the text of that patch redone: its header comment, the new sections of the
    given files, and its sections of the other files as they were.
    """
    for rel, edited in pairs:
        if not edited.is_file():
            raise OverlayError(f"--edited {edited} (for --file {rel}): no such file")
    base = base_texts(root, [rel for rel, _ in pairs], pristine, upstream, patch_name)
    new_sections = {}
    for rel, edited in sorted(pairs):
        try:
            new_sections[rel] = make_diff(rel, base[rel], edited.read_bytes().decode())
        except UnicodeDecodeError as exc:
            raise OverlayError(f"--edited {edited}: not UTF-8 text ({exc})") from exc
    if patch_name is None:
        out = "".join(new_sections.values())
        if not out:
            raise OverlayError("the edited files do not differ from the base: no patch to write")
        return out
    patch = parse_patch(load_queue(root).patch_text(patch_name), patch_name)
    given = {rel for rel, _ in pairs}
    sections = [new_sections.pop(fp.path, "") if fp.path in given else fp.text for fp in patch.files]
    sections += new_sections.values()  # files the patch did not touch before
    if not "".join(sections):
        raise OverlayError(f"the edited files do not differ from the base: {patch_name} would be empty")
    return patch.header + "".join(sections)

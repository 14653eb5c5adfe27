"""The command line of the overlay tool (``python -m sglang_cpkv.overlay``, ``sglang-cpkv-overlay``)."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import sglang_cpkv.overlay as package
from sglang_cpkv.overlay.common import OverlayError, log, write_if_changed
from sglang_cpkv.overlay.edit import base_texts, diff_files
from sglang_cpkv.overlay.pin import find_queue_root, load_pin
from sglang_cpkv.overlay.queue import load_queue, pin_hashes
from sglang_cpkv.overlay.tree import apply_queue, check_queue, installed_sglang_root, verify_tree
from sglang_cpkv.overlay.wheels import cache_dir, default_python_tag, fetch_pinned


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-cpkv-overlay", description=package.__doc__.split("\n\n")[0])
    parser.add_argument("--queue-root", help="directory with UPSTREAM.toml and patches/ (default: see module docs)")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download and verify the pinned upstream wheel; print its path")
    fetch.add_argument(
        "--python-tag", default=None, help=f"e.g. cp311 (default: this interpreter's, {default_python_tag()})"
    )
    fetch.add_argument("--dest", type=Path, help="also copy the verified wheel here and print that path")
    sglang_root_help = "the 'sglang' package directory (default: the one this interpreter imports)"
    apply = sub.add_parser("apply", help="apply the patch queue in-tree to an upstream sglang package dir")
    apply.add_argument("--sglang-root", type=Path, help=sglang_root_help)
    verify = sub.add_parser("verify", help="check that an installed sglang carries the queue as its record says")
    verify.add_argument("--sglang-root", type=Path, help=sglang_root_help)
    check = sub.add_parser("check", help="validate the queue and prove it applies cleanly to the pinned wheel")
    check.add_argument("--wheel", type=Path, help="a local copy of the pinned wheel (default: fetch it)")
    diff = sub.add_parser("diff", help="print a patch from edited copies of upstream files (or rewrite one: --patch)")
    diff.add_argument(
        "--file",
        action="append",
        required=True,
        dest="files",
        help="upstream path relative to the sglang package, e.g. srt/server_args.py",
    )
    diff.add_argument(
        "--edited", action="append", required=True, type=Path, help="the edited copy (one per --file, same order)"
    )
    show = sub.add_parser("show", help="print an upstream file as the current series leaves it (the base `diff` uses)")
    show.add_argument("--file", required=True, help="upstream path relative to the sglang package")
    for command in (show, diff):
        command.add_argument(
            "--upstream",
            metavar="VERSION",
            help="that release's file instead of the pinned one (to redo a patch that conflicted in a rebase)",
        )
        base = command.add_mutually_exclusive_group()
        base.add_argument("--pristine", action="store_true", help="the file itself, no patch of the series applied")
        base.add_argument(
            "--patch",
            metavar="NAME",
            help="the file just before this series entry (diff: rewrite patches/NAME, keeping its header comment)",
        )
    sub.add_parser("pin-hashes", help="record the pristine sha256 of every touched file in manifest.json")
    reb = sub.add_parser("rebase", help="move the pin, the queue and the version references onto another release")
    reb.add_argument("--to", required=True, dest="version", help="the upstream version, e.g. 0.5.24")
    reb.add_argument("--report", type=Path, help="also write the markdown report here")
    return parser


def _run(args: argparse.Namespace) -> int:
    root = find_queue_root(args.queue_root)
    if args.command == "fetch":
        wheel = fetch_pinned(load_pin(root), args.python_tag or default_python_tag(), cache_dir(root))
        if args.dest is not None:
            args.dest.mkdir(parents=True, exist_ok=True)
            wheel = Path(shutil.copy2(wheel, args.dest / wheel.name))
        print(wheel)
    elif args.command in ("apply", "verify"):
        sglang_root = (args.sglang_root or installed_sglang_root()).resolve()
        log((apply_queue if args.command == "apply" else verify_tree)(sglang_root, root))
    elif args.command == "check":
        log(check_queue(root, args.wheel))
    elif args.command == "diff":
        if len(args.files) != len(args.edited):
            raise OverlayError("give one --edited per --file")
        text = diff_files(root, list(zip(args.files, args.edited)), args.pristine, args.upstream, args.patch)
        if args.patch is None:
            sys.stdout.write(text)
        else:
            path = load_queue(root).patches_dir / args.patch
            changed = write_if_changed(path, text.encode())
            log(f"rewrote {path}, its header comment kept" if changed else f"{path} already says this: unchanged")
    elif args.command == "show":
        sys.stdout.write(base_texts(root, [args.file], args.pristine, args.upstream, args.patch)[args.file])
    elif args.command == "pin-hashes":
        log(pin_hashes(root))
    elif args.command == "rebase":
        try:  # imported here: tomlkit is needed by rebase only, and apply/verify run in the image without it
            from sglang_cpkv.overlay.rebase import rebase
        except ModuleNotFoundError as exc:
            raise OverlayError(f"`rebase` needs the {exc.name} package (requirements/dev-cpu.txt)") from exc
        ok, report = rebase(root, args.version, args.report)
        sys.stdout.write(report)
        if not ok:
            log("rebase failed: nothing was changed; the report's Next steps are the commands to run")
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except (OverlayError, OSError) as exc:  # OSError: a path given on the command line that cannot be used
        print(f"sglang-cpkv-overlay: error: {exc}", file=sys.stderr)
        return 1

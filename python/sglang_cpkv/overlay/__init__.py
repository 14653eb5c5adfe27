"""The overlay tool: fetch the pinned upstream wheel, apply our patch queue in-tree, verify it, rebase it.

``UPSTREAM.toml`` pins one upstream release; ``patches/`` holds the queue (``series``, ``manifest.json``, the diffs:
``patches/README.md``). The commands (``python -m sglang_cpkv.overlay fetch|apply|verify|check|show|diff|pin-hashes|
rebase``), the queue root and the download cache: ``docs/rebase.md``. One module per job: :mod:`.pin` (UPSTREAM.toml
and the queue root), :mod:`.wheels` (verified downloads, reading wheels), :mod:`.patches` (the diff format and the
applier), :mod:`.queue` (series, manifest, validation), :mod:`.tree` (apply / verify / check on an upstream tree),
:mod:`.edit` (show / diff), :mod:`.rebase` with :mod:`.pin_rewrite` and :mod:`.closure`, and :mod:`.cli`. Logs go
to stderr; stdout carries only the results.
"""

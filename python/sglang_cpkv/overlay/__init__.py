"""The overlay tool: fetch the pinned upstream wheel, apply our patch queue in-tree, verify it, rebase it.

The repo holds no upstream source. ``UPSTREAM.toml`` pins one upstream release (version, one wheel
file and sha256 per Python tag) and ``patches/`` holds the queue: ``series`` (the order),
``manifest.json`` (what each patch is for, the upstream files it touches, when it can be retired,
and the pristine sha256 of every touched file) and the unified diffs themselves.

    python -m sglang_cpkv.overlay fetch [--python-tag cp311] [--dest DIR]   # prints the wheel path
    python -m sglang_cpkv.overlay apply [--sglang-root DIR]                 # in-tree, idempotent
    python -m sglang_cpkv.overlay verify [--sglang-root DIR]                # the tree carries the queue
    python -m sglang_cpkv.overlay check [--wheel PATH]                      # whole queue vs the pin
    python -m sglang_cpkv.overlay show --file srt/x.py > /tmp/x.py          # the file as the queue leaves it
    python -m sglang_cpkv.overlay diff --file srt/x.py --edited /tmp/x.py   # write a new patch
    python -m sglang_cpkv.overlay pin-hashes                                # record pristine hashes
    python -m sglang_cpkv.overlay rebase --to 0.5.24 [--report PATH]        # move the pin
    python -m sglang_cpkv.overlay show|diff --upstream 0.5.24 --patch P ... # redo a patch that conflicted

One module per job: :mod:`~sglang_cpkv.overlay.pin` (UPSTREAM.toml and the queue root),
:mod:`~sglang_cpkv.overlay.wheels` (verified downloads, reading wheels),
:mod:`~sglang_cpkv.overlay.patches` (the diff format and the applier),
:mod:`~sglang_cpkv.overlay.queue` (series, manifest, validation),
:mod:`~sglang_cpkv.overlay.tree` (apply / verify / check on an upstream tree),
:mod:`~sglang_cpkv.overlay.edit` (show / diff), :mod:`~sglang_cpkv.overlay.rebase` with
:mod:`~sglang_cpkv.overlay.pin_rewrite`, and :mod:`~sglang_cpkv.overlay.cli`.

The queue root (the directory with ``UPSTREAM.toml`` and ``patches/``) is ``--queue-root``, else
``$SGLANG_CPKV_ROOT``, else the repo around this package (editable install), else the current
directory or one of its parents. Downloads are cached in ``$SGLANG_CPKV_CACHE``, else
``<queue root>/.cache/upstream``. Logs go to stderr; stdout carries only the results.
"""

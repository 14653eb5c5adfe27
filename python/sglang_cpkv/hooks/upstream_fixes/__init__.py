"""Fixes of upstream sglang bugs, called from the hooks in ``patches/upstream-fixes/``.

Each module is imported with torch only, is the logic of one queued patch, and is to be deleted
with its patch once upstream ships the fix (see the patch's ``retire_when`` in
``patches/manifest.json``).
"""

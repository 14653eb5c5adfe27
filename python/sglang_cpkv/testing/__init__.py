"""Test helpers shared by test/ and benchmark/ (no upstream import)."""

"""Triton ``materialize_and_fill``: the Triton ``copy_pages`` then ``scatter_rows`` launches.

Contract: :func:`sglang_cpkv.ops.reference.materialize_and_fill`. Two launches in stream order, so a
current row overwrites the copied page it lands in; only the CUDA backend fuses them into one
(measured: `benchmark/results/2026-11-30-h200x2-validation/NOTES.md`).
"""

from __future__ import annotations

from sglang_cpkv.ops.reference import implements
from sglang_cpkv.ops.reference import materialize_and_fill as contract
from sglang_cpkv.ops.triton.copy_pages import copy_pages
from sglang_cpkv.ops.triton.scatter_rows import scatter_rows


@implements(contract)
def materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors) -> None:
    copy_pages(pool, src_page, dense, dst_page, errors)
    scatter_rows(current, dst_loc, dense.view(-1, *current.shape[1:]), errors)

"""Triton ``materialize_and_fill``: the Triton ``copy_pages`` then ``scatter_rows`` launches.

Contract: :func:`sglang_cpkv.ops.reference.materialize_and_fill`. Two launches in stream order, so a
current row overwrites the copied page it lands in; only the CUDA backend fuses them into one
(measured: `benchmark/RESULTS.md`).
"""

from __future__ import annotations

import torch

from sglang_cpkv.ops.triton.copy_pages import copy_pages
from sglang_cpkv.ops.triton.scatter_rows import scatter_rows


def materialize_and_fill(
    pool: torch.Tensor,
    src_page: torch.Tensor,
    dense: torch.Tensor,
    dst_page: torch.Tensor,
    current: torch.Tensor,
    dst_loc: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    copy_pages(pool, src_page, dense, dst_page, errors)
    scatter_rows(current, dst_loc, dense.view(-1, *current.shape[1:]), errors)

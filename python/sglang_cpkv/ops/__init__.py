"""CP shared-KV ops: the public entry points the runtime calls.

Each op has one contract (the docstrings of :mod:`sglang_cpkv.ops.reference`) and up to three
implementations: CUDA (``sgl-kernel/``, launched by :mod:`sglang_cpkv.ops.cuda`), Triton
(:mod:`sglang_cpkv.ops.triton`) and the torch reference.
"""

from sglang_cpkv.ops.errors import (
    ERR_LOC_OUT_OF_RANGE,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_REQ_OUT_OF_RANGE,
    CpSharedKvError,
    new_error_counter,
    raise_if_errors,
)
from sglang_cpkv.ops.reference import build_page_inverse, copy_pages, remap_locs, scatter_rows

__all__ = [
    "ERR_LOC_OUT_OF_RANGE",
    "ERR_PAGE_OUT_OF_RANGE",
    "ERR_REQ_OUT_OF_RANGE",
    "CpSharedKvError",
    "new_error_counter",
    "raise_if_errors",
    "build_page_inverse",
    "remap_locs",
    "copy_pages",
    "scatter_rows",
]

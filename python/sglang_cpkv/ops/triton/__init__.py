"""Triton implementations of the CP shared-KV ops, one module per op.

Same signatures and contract as :mod:`sglang_cpkv.ops.reference`, plus keyword-only tuning knobs
(0 = the documented auto choice). They run on CUDA tensors, and on CPU tensors when Triton's
interpreter was on (``TRITON_INTERPRET=1``) at the time this package was imported.
"""

from triton.runtime.interpreter import InterpretedFunction

from sglang_cpkv.ops.triton.build_page_inverse import _insert_keys_kernel, build_page_inverse
from sglang_cpkv.ops.triton.copy_pages import copy_pages
from sglang_cpkv.ops.triton.current_dense_locs import current_dense_locs
from sglang_cpkv.ops.triton.materialize_and_fill import materialize_and_fill
from sglang_cpkv.ops.triton.remap_locs import remap_locs
from sglang_cpkv.ops.triton.scatter_rows import scatter_rows

# triton.jit picks the interpreter when a kernel is defined, so ask a kernel, not the environment.
INTERPRETED = isinstance(_insert_keys_kernel, InterpretedFunction)

__all__ = [
    "INTERPRETED",
    "build_page_inverse",
    "copy_pages",
    "current_dense_locs",
    "materialize_and_fill",
    "remap_locs",
    "scatter_rows",
]

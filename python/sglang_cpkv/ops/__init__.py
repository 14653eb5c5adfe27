"""CP shared-KV ops: the public entry points the runtime calls.

Each op has one contract (the docstrings of :mod:`sglang_cpkv.ops.reference`) and up to three
implementations: CUDA (``sgl-kernel/``, launched by :mod:`sglang_cpkv.ops.cuda`), Triton
(:mod:`sglang_cpkv.ops.triton`) and the torch reference. Every public op here dispatches on the
device of its tensors:

* CUDA tensors: CUDA when its extension is built (``sglang_cpkv.ops.cuda.is_available()``), else
  Triton, else the torch reference.
* CPU tensors: Triton when its kernels were defined under the interpreter (``TRITON_INTERPRET=1``
  before ``sglang_cpkv.ops.triton`` was first imported), else the torch reference.

The setting ``SGLANG_CPKV_OPS_BACKEND`` (environment) forces one backend:

* ``auto`` (default): the order above;
* ``cuda`` / ``triton`` / ``torch``: that backend, or a :class:`RuntimeError` naming why it cannot
  run tensors on this device (never a silent fallback).

The choice is logged once per backend (logger ``sglang_cpkv.ops``). The first time the CUDA backend
is considered it is loaded and probed (every op once on a tiny batch, compared with the reference:
:func:`sglang_cpkv.ops.cuda.is_available`), which synchronizes. :func:`warm_up` does that at start-up
(serving calls it when the model-parallel groups are made, ``hooks/exchange_group.py``); after it,
dispatch reads only tensor metadata and Python state and never synchronizes, so the ops are safe
inside a forward and under CUDA graph capture.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType

import torch

from sglang_cpkv.env import env_text
from sglang_cpkv.ops import reference
from sglang_cpkv.ops.errors import (
    ERR_LOC_OUT_OF_RANGE,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_REQ_OUT_OF_RANGE,
    CpSharedKvError,
    new_error_counter,
    raise_if_errors,
)
from sglang_cpkv.ops.reference import PageInverse, inverse_bytes

BACKEND_ENV = "SGLANG_CPKV_OPS_BACKEND"
BACKENDS = ("auto", "cuda", "triton", "torch")

logger = logging.getLogger(__name__)
_logged_backends: set[str] = set()


@functools.cache
def _load_backend(name: str) -> tuple[ModuleType | None, str]:
    """``(module, "")`` when backend ``name`` can run, else ``(None, why not)``; decided once."""
    if name == "torch":
        return reference, ""
    try:
        module = importlib.import_module(f"sglang_cpkv.ops.{name}")
    except ModuleNotFoundError as exc:
        # Only the backend itself (or Triton, for the Triton backend) may be absent; any other
        # missing module is a bug of that backend and surfaces.
        if exc.name not in (f"sglang_cpkv.ops.{name}", "triton" if name == "triton" else None):
            raise
        return None, f"{exc.name} is not installed"
    if name == "cuda":
        try:
            available = module.is_available()
        except Exception as exc:  # a broken build must not take the runtime down: it falls back, loudly
            logger.warning("sglang_cpkv.ops.cuda.is_available() failed: %r", exc)
            return None, f"sglang_cpkv.ops.cuda.is_available() failed: {exc!r}"
        if not available:
            return None, "the CUDA extension of sglang_cpkv.ops.cuda is not built"
    return module, ""


def _why_not(name: str, device: torch.device) -> str:
    """Why backend ``name`` cannot run ops on ``device`` ("" when it can)."""
    if name == "torch":
        return ""
    if name == "cuda" and device.type != "cuda":
        return f"the CUDA backend runs CUDA tensors only, got {device.type} tensors"
    if name == "triton" and device.type not in ("cuda", "cpu"):
        return f"the Triton backend runs CUDA tensors, or CPU tensors under its interpreter, got {device.type} tensors"
    module, why = _load_backend(name)
    if module is None:
        return why
    if name == "triton" and device.type == "cpu" and not module.INTERPRETED:
        return "Triton runs CPU tensors only under its interpreter: set TRITON_INTERPRET=1 before sglang_cpkv.ops.triton is first imported"
    return ""


def select_backend(device: torch.device | str) -> str:
    """The backend (``cuda``, ``triton`` or ``torch``) that runs the ops for tensors on ``device``.

    Follows ``SGLANG_CPKV_OPS_BACKEND`` (see the module docstring); raises :class:`RuntimeError`
    if it forces a backend that cannot run there, or holds a value outside :data:`BACKENDS`. What a value means on a
    device type is decided once (:func:`_resolve`): a call costs a dictionary lookup, not the probe.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    requested = env_text(BACKEND_ENV).strip().lower() or "auto"
    name = _resolve(requested, device_type)
    if name not in _logged_backends:
        _logged_backends.add(name)
        logger.info(
            "CP shared-KV ops run on the %s backend (%s=%s, %s tensors)", name, BACKEND_ENV, requested, device_type
        )
    return name


@functools.cache
def _resolve(requested: str, device_type: str) -> str:
    if requested not in BACKENDS:
        raise RuntimeError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}, got {requested!r}")
    device = torch.device(device_type)
    if requested == "auto":
        return next(n for n in ("cuda", "triton", "torch") if not _why_not(n, device))
    why = _why_not(requested, device)
    if why:
        raise RuntimeError(f"{BACKEND_ENV}={requested} cannot run the CP shared-KV ops on {device_type} tensors: {why}")
    return requested


def warm_up(device: torch.device | str) -> str:
    """Load and probe the backend that serves ``device`` (the synchronizing first step of the CUDA backend),
    at start-up rather than inside the first forward. Returns the backend's name."""
    return select_backend(device)


def _backend(device: torch.device) -> ModuleType:
    return _load_backend(select_backend(device))[0]


# The contract's input checks run here, before any backend, so every backend refuses the same inputs
# with the same CpSharedKvError (host metadata only: dtypes and shapes, never values).


def build_page_inverse(
    entry_pages: torch.Tensor,
    entry_req: torch.Tensor,
    num_requests: int,
    capacity: int,
    errors: torch.Tensor,
    entry_slots: torch.Tensor | None = None,
) -> PageInverse:
    """Per-request page inverse of a batch: :func:`sglang_cpkv.ops.reference.build_page_inverse`."""
    reference.check_ids(entry_pages, "entry_pages")
    reference.check_ids(entry_req, "entry_req")
    if entry_slots is not None:
        reference.check_slots(entry_slots)
    return _backend(entry_pages.device).build_page_inverse(
        entry_pages, entry_req, num_requests, capacity, errors, entry_slots
    )


def remap_locs(
    locs: torch.Tensor,
    req_id: torch.Tensor,
    inverse: PageInverse,
    page_size: int,
    errors: torch.Tensor,
) -> torch.Tensor:
    """Token locations -> dense locations: :func:`sglang_cpkv.ops.reference.remap_locs`."""
    reference.check_ids(locs, "locs")
    reference.check_ids(req_id, "req_id")
    reference.check_inverse(inverse)
    if page_size < 1:
        raise CpSharedKvError(f"page_size must be >= 1, got {page_size}")
    return _backend(locs.device).remap_locs(locs, req_id, inverse, page_size, errors)


def copy_pages(
    src: torch.Tensor, src_page: torch.Tensor, dst: torch.Tensor, dst_page: torch.Tensor, errors: torch.Tensor
) -> None:
    """Whole pages from ``src`` to ``dst``: :func:`sglang_cpkv.ops.reference.copy_pages`."""
    reference.check_ids(src_page, "src_page")
    reference.check_ids(dst_page, "dst_page")
    _backend(dst.device).copy_pages(src, src_page, dst, dst_page, errors)


def scatter_rows(src: torch.Tensor, dst_loc: torch.Tensor, dst: torch.Tensor, errors: torch.Tensor) -> None:
    """Rows of ``src`` to rows ``dst_loc`` of ``dst``: :func:`sglang_cpkv.ops.reference.scatter_rows`."""
    reference.check_ids(dst_loc, "dst_loc")
    _backend(dst.device).scatter_rows(src, dst_loc, dst, errors)


def materialize_and_fill(
    pool: torch.Tensor,
    src_page: torch.Tensor,
    dense: torch.Tensor,
    dst_page: torch.Tensor,
    current: torch.Tensor,
    dst_loc: torch.Tensor,
    errors: torch.Tensor,
) -> None:
    """History pages then current rows into one dense view: :func:`sglang_cpkv.ops.reference.materialize_and_fill`."""
    for ids, name in ((src_page, "src_page"), (dst_page, "dst_page"), (dst_loc, "dst_loc")):
        reference.check_ids(ids, name)
    reference.check_row_divides_page(current, dense)
    _backend(dense.device).materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors)


__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "ERR_LOC_OUT_OF_RANGE",
    "ERR_PAGE_OUT_OF_RANGE",
    "ERR_REQ_OUT_OF_RANGE",
    "CpSharedKvError",
    "PageInverse",
    "build_page_inverse",
    "copy_pages",
    "inverse_bytes",
    "materialize_and_fill",
    "new_error_counter",
    "raise_if_errors",
    "remap_locs",
    "scatter_rows",
    "select_backend",
    "warm_up",
]

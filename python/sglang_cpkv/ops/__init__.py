"""CP shared-KV ops: the public entry points the runtime calls, dispatched on the device of their tensors.

Each op has one contract (:mod:`sglang_cpkv.ops.reference`) and up to three implementations, tried in this order:
CUDA (:mod:`sglang_cpkv.ops.cuda`, when its library is loaded and passes its probe; else the reason is logged),
Triton (:mod:`sglang_cpkv.ops.triton`; for CPU tensors only under ``TRITON_INTERPRET=1`` set before its import) and
the torch reference. ``SGLANG_CPKV_OPS_BACKEND`` (``auto``, ``cuda``, ``triton``, ``torch``) forces one, or raises
naming why it cannot run; the choice is logged once per backend. :func:`warm_up` loads and probes the CUDA backend
at start-up (``hooks/reservation.py``), which synchronizes; after it, dispatch reads only tensor metadata and
never synchronizes (safe inside a forward and under CUDA graph capture). Where each op runs:
``docs/design/cp-shared-kv.md`` sections 3-4; its terms: ``docs/design/cp-shared-kv-contract.md``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from sglang_cpkv.envs import envs
from sglang_cpkv.ops import reference
from sglang_cpkv.ops.errors import (
    ERR_LOC_OUT_OF_RANGE,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_REQ_OUT_OF_RANGE,
    CpSharedKvError,
    new_error_counter,
    raise_if_errors,
)
from sglang_cpkv.ops.reference import PageInverse, implements, inverse_bytes

BACKEND_ENV = envs.SGLANG_CPKV_OPS_BACKEND.name
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
        # A broken build must not take the runtime down: it falls back, its reason logged there as a warning (a
        # load or probe that raises included).
        reason = module.unavailable_reason()
        if reason:
            return None, reason
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
    requested = envs.SGLANG_CPKV_OPS_BACKEND.get().strip().lower() or "auto"
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


def _dispatched(spec: Callable, operand_device: Callable[..., torch.device]) -> Callable:
    """The public op of the reference op ``spec`` (its signature and docstring, the one contract): the operands'
    host metadata checked by ``operand_device``, which returns the device that picks the backend, then that
    backend's function of the same name. The checks run before any backend, so every backend refuses the same
    inputs with the same :class:`CpSharedKvError` (dtypes and shapes, never values)."""
    name = spec.__name__

    @functools.wraps(spec)
    def op(*operands, **named):
        return getattr(_backend(operand_device(*operands, **named)), name)(*operands, **named)

    op.__module__ = __name__
    return op


@implements(reference.build_page_inverse)
def _inverse_build_device(entry_pages, entry_req, num_requests, capacity, errors, entry_slots=None):
    reference.check_ids(entry_pages, "entry_pages")
    reference.check_ids(entry_req, "entry_req")
    if entry_slots is not None:
        reference.check_slots(entry_slots)
    return entry_pages.device


@implements(reference.remap_locs)
def _remap_device(locs, req_id, inverse, page_size, errors, out=None):
    reference.check_ids(locs, "locs")
    reference.check_ids(req_id, "req_id")
    reference.check_inverse(inverse)
    reference.check_remap_out(out, locs)
    if page_size < 1:
        raise CpSharedKvError(f"page_size must be >= 1, got {page_size}")
    return locs.device


@implements(reference.current_dense_locs)
def _current_locs_device(token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors):
    reference.check_current_locs(token_ends, dense_offsets, out_cache_loc, slot_pages)
    if page_size < 1:
        raise CpSharedKvError(f"page_size must be >= 1, got {page_size}")
    return out_cache_loc.device


@implements(reference.copy_pages)
def _page_copy_device(src, src_page, dst, dst_page, errors):
    reference.check_ids(src_page, "src_page")
    reference.check_ids(dst_page, "dst_page")
    return dst.device


@implements(reference.scatter_rows)
def _row_scatter_device(src, dst_loc, dst, errors):
    reference.check_ids(dst_loc, "dst_loc")
    return dst.device


@implements(reference.materialize_and_fill)
def _fill_device(pool, src_page, dense, dst_page, current, dst_loc, errors):
    for ids, name in ((src_page, "src_page"), (dst_page, "dst_page"), (dst_loc, "dst_loc")):
        reference.check_ids(ids, name)
    reference.check_row_divides_page(current, dense)
    return dense.device


build_page_inverse = _dispatched(reference.build_page_inverse, _inverse_build_device)
remap_locs = _dispatched(reference.remap_locs, _remap_device)
current_dense_locs = _dispatched(reference.current_dense_locs, _current_locs_device)
copy_pages = _dispatched(reference.copy_pages, _page_copy_device)
scatter_rows = _dispatched(reference.scatter_rows, _row_scatter_device)
materialize_and_fill = _dispatched(reference.materialize_and_fill, _fill_device)


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
    "current_dense_locs",
    "inverse_bytes",
    "materialize_and_fill",
    "new_error_counter",
    "raise_if_errors",
    "remap_locs",
    "scatter_rows",
    "select_backend",
    "warm_up",
]

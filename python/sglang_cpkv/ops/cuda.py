"""CUDA backend of the CP shared-KV ops, under :mod:`sglang_cpkv.ops`: thin launchers of ``torch.ops.sglang_cpkv.*``.

The kernels live in ``sgl-kernel/csrc/cp_shared_kv`` (packaged as ``sglang_cpkv/csrc``; declared in
``cp_shared_kv.h``, registered in ``torch_bindings.cc``). The ops mean what :mod:`sglang_cpkv.ops.reference` says,
bad ids included, never synchronize (CUDA-graph safe) and have fake implementations (``torch.compile``,
``torch.library.opcheck``). The library is loaded once per process: a prebuilt one (``SGLANG_CPKV_CUDA_LIB``, else
``sglang_cpkv/ops/prebuilt/``; refused when built from other sources or torch), else a JIT build only under
``SGLANG_CPKV_CUDA_JIT=1`` (:mod:`sglang_cpkv.ops.cuda_build`); without either the backend is unavailable, the reason
logged once. :func:`is_available` also probes every op on a tiny batch against the reference, so a library whose ops
changed meaning cannot serve. Settings: the README's table; design: ``docs/design/cp-shared-kv.md`` section 2.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

from sglang_cpkv.envs import envs
from sglang_cpkv.ops import cuda_build, reference
from sglang_cpkv.ops.errors import new_error_counter
from sglang_cpkv.ops.reference import PageInverse, implements

OP_NAMES = (
    "build_page_inverse",
    "remap_locs",
    "current_dense_locs",
    "copy_pages",
    "scatter_rows",
    "materialize_and_fill",
)

logger = logging.getLogger(__name__)
_loaded = False


def _ops_registered() -> bool:
    return all(hasattr(torch.ops.sglang_cpkv, name) for name in OP_NAMES)


def _register_fakes() -> None:
    """Output shapes of the ops for FakeTensor / torch.compile (the in-place ops return nothing)."""

    @torch.library.register_fake("sglang_cpkv::build_page_inverse")
    def _build_page_inverse_fake(entry_pages, entry_req, num_requests, capacity, errors, entry_slots=None):
        cells = reference.inverse_table_size(entry_pages.numel())
        return (
            entry_pages.new_empty((cells,), dtype=torch.int64),
            entry_pages.new_empty((cells,), dtype=torch.int32),
        )

    @torch.library.register_fake("sglang_cpkv::remap_locs")
    def _remap_locs_fake(
        locs, req_id, inverse_keys, inverse_slots, num_requests, capacity, page_size, errors, out=None
    ):
        return torch.empty_like(locs, dtype=torch.int32, memory_format=torch.contiguous_format) if out is None else out

    @torch.library.register_fake("sglang_cpkv::current_dense_locs")
    def _current_dense_locs_fake(token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors):
        return out_cache_loc.new_empty((out_cache_loc.numel(),), dtype=torch.int64)

    @torch.library.register_fake("sglang_cpkv::copy_pages")
    def _copy_pages_fake(src, src_page, dst, dst_page, errors):
        return None

    @torch.library.register_fake("sglang_cpkv::scatter_rows")
    def _scatter_rows_fake(src, dst_loc, dst, errors):
        return None

    @torch.library.register_fake("sglang_cpkv::materialize_and_fill")
    def _materialize_and_fill_fake(pool, src_page, dense, dst_page, current, dst_loc, errors):
        return None


@functools.cache
def _load() -> str | None:
    """Load the library once; None when its ops are registered, else why not."""
    global _loaded
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if not _ops_registered():
        library = cuda_build.prebuilt_library()
        refused = None
        if library is not None:
            refused = f"{library} does not exist" if not library.is_file() else cuda_build.stale_reason(library)
        if library is not None and refused is None:
            try:
                torch.ops.load_library(str(library))
            except OSError as exc:
                return f"loading {library} failed: {exc}"
        elif envs.SGLANG_CPKV_CUDA_JIT.get():
            if refused:
                logger.warning("sglang_cpkv: prebuilt CUDA library refused (%s); JIT-building instead", refused)
            try:
                cuda_build.jit_build()
            except Exception as exc:  # a failed development build leaves the backend unavailable, with the cause
                return f"JIT build failed: {exc!r}"
        elif refused:
            return f"prebuilt library refused: {refused}"
        else:
            return (
                f"no prebuilt library ({cuda_build.LIB_ENV} is unset and sglang_cpkv/ops/prebuilt/ holds none) and JIT "
                f"is off (set {cuda_build.JIT_ENV}=1 to compile for development; serving never compiles)"
            )
        if not _ops_registered():
            missing = [name for name in OP_NAMES if not hasattr(torch.ops.sglang_cpkv, name)]
            return f"the loaded library registers no sglang_cpkv::{', '.join(missing)} (a build of older sources)"
    _register_fakes()
    _loaded = True
    return None


def _probe() -> str | None:
    """Run every op once on a tiny batch (two requests sharing page 5, bad ids of each kind); None when the CUDA
    results, split and fused, equal the reference's."""
    device = torch.device("cuda", torch.cuda.current_device())
    capacity, page_size, width = 12, 4, 8
    # The entries of [[1, 5], [9, 5]] (page 1 in a slot request 1's page 9 shares, as shared history slots do), a
    # rounding entry (-1) and a bad page id (40) of request 1.
    entry_pages = torch.tensor([1, 5, 9, 5, -1, 40], dtype=torch.int32, device=device)
    entry_req = torch.tensor([0, 0, 1, 1, -1, 1], dtype=torch.int64, device=device)
    entry_slots = torch.tensor([0, 1, 0, 3, -1, 5], dtype=torch.int32, device=device)
    locs = torch.tensor([[4, 21, 7, -1], [36, 22, 3, 47], [4, 5, -1, 6]], dtype=torch.int64, device=device)
    req_id = torch.tensor([0, 1, 7], dtype=torch.int64, device=device)  # 7: a bad request row
    pool = torch.arange(capacity * page_size * width, dtype=torch.int32, device=device).view(capacity, -1)
    src_page = torch.tensor([1, 5, 9, -1, 40], dtype=torch.int32, device=device)  # 40: a bad page id
    dst_page = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32, device=device)
    current = -torch.arange(3 * width, dtype=torch.int32, device=device).view(3, width) - 1
    dst_loc = torch.tensor([6, 99, 13], dtype=torch.int64, device=device)  # 99: a bad dense row
    # Three requests of 2, 0 and 3 current tokens over slots holding pages 5, 9 and none (dense locations 2, 3 and
    # 6, 7, 8): one token whose location is not its slot's, one on the slot that holds no page.
    token_ends = torch.tensor([2, 2, 5], dtype=torch.int64, device=device)
    dense_offsets = torch.tensor([2, 0, 4], dtype=torch.int64, device=device)
    out_cache_loc = torch.tensor([22, 23, 38, 31, 40], dtype=torch.int32, device=device)
    slot_pages = torch.tensor([5, 9, -1], dtype=torch.int32, device=device)
    module = sys.modules[__name__]
    results = {}
    for name in ("reference", "cuda", "cuda fused"):
        ops = reference if name == "reference" else module
        errors = new_error_counter(device)
        inverse = ops.build_page_inverse(entry_pages, entry_req, 2, capacity, errors, entry_slots)
        dense_locs = ops.remap_locs(locs, req_id, inverse, page_size, errors)
        current_locs = ops.current_dense_locs(token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors)
        dense = torch.full((4, page_size * width), 7, dtype=torch.int32, device=device)
        if name == "cuda fused":
            materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors)
        else:
            ops.copy_pages(pool, src_page, dense, dst_page, errors)
            ops.scatter_rows(current, dst_loc, dense.view(-1, width), errors)
        results[name] = {
            "inverse keys": inverse.keys,
            "inverse slots": inverse.slots,
            "dense locs": dense_locs,
            "current dense locs": current_locs,
            "dense": dense,
            "errors": errors,
        }
    for name in ("cuda", "cuda fused"):
        for what, want in results["reference"].items():
            have = results[name][what]
            if not torch.equal(want, have):
                return f"probe: {name} gave a wrong {what}: {have.tolist()} instead of {want.tolist()}"
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CUDA ops cannot serve in this process (None when they can); decided and logged once."""
    try:
        reason = _load() or _probe()
    except Exception as exc:  # the probe is the place where a broken library shows; report it, do not crash
        reason = f"probe raised {exc!r}"
    if reason:
        logger.warning("sglang_cpkv CUDA ops unavailable: %s", reason)
    return reason


def is_available() -> bool:
    """True when the CUDA ops are loaded (prebuilt, or JIT when allowed), a GPU is visible and the probe passed."""
    return unavailable_reason() is None


def _ops():
    if not _loaded:
        reason = _load()
        if reason:
            raise RuntimeError(f"sglang_cpkv CUDA ops are unavailable: {reason}")
    return torch.ops.sglang_cpkv


@implements(reference.build_page_inverse)
def build_page_inverse(entry_pages, entry_req, num_requests, capacity, errors, entry_slots=None) -> PageInverse:
    keys, slots = _ops().build_page_inverse(entry_pages, entry_req, num_requests, capacity, errors, entry_slots)
    return PageInverse(keys=keys, slots=slots, num_requests=num_requests, capacity=capacity)


@implements(reference.remap_locs)
def remap_locs(locs, req_id, inverse, page_size, errors, out=None) -> torch.Tensor:
    return _ops().remap_locs(
        locs, req_id, inverse.keys, inverse.slots, inverse.num_requests, inverse.capacity, page_size, errors, out
    )


@implements(reference.current_dense_locs)
def current_dense_locs(token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors) -> torch.Tensor:
    return _ops().current_dense_locs(token_ends, dense_offsets, out_cache_loc, slot_pages, page_size, errors)


@implements(reference.copy_pages)
def copy_pages(src, src_page, dst, dst_page, errors) -> None:
    _ops().copy_pages(src, src_page, dst, dst_page, errors)


@implements(reference.scatter_rows)
def scatter_rows(src, dst_loc, dst, errors) -> None:
    _ops().scatter_rows(src, dst_loc, dst, errors)


@implements(reference.materialize_and_fill)
def materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors) -> None:
    """History pages then current rows in one fused launch."""
    _ops().materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors)

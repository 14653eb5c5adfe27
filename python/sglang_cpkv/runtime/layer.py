"""Per-layer CP shared-KV work: build each request's dense KV view and remap its top-k reads.

For one layer, with the batch's :class:`~sglang_cpkv.runtime.plan.CpSharedKvPlan`:

1. :func:`materialize_history` - history pages into their dense slots. ``cp_size = 1``: one
   ``ops.copy_pages`` from the pool. Under CP each rank's pool holds only the pages it owns
   (``page_id % cp_size == cp_rank``), so each rank packs its owned history pages
   (:func:`pack_owned_history`), the group all-gathers them, and every rank unpacks the pages of
   all history slots (:func:`unpack_history`). A partially filled last history page is
   materialized whole; step 2 overwrites its current tail (CURRENT_REUSE).
2. :func:`fill_current` - the all-gathered current KV (``[N, row]``, token order) into each
   request's own dense slots (``ops.scatter_rows`` at ``plan.current_dense_locs``).
3. :func:`remap_topk` - this rank's top-k pool locations ``[local_rows, K]`` to dense
   locations through the per-request inverse, one request id per row.

:func:`persist_owned_current` writes the current KV rows of owned pages to this rank's pool, and
:func:`gather_current` all-gathers the local current KV rows back to token order (as upstream's
interleave/zigzag gathers do). Order within a layer: materialize (reads the pool) before persist
(writes it), so a page id reused by another request's current tokens never changes history.

Tensors: the pool is ``[C * page_size, row...]`` and the dense view ``[R * P * page_size, row...]``,
same dtype and row shape (bf16 ``[.., 576]``, or the 656-byte packed FP8 rows as ``uint8``; the ops
copy bytes). Both must be contiguous (pages are viewed as rows of ``page_size * row`` elements).
"""

from __future__ import annotations

import torch

from sglang_cpkv import ops
from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime import checked as checked_mode
from sglang_cpkv.runtime.group import CpGroup
from sglang_cpkv.runtime.plan import CpSharedKvPlan


def _pages(t: torch.Tensor, page_size: int, what: str) -> torch.Tensor:
    """``[rows, ...]`` -> ``[rows // page_size, page_size * row_elems]`` (a view)."""
    if t.shape[0] % page_size:
        raise CpSharedKvError(f"{what} has {t.shape[0]} rows, not a multiple of page_size={page_size}")
    if not t.is_contiguous():
        raise CpSharedKvError(f"{what} must be contiguous to be viewed as pages")
    return t.view(t.shape[0] // page_size, -1)


def _check_pool(plan: CpSharedKvPlan, pool: torch.Tensor) -> None:
    if pool.shape[0] != plan.capacity * plan.page_size:
        raise CpSharedKvError(
            f"pool has {pool.shape[0]} rows, expected capacity*page_size = {plan.capacity}*{plan.page_size}"
        )


def _check_dense(plan: CpSharedKvPlan, dense: torch.Tensor) -> None:
    if dense.shape[0] != plan.dense_rows:
        raise CpSharedKvError(
            f"dense view has {dense.shape[0]} rows, expected R*P*page_size = "
            f"{plan.num_requests}*{plan.pages_per_request}*{plan.page_size}"
        )


def _check_group(plan: CpSharedKvPlan, group: CpGroup) -> None:
    if group.cp_size != plan.cp_size or group.cp_rank != plan.cp_rank:
        raise CpSharedKvError(
            f"group (cp_size {group.cp_size}, rank {group.cp_rank}) does not match the plan "
            f"(cp_size {plan.cp_size}, rank {plan.cp_rank})"
        )


def new_dense_buffer(plan: CpSharedKvPlan, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized dense view ``[R * P * page_size, *row_shape]`` on the plan's device."""
    return torch.empty((plan.dense_rows, *row_shape), dtype=dtype, device=plan.device)


def pack_owned_history(plan: CpSharedKvPlan, pool: torch.Tensor) -> torch.Tensor:
    """This rank's contribution to the history all-gather.

    Returns:
        ``[M, page_size * row_elems]`` (``M = plan.exchange_pages_per_rank``): row ``i`` is
        pool page ``plan.exchange_send_pages[i]``; padding rows are left uninitialized.
    """
    _check_pool(plan, pool)
    pool_pages = _pages(pool, plan.page_size, "pool")
    send = pool_pages.new_empty((plan.exchange_pages_per_rank, pool_pages.shape[1]))
    dst = torch.arange(plan.exchange_pages_per_rank, dtype=torch.int32, device=pool.device)
    ops.copy_pages(pool_pages, plan.exchange_send_pages, send, dst, plan.errors)
    if plan.checked:
        checked_mode.check_errors(plan, "pack_owned_history")
    return send


def unpack_history(plan: CpSharedKvPlan, gathered_pages: torch.Tensor, dense: torch.Tensor) -> None:
    """Every history slot's page from the rank-major all-gather ``[cp_size * M, page_elems]`` into ``dense``."""
    _check_dense(plan, dense)
    expected = plan.cp_size * plan.exchange_pages_per_rank
    if gathered_pages.shape[0] != expected:
        raise CpSharedKvError(f"gathered history has {gathered_pages.shape[0]} pages, expected cp_size*M = {expected}")
    dense_pages = _pages(dense, plan.page_size, "dense view")
    ops.copy_pages(gathered_pages, plan.exchange_recv_rows, dense_pages, plan.history_slots, plan.errors)
    if plan.checked:
        checked_mode.check_errors(plan, "unpack_history")


def materialize_history(plan: CpSharedKvPlan, pool: torch.Tensor, dense: torch.Tensor, group: CpGroup) -> None:
    """Copy every request's history pages into its dense slots (step 1 of the module docstring).

    Args:
        pool: this rank's pool ``[C * page_size, row...]`` (under CP only owned pages are valid).
        dense: ``[R * P * page_size, row...]``, written in place at the history slots only.
        group: the CP group (``cp_size`` must match the plan's); a collective when ``cp_size > 1``
            and the batch has history, so every rank must call it.
    """
    _check_group(plan, group)
    _check_pool(plan, pool)
    _check_dense(plan, dense)
    if plan.cp_size == 1:
        ops.copy_pages(
            _pages(pool, plan.page_size, "pool"),
            plan.history_pages,
            _pages(dense, plan.page_size, "dense view"),
            plan.history_slots,
            plan.errors,
        )
        if plan.checked:
            checked_mode.check_errors(plan, "materialize_history")
        return
    if plan.exchange_pages_per_rank == 0:
        return
    gathered = group.all_gather_rows(pack_owned_history(plan, pool))
    unpack_history(plan, gathered, dense)


def fill_current(plan: CpSharedKvPlan, current_kv: torch.Tensor, dense: torch.Tensor) -> None:
    """Write the current KV ``[N, row...]`` (all-gathered, token order) into each request's dense slots."""
    _check_dense(plan, dense)
    if current_kv.shape[0] != plan.num_tokens:
        raise CpSharedKvError(f"current KV has {current_kv.shape[0]} rows, the batch has {plan.num_tokens} tokens")
    ops.scatter_rows(current_kv.flatten(1), plan.current_dense_locs, dense.flatten(1), plan.errors)
    if plan.checked:
        checked_mode.check_errors(plan, "fill_current")


def remap_topk(plan: CpSharedKvPlan, topk_locs: torch.Tensor, req_id: torch.Tensor) -> torch.Tensor:
    """Dense locations of top-k pool locations.

    Args:
        topk_locs: int32/int64 ``[rows, K]`` (or ``[rows]``) pool token locations, -1 padding;
            usually this rank's local query rows (``rows = plan.split.physical_rows``).
        req_id: int64 ``[rows]``, the request of each row (``plan.local_req_id`` for the local
            query rows; -1 for padding rows). Required: one id per row, never broadcast.

    Returns:
        int32, the shape of ``topk_locs``: dense locations (-1: padding, or a page not in the
        row's request).
    """
    if req_id.shape != topk_locs.shape[:1]:
        raise CpSharedKvError(
            f"remap_topk: req_id {tuple(req_id.shape)} must have one id per row of topk_locs {tuple(topk_locs.shape)}"
        )
    dense_locs = ops.remap_locs(topk_locs, req_id, plan.inverse, plan.capacity, plan.page_size, plan.errors)
    if plan.checked:
        checked_mode.check_remapped(plan, dense_locs, req_id, "remap_topk")
    return dense_locs


def persist_owned_current(plan: CpSharedKvPlan, current_kv: torch.Tensor, pool: torch.Tensor) -> None:
    """Write the current KV rows of pages this rank owns into its pool (all rows when ``cp_size = 1``).

    Call after :func:`materialize_history` of the same layer.
    """
    _check_pool(plan, pool)
    if current_kv.shape[0] != plan.num_tokens:
        raise CpSharedKvError(f"current KV has {current_kv.shape[0]} rows, the batch has {plan.num_tokens} tokens")
    ops.scatter_rows(current_kv.flatten(1), plan.owned_cache_write_locs, pool.flatten(1), plan.errors)
    if plan.checked:
        checked_mode.check_errors(plan, "persist_owned_current")


def gather_current(plan: CpSharedKvPlan, local_kv: torch.Tensor, group: CpGroup) -> torch.Tensor:
    """All-gather this rank's local current KV ``[physical_rows, row...]`` to token order ``[N, row...]``.

    A collective when the batch is split (every rank calls it); under strategy ``"none"`` the
    local rows already are the batch.
    """
    if local_kv.shape[0] != plan.split.physical_rows:
        raise CpSharedKvError(
            f"local current KV has {local_kv.shape[0]} rows, the CP split gives this rank {plan.split.physical_rows}"
        )
    if plan.split.strategy == "none":
        return local_kv[: plan.num_tokens]
    gathered = group.all_gather_rows(local_kv)
    return plan.split.unshard(gathered, plan.current_gather_index)


def build_dense_view(
    plan: CpSharedKvPlan, pool: torch.Tensor, current_kv: torch.Tensor, dense: torch.Tensor, group: CpGroup
) -> torch.Tensor:
    """Steps 1 and 2 for one layer in one op: history, then current KV, into ``dense``; returns it.

    Same result as :func:`materialize_history` followed by :func:`fill_current`, through
    ``ops.materialize_and_fill`` (one launch on the CUDA backend). Under CP the history pages come
    from the all-gather of owned pages (a collective: every rank calls this). The layer-ahead path
    (:class:`~.prefetch.HistoryPrefetcher`) runs the two steps apart instead, history one layer early.
    """
    _check_group(plan, group)
    _check_pool(plan, pool)
    _check_dense(plan, dense)
    if current_kv.shape[0] != plan.num_tokens:
        raise CpSharedKvError(f"current KV has {current_kv.shape[0]} rows, the batch has {plan.num_tokens} tokens")
    if plan.cp_size > 1 and plan.exchange_pages_per_rank > 0:
        src, src_page = group.all_gather_rows(pack_owned_history(plan, pool)), plan.exchange_recv_rows
    else:  # cp = 1, or no history anywhere in the batch (no slot to copy)
        src, src_page = _pages(pool, plan.page_size, "pool"), plan.history_pages
    dense_pages = _pages(dense, plan.page_size, "dense view")
    ops.materialize_and_fill(
        src, src_page, dense_pages, plan.history_slots, current_kv.flatten(1), plan.current_dense_locs, plan.errors
    )
    if plan.checked:
        checked_mode.check_errors(plan, "build_dense_view")
    return dense

"""Checked mode: per-request invariants asserted at runtime.

Enable with the environment variable ``SGLANG_CPKV_CHECKED=1`` (a server reads it once, at start-up, with its
reservation: ``hooks/state.py``; :func:`~sglang_cpkv.runtime.plan.build_plan` called without ``checked`` reads it).
Then the plan and every layer op synchronize and raise :class:`~sglang_cpkv.ops.CpSharedKvError`
naming the bad values:

* after each op, the plan's device error counter (bad page/request ids, rows out of range);
* plan: the entries, the slots and the inverse agree (entry ``(r, j)`` holding page ``p`` points at a slot that
  holds ``p`` and the inverse finds it for ``(r, p)``, and it holds nothing else); no page id twice in one request; a
  history-region slot belongs to no request and holds a page no other region slot holds; an own slot belongs to
  the one request whose entry points at it; every current token's dense location is at its own logical position
  in an own slot of its request, and no dense location is written by two tokens (so no dense slot is written by
  two requests); padded local rows have request id -1 and location -1;
* remap: every remapped top-k location lands in a slot of its own request's view.

Off (the default) it costs nothing: the pipeline tests one Python bool of the plan and launches no
extra kernel and no synchronization.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_cpkv.envs import envs
from sglang_cpkv.ops.errors import CpSharedKvError, raise_if_errors
from sglang_cpkv.ops.reference import lookup_slots

if TYPE_CHECKING:
    from sglang_cpkv.runtime.plan import CpSharedKvPlan

CHECKED_ENV_VAR = envs.SGLANG_CPKV_CHECKED.name


def enabled() -> bool:
    """Whether ``SGLANG_CPKV_CHECKED`` asks for checked mode (``1``, ``true``, ``yes``, ``on``)."""
    return envs.SGLANG_CPKV_CHECKED.get()


def _foreign_slot_reads(plan: CpSharedKvPlan, dense_locs: torch.Tensor, req_id: torch.Tensor) -> torch.Tensor:
    """Bool, shape of ``dense_locs``: a location >= 0 whose slot is not in its row's request's view."""
    in_view = torch.zeros((plan.num_requests, plan.num_slots), dtype=torch.bool)
    for r in range(plan.num_requests):
        in_view[r, plan.request_slots(r)] = True
    rows = dense_locs.shape[0] if dense_locs.dim() else 1
    locs = dense_locs.to(torch.int64).cpu().reshape(rows, -1 if rows else 0)
    req = req_id.to(torch.int64).cpu()
    slot = torch.div(locs, plan.page_size, rounding_mode="floor").clamp(0, plan.num_slots - 1)
    inside = in_view[req.clamp(min=0).unsqueeze(1), slot] & (req >= 0).unsqueeze(1) & (locs < plan.dense_rows)
    return (locs >= 0) & ~inside


def check_errors(plan: CpSharedKvPlan, where: str) -> None:
    """Raise if the plan's device error counter is non-zero (synchronizes)."""
    raise_if_errors(plan.errors, where)


def check_plan(plan: CpSharedKvPlan) -> None:
    """Every plan invariant of the module docstring; raises :class:`CpSharedKvError`."""
    check_errors(plan, "plan build")
    slot_pages = plan.slot_pages.to(torch.int64).cpu()
    slot_req = plan.slot_req.cpu()
    region = plan.history_region_slots
    region_pages = slot_pages[:region]
    if bool((slot_req[:region] != -1).any()) or region_pages.unique().numel() != region:
        raise CpSharedKvError("the history region holds a request's slot or a page id twice")
    inverse = plan.inverse
    for r in range(plan.num_requests):
        slots = plan.request_slots(r)
        pages = slot_pages[slots]
        uniq, counts = pages.unique(return_counts=True)
        if bool((counts > 1).any()):
            raise CpSharedKvError(f"request {r}: page ids {uniq[counts > 1].tolist()} appear twice in its page table")
        own = slots >= region
        if not bool((slot_req[slots[own]] == r).all()):
            raise CpSharedKvError(f"request {r}: its own slots {slots[own].tolist()} are not all its own")
        got = lookup_slots(inverse, torch.full_like(pages, r).to(inverse.device), pages.to(inverse.device)).cpu()
        if not torch.equal(got, slots):
            raise CpSharedKvError(
                f"inverse disagrees with request {r}'s entries: page ids {pages.tolist()} -> slots {got.tolist()}, "
                f"expected {slots.tolist()}"
            )
    own_slots = plan.entry_slots_host[plan.entry_slots_host >= region]
    if own_slots.unique().numel() != own_slots.numel():
        raise CpSharedKvError("an own slot is pointed at by two entries")
    if bool((slot_pages[plan.needed_slots :] != -1).any()) or bool((slot_req[plan.needed_slots :] != -1).any()):
        raise CpSharedKvError("the layout's rounding slots hold a page or a request")
    held = inverse.held_entries()
    if held != plan.entries:
        raise CpSharedKvError(f"inverse holds {held} entries, the batch's tables {plan.entries}")

    dense = plan.current_dense_locs.to(torch.int64).cpu()
    expected = torch.tensor(
        [
            plan.dense_location(r, p)
            for r, (pre, ext) in enumerate(zip(plan.prefix_lens, plan.extend_lens))
            for p in range(pre, pre + ext)
        ],
        dtype=torch.int64,
    )
    wrong = (dense != expected).nonzero().flatten().tolist()
    if wrong:
        req = plan.token_req_id.cpu()
        raise CpSharedKvError(
            "current tokens do not land at their own request's position (token, request, dense loc, expected): "
            f"{[(t, int(req[t]), int(dense[t]), int(expected[t])) for t in wrong[:8]]}"
        )
    if dense.unique().numel() != dense.numel():
        raise CpSharedKvError("two current tokens write the same dense location")
    token_req = plan.token_req_id.cpu()
    writer_slot = torch.div(dense, plan.page_size, rounding_mode="floor")
    if bool((writer_slot < region).any()) or not torch.equal(slot_req[writer_slot], token_req):
        raise CpSharedKvError("a current token writes a history-region slot or another request's slot")
    local_req = plan.local_req_id.cpu()
    local_loc = plan.local_out_cache_loc.cpu()
    if not torch.equal(local_req < 0, local_loc < 0):
        raise CpSharedKvError("CP split: padded rows of request ids and locations disagree")


def check_remapped(plan: CpSharedKvPlan, dense_locs: torch.Tensor, req_id: torch.Tensor, where: str) -> None:
    """Raise if an op dropped a bad id, or a remapped location left its request's slot range."""
    check_errors(plan, where)
    bad = _foreign_slot_reads(plan, dense_locs, req_id)
    if bool(bad.any()):
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        raise CpSharedKvError(
            f"{where}: remapped locations outside their request's slots in rows {rows[:8]} "
            f"(request ids {req_id[rows[:8]].tolist()})"
        )

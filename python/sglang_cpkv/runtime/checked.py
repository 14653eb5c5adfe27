"""Checked mode: per-request invariants asserted at runtime.

Enable with the environment variable ``SGLANG_CPKV_CHECKED=1`` (read once per batch, when
:func:`~sglang_cpkv.runtime.plan.build_plan` runs; ``build_plan(..., checked=True)`` forces it).
Then the plan and every layer op synchronize and raise :class:`~sglang_cpkv.ops.CpSharedKvError`
naming the bad values:

* after each op, the plan's device error counter (bad page/request ids, rows out of range);
* plan: the dense slots and the inverse agree (every slot ``s`` of request ``r`` holding page ``p`` is
  found at ``inverse[r * C + p]``, and nothing else is); each request's slots are its own range
  ``[start[r], start[r] + n_r)``, with no page id twice; every current token's dense location is in its
  own request's range at its own logical position, and no dense location is written by two tokens (so
  no dense slot is written by two requests); padded local rows have request id -1 and location -1;
* remap: every remapped top-k location lands in its own request's slot range.

Off (the default) it costs nothing: the pipeline tests one Python bool of the plan and launches no
extra kernel and no synchronization.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_cpkv.env import env_flag
from sglang_cpkv.ops.errors import CpSharedKvError, raise_if_errors

if TYPE_CHECKING:
    from sglang_cpkv.runtime.plan import CpSharedKvPlan

CHECKED_ENV_VAR = "SGLANG_CPKV_CHECKED"


def enabled() -> bool:
    """Whether ``SGLANG_CPKV_CHECKED`` asks for checked mode (``1``, ``true``, ``yes``, ``on``)."""
    return env_flag(CHECKED_ENV_VAR)


def _slot_range_violations(plan: CpSharedKvPlan, dense_locs: torch.Tensor, req_id: torch.Tensor) -> torch.Tensor:
    """Bool, shape of ``dense_locs``: a location >= 0 outside its row's request slot range."""
    bounds = torch.tensor([plan.slot_range(r) for r in range(plan.num_requests)], dtype=torch.int64) * plan.page_size
    rows = dense_locs.shape[0] if dense_locs.dim() else 1
    locs = dense_locs.to(torch.int64).cpu().reshape(rows, -1 if rows else 0)
    req = req_id.to(torch.int64).cpu()
    lo = bounds[req.clamp(min=0), 0].unsqueeze(1)
    hi = bounds[req.clamp(min=0), 1].unsqueeze(1)
    inside = (locs >= lo) & (locs < hi) & (req >= 0).unsqueeze(1)
    return (locs >= 0) & ~inside


def check_errors(plan: CpSharedKvPlan, where: str) -> None:
    """Raise if the plan's device error counter is non-zero (synchronizes)."""
    raise_if_errors(plan.errors, where)


def check_plan(plan: CpSharedKvPlan) -> None:
    """Every plan invariant of the module docstring; raises :class:`CpSharedKvError`."""
    check_errors(plan, "plan build")
    slot_pages = plan.slot_pages.to(torch.int64).cpu()
    slot_req = plan.slot_req.cpu()
    cap = plan.capacity
    for r in range(plan.num_requests):
        start, stop = plan.slot_range(r)
        if not bool((slot_req[start:stop] == r).all()):
            raise CpSharedKvError(f"request {r}: its slots [{start}, {stop}) are not all its own")
        pages = slot_pages[start:stop]
        uniq, counts = pages.unique(return_counts=True)
        if bool((counts > 1).any()):
            raise CpSharedKvError(f"request {r}: page ids {uniq[counts > 1].tolist()} appear twice in its page table")
    if bool((slot_pages[plan.needed_slots :] != -1).any()) or bool((slot_req[plan.needed_slots :] != -1).any()):
        raise CpSharedKvError("the layout's rounding slots hold a page or a request")
    inverse = plan.inverse.to(torch.int64).cpu()
    for s in range(plan.needed_slots):
        got = int(inverse[int(slot_req[s]) * cap + int(slot_pages[s])])
        if got != s:
            raise CpSharedKvError(
                f"inverse disagrees with the slots: request {int(slot_req[s])} page id {int(slot_pages[s])} -> "
                f"slot {got}, expected {s}"
            )
    if int((inverse >= 0).sum()) != plan.needed_slots:
        raise CpSharedKvError(f"inverse has {int((inverse >= 0).sum())} entries, the batch {plan.needed_slots} slots")

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
            " - out_cache_loc disagrees with the page table"
        )
    if dense.unique().numel() != dense.numel():
        raise CpSharedKvError("two current tokens write the same dense location")
    local_req = plan.local_req_id.cpu()
    local_loc = plan.local_out_cache_loc.cpu()
    if not torch.equal(local_req < 0, local_loc < 0):
        raise CpSharedKvError("CP split: padded rows of request ids and locations disagree")


def check_remapped(plan: CpSharedKvPlan, dense_locs: torch.Tensor, req_id: torch.Tensor, where: str) -> None:
    """Raise if an op dropped a bad id, or a remapped location left its request's slot range."""
    check_errors(plan, where)
    bad = _slot_range_violations(plan, dense_locs, req_id)
    if bool(bad.any()):
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        raise CpSharedKvError(
            f"{where}: remapped locations outside their request's slots in rows {rows[:8]} "
            f"(request ids {req_id[rows[:8]].tolist()})"
        )

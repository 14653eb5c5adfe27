"""Checked mode: per-request invariants asserted at runtime.

Enable with the environment variable ``SGLANG_CPKV_CHECKED=1`` (read once per batch, when
:func:`~sglang_cpkv.runtime.plan.build_plan` runs; ``build_plan(..., checked=True)`` forces it).
Then the plan and every layer op synchronize and raise :class:`~sglang_cpkv.ops.CpSharedKvError`
naming the bad values:

* after each op, the plan's device error counter (bad page/request ids, rows out of range);
* plan: inverse and page table agree (every valid ``(r, j)`` is found at ``r * C + page``, and
  nothing else is); no page id twice within one request's table; every current token's dense
  location is inside its own request's slot range ``[r * P * ps, (r + 1) * P * ps)`` at its own
  logical position, and no dense location is written by two tokens (so no dense slot is written
  by two requests); padded local rows have request id -1 and location -1;
* remap: every remapped top-k location lands in its own request's slot range.

Off (the default) it costs nothing: the layer functions test one Python bool of the plan and
launch no extra kernel and no synchronization.
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
    span = plan.pages_per_request * plan.page_size
    locs = dense_locs.to(torch.int64).reshape(dense_locs.shape[0], -1)
    req = req_id.to(torch.int64).reshape(-1, 1)
    lo = req * span
    inside = (locs >= lo) & (locs < lo + span)
    return (locs >= 0) & ~inside


def check_errors(plan: CpSharedKvPlan, where: str) -> None:
    """Raise if the plan's device error counter is non-zero (synchronizes)."""
    raise_if_errors(plan.errors, where)


def check_plan(plan: CpSharedKvPlan) -> None:
    """Every plan invariant of the module docstring; raises :class:`CpSharedKvError`."""
    check_errors(plan, "plan build")
    table = plan.page_table.to(torch.int64).cpu()
    rows, pages = table.shape
    cap, ps = plan.capacity, plan.page_size
    for r in range(rows):
        row = table[r][table[r] >= 0]
        uniq, counts = row.unique(return_counts=True)
        if bool((counts > 1).any()):
            raise CpSharedKvError(f"request {r}: page ids {uniq[counts > 1].tolist()} appear twice in its page table")
    inverse = plan.inverse.to(torch.int64).cpu()
    valid = (table >= 0).nonzero()
    for r, j in valid.tolist():
        got = int(inverse[r * cap + table[r, j]])
        if got != r * pages + j:
            raise CpSharedKvError(
                f"inverse disagrees with page table: request {r} page index {j} page id {int(table[r, j])} -> slot {got}, expected {r * pages + j}"
            )
    if int((inverse >= 0).sum()) != valid.shape[0]:
        raise CpSharedKvError(f"inverse has {int((inverse >= 0).sum())} entries, page table {valid.shape[0]} pages")

    dense = plan.current_dense_locs.to(torch.int64).cpu()
    expected = torch.cat(
        [
            (r * pages + torch.div(p, ps, rounding_mode="floor")) * ps + p % ps
            for r, (pre, ext) in enumerate(zip(plan.prefix_lens, plan.extend_lens))
            for p in (torch.arange(pre, pre + ext),)
        ]
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

"""Checked mode (``SGLANG_CPKV_CHECKED``): per-request invariants asserted at runtime; off by default, free when off.

A server reads the setting once at start-up with its reservation (``hooks/reservation.py``); :func:`~.plan.build_plan`
called without ``checked`` reads it too. On, the plan's invariants are checked at its build (:func:`~.plan.check_plan`),
and :class:`~.pipeline.LayerPipeline` synchronizes after every op: the batch's device error counter
(:func:`check_errors`) and, after the remap, every location inside its own request's view (:func:`check_remapped`).
Each raises :class:`~sglang_cpkv.ops.CpSharedKvError` naming the bad values. Off, the pipeline tests one bool.
"""

from __future__ import annotations

import torch

from sglang_cpkv.envs import envs
from sglang_cpkv.ops.errors import CpSharedKvError, raise_if_errors
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

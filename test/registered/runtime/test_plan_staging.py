"""The plan's staging: one pinned host buffer sized at start-up (``runtime/plan.py``'s :class:`PlanStaging`).

* The start-up bound (:func:`~sglang_cpkv.runtime.plan.staging_bytes`) holds every batch's staging, on random batches
  of every sharing pattern at cp 1-8 (each rank), on large batches and with page ids not on the host.
* A plan built through a staging that earlier batches used equals one built alone, and the earlier plans' tensors
  are not overwritten by the later batches' staging.
* A batch larger than the buffer is refused naming the setting that sizes it; the serving hook's buffer is the
  reservation's, made once per backend.
"""

import random
import sys

import pytest
import torch

from sglang_cpkv.hooks.dsa_batch import BackendState
from sglang_cpkv.ops.errors import NUM_ERROR_KINDS, CpSharedKvError
from sglang_cpkv.runtime import plan
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.runtime.reservation import SETTING, Reservation
from sglang_cpkv.testing.batches import BatchCase, host_plan, padded_page_table, random_case, sparse_case
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")


def _staged_bytes(case: BatchCase, cp_rank: int, table: torch.Tensor | None) -> tuple[int, int, int]:
    """(bytes the batch stages, its entries, its dense slots)."""
    prefix, extend = plan._validate_lengths(case.prefix_lens, case.extend_lens)
    width = max(len(t) for t in case.page_tables) if table is None else table.shape[1]
    pages_needed = plan._pages_needed(width, prefix, extend, case.page_size)
    kwargs = dict(page_size=case.page_size, cp_size=case.cp_size, cp_rank=cp_rank, capacity=case.capacity)
    layout = plan._BatchLayout(table, width, prefix, extend, pages_needed, validate=table is not None, **kwargs)
    num_slots = round_dense_slots(layout.region_slots + layout.own_slots)
    sizes64, sizes32 = layout.stage_sizes(num_slots, NUM_ERROR_KINDS)
    return 8 * sum(sizes64) + 4 * sum(sizes32), layout.num_entries, num_slots


def _tensors(p: plan.CpSharedKvPlan) -> dict[str, torch.Tensor]:
    held = {name: value.clone() for name, value in vars(p).items() if isinstance(value, torch.Tensor)}
    held["inverse keys"], held["inverse slots"] = p.inverse.keys.clone(), p.inverse.slots.clone()
    return held


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("seed", range(4))
def test_the_start_up_bound_holds_every_batch(seed):
    rng = random.Random(seed)
    for _ in range(60):
        case = random_case(rng, max_requests=8, max_cp=8, page_sizes=(1, 2, 4, 64))
        table = padded_page_table(case, max(len(t) for t in case.page_tables))
        for cp_rank in range(case.cp_size):
            for known in (table, None):  # ids on the host, and a device table without history (cells staged)
                if known is None and any(case.prefix_lens):
                    continue
                nbytes, entries, slots = _staged_bytes(case, cp_rank, known)
                assert nbytes <= plan.staging_bytes(entries, slots), (case, cp_rank)


@pytest.mark.parametrize("cp_size", [1, 2, 8])
@pytest.mark.parametrize("shared_pages", [0, 40])
def test_the_start_up_bound_holds_large_batches(cp_size, shared_pages):
    gen = torch.Generator().manual_seed(cp_size * 100 + shared_pages)
    case = sparse_case(64, 64, 10_000, 150, gen, shared_pages=tuple(range(1, shared_pages + 1))).on_cp(cp_size)
    table = padded_page_table(case, 150)
    for cp_rank in sorted({0, cp_size - 1}):
        nbytes, entries, slots = _staged_bytes(case, cp_rank, table)
        assert nbytes <= plan.staging_bytes(entries, slots)


def test_one_buffer_serves_batch_after_batch_and_leaves_earlier_plans_intact():
    rng = random.Random(11)
    cases = [random_case(rng, max_requests=8, max_cp=4, page_sizes=(2, 4)) for _ in range(12)]
    entries = max(sum(map(len, c.page_tables)) for c in cases)
    staging = plan.PlanStaging(plan.staging_bytes(entries, round_dense_slots(entries)), "cpu")
    address = staging.buffer.data_ptr()
    built = []
    for case in cases:
        reused = host_plan(case, case.cp_size - 1, staging=staging)
        alone = host_plan(case, case.cp_size - 1)
        _assert_same(_tensors(reused), _tensors(alone))
        built.append((reused, _tensors(alone)))
    assert staging.buffer.data_ptr() == address
    for reused, alone in built:  # after every later batch's staging
        _assert_same(_tensors(reused), alone)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_the_page_table_dtypes_and_a_strided_table(dtype):
    case = random_case(random.Random(7), max_requests=8, max_cp=2, page_sizes=(4,))
    wide = padded_page_table(case, max(len(t) for t in case.page_tables) + 3)
    strided = torch.full((case.num_requests, 2 * wide.shape[1]), -1, dtype=dtype)[:, ::2]
    strided.copy_(wide)
    assert not strided.is_contiguous()
    for cp_rank in range(case.cp_size):
        _assert_same(_tensors(host_plan(case, cp_rank, table=strided)), _tensors(host_plan(case, cp_rank)))


def test_a_batch_past_the_buffer_is_refused_naming_the_setting():
    reservation = Reservation(
        max_batch_tokens=64,
        chunk_tokens=64,
        page_size=4,
        cp_size=1,
        layer_ahead=False,
        latent_token_bytes=8,
        index_k_token_bytes=0,
    )
    staging = BackendState().plan_staging(reservation, torch.device("cpu"))
    assert staging.buffer.numel() == reservation.plan_staging_bytes
    case = BatchCase(4, 4096, (tuple(range(200)), tuple(range(200, 400))), (400, 400), (400, 400))
    with pytest.raises(
        CpSharedKvError, match=f"more than the {reservation.plan_staging_bytes} reserved at start-up: raise {SETTING}"
    ):
        host_plan(case, 0, staging=staging)
    small = BatchCase(4, 4096, ((1, 2), (3,)), (4, 0), (3, 2))
    _assert_same(_tensors(host_plan(small, 0, staging=staging)), _tensors(host_plan(small, 0)))


def test_the_hook_keeps_one_buffer_per_reservation_and_device():
    state = BackendState()
    reservation = Reservation(128, 64, 4, 2, True, 8, 4)
    first = state.plan_staging(reservation, torch.device("cpu"))
    assert state.plan_staging(reservation, torch.device("cpu")) is first
    other = Reservation(256, 64, 4, 2, True, 8, 4)
    assert state.plan_staging(other, torch.device("cpu")).buffer.numel() == other.plan_staging_bytes


def test_a_staging_on_another_device_is_refused():
    case = BatchCase(4, 64, ((1, 2),), (0,), (5,))
    staging = plan.PlanStaging(1 << 16, "meta")
    with pytest.raises(CpSharedKvError, match="the plan's staging is on meta, the batch's out_cache_loc on cpu"):
        host_plan(case, 0, staging=staging)


@pytest.mark.parametrize(
    "tables, message",
    [
        (((70, 1), (2, 3)), r"request 0: page ids outside \[0, capacity=64\) at page index/value \[\(0, 70\)\]"),
        (((2, 3), (5, 5)), r"request 1: page ids \[5\] appear twice"),
        (((2, 3), (-1, 1)), r"request 1: page ids outside"),
    ],
)
def test_a_bad_host_id_is_named(tables, message):
    with pytest.raises(CpSharedKvError, match=message):
        host_plan(BatchCase(4, 64, tables, (4, 4), (4, 4)), 0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

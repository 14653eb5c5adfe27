"""The mode's edge paths, through upstream's DSA kit (cp 1, CPU) and the public runtime API.

Each test failed before its fix (issue 21, item 4):

* a dropped bad id counted in one batch's device counter raised in every later batch (the error was raised
  before the counters still in transit were updated): it now raises once, in the next batch, naming its batch,
  and the batch after serves and reads what the mode-off run reads;
* a forward whose layers run with another forward batch than the one the plan began fell back to upstream's
  pool path (wrong rows: the tables hold dense locations, the pool only owned pages): now refused;
* a batch without current tokens passed plan build and crashed in the first layer with an ``IndexError``: now
  a :class:`CpSharedKvError` at plan build, and the ops take zero current rows;
* negative locations other than -1 were silent padding in ``remap_locs`` and ``dense_to_pool_locs``: now
  counted bad ids on every backend (the CUDA kernel is held to the same reference in ``test_cuda_ops.py``);
* an exchange round under the reserved bound was padded to the bound, not to the pages the batch needs (since
  issue 24 there are no rounds: each rank's block of the history region is exactly its owned pages, gathered in
  place);
* (a proof, not a fix) a request on the pages an aborted chunk wrote reads only its own KV;
* the default ``--cp-shared-kv-max-batch-tokens`` promised one full-context request plus a chunk of others,
  but each request's page rounding was not counted.
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv import ops
from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, ERR_PAGE_OUT_OF_RANGE, CpSharedKvError, new_error_counter
from sglang_cpkv.runtime import LayerPipeline, SingleRankGroup, build_cp_split, build_plan
from sglang_cpkv.runtime.plan import dense_to_pool_locs
from sglang_cpkv.runtime.reservation import Reservation, default_max_batch_tokens, page_rounded
from sglang_cpkv.testing.batches import BatchCase, host_plan, same_bytes
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, kit_capacity

register_cpu_ci(est_time=40, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

PAGED_BF16 = KitRoute("flashmla_sparse")
SHAPE = (2, 200)


def _case(seed: int) -> BatchCase:
    """Two requests with a history and a chunk each; another page layout per seed (page 0 is reserved)."""
    capacity = kit_capacity(*SHAPE)
    tables = (((2, 5, 7), (3, 6)), ((8, 1, 4), (9, 10)))[seed % 2]
    return BatchCase(PAGE, capacity, tables, (100, 70), (30, 20))


def _world(mode_on: bool) -> KitWorld:
    return KitWorld(PAGED_BF16, max_requests=SHAPE[0], longest=SHAPE[1], mode_on=mode_on, device="cpu")


def _assert_same_reads(off, on) -> None:
    for a, b in zip(off.kernel, on.kernel):
        assert same_bytes(a.rows, b.rows) and torch.equal(a.valid, b.valid)


def _drop_a_bad_id(plan) -> None:
    """What an op of the batch does with a page id past the pool: drop it and count it in the batch's counter."""
    past_pool = torch.tensor([plan.capacity * plan.page_size + 3])
    ops.remap_locs(past_pool, torch.tensor([0]), plan.inverse, plan.page_size, plan.errors)


def test_a_counted_error_raises_once_for_its_batch_and_the_next_batch_serves():
    world = _world(True)
    first, second, third = _case(0), _case(1), _case(0)
    world.write_history(first)
    world.forward(first)
    _drop_a_bad_id(world.backend.cp_shared_kv.batch.plan)
    world.write_history(second)
    with pytest.raises(CpSharedKvError, match=r"extend batch 1 \(2 requests\): dropped bad ids: 1 x page id"):
        world.forward(second)
    on = world.forward(third)  # served: the error was batch 1's, raised once
    off_world = _world(False)
    off_world.write_history(third)
    _assert_same_reads(off_world.forward(third), on)


def test_layers_that_see_another_forward_batch_are_refused():
    case = _case(0)
    off = _world(False)
    off.write_history(case)
    off.forward(case, layers_see_another_forward_batch=True)  # upstream's own path takes it
    on = _world(True)
    on.write_history(case)
    with pytest.raises(CpSharedKvError, match="forward batch the CP shared-KV plan hook did not begin"):
        on.forward(case, layers_see_another_forward_batch=True)


def test_a_request_on_the_pages_an_aborted_chunk_wrote_reads_only_its_own_kv():
    """Abort mid-chunk (``process_pending_chunked_abort``): upstream frees the aborted request's pages and a later
    batch gets them as fresh pages. Request A's first chunk persisted rows into pages 2, 5 and 7; after its abort B
    writes its current tokens there (one request beside a radix hit on page 8): B reads what it reads on a pool that
    never held A, with the mode on and off."""
    capacity = kit_capacity(*SHAPE)
    aborted = BatchCase(PAGE, capacity, ((2, 5, 7),), (0,), (150,))
    reuse = BatchCase(PAGE, capacity, ((8, 5), (2, 7)), (64, 0), (30, 100))
    runs = {}
    for mode_on in (False, True):
        world = _world(mode_on)
        world.forward(aborted)
        world.write_history(reuse)
        runs[mode_on] = world.forward(reuse)
        fresh = _world(mode_on)
        fresh.write_history(reuse)
        _assert_same_reads(fresh.forward(reuse), runs[mode_on])
    _assert_same_reads(runs[False], runs[True])


def test_a_batch_without_current_tokens_is_refused_at_plan_build():
    with pytest.raises(CpSharedKvError, match=r"no current tokens \(extend_lens \[0, 0\]\)"):
        build_plan(
            [[1, 2], [3]],
            [100, 64],
            [0, 0],
            torch.empty(0, dtype=torch.int64),
            capacity=8,
            page_size=PAGE,
            split=build_cp_split("none", [0, 0], 1, 0),
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_ops_take_zero_current_rows(backend, monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    errors = new_error_counter("cpu")
    dense = torch.zeros(3, 4 * 8)
    ops.scatter_rows(torch.empty(0, 8), torch.empty(0, dtype=torch.int64), dense.view(-1, 8), errors)
    ops.materialize_and_fill(
        dense, torch.tensor([0]), dense, torch.tensor([1]), torch.empty(0, 8), torch.empty(0, dtype=torch.int64), errors
    )
    assert errors.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("negative", [-2, -3, -64, -(2**31)])
def test_negative_locations_other_than_minus_one_are_counted_bad_ids(backend, negative, monkeypatch):
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    plan = host_plan(BatchCase(4, 16, ((1, 5), (9, 3)), (5, 2), (2, 3)), 0)
    pipe = LayerPipeline(plan, SingleRankGroup(), [], layer_ahead=False)
    topk = torch.tensor([[4, -1, negative], [negative, 36, -1]])
    remapped = pipe.remap(topk, torch.tensor([0, 1]))
    assert remapped.tolist() == [[plan.dense_location(0, 0), -1, -1], [-1, plan.dense_location(1, 0), -1]]
    assert plan.errors[ERR_PAGE_OUT_OF_RANGE] == 2
    back = dense_to_pool_locs(plan, torch.tensor([negative, -1, plan.dense_location(1, 0)]))
    assert back.tolist() == [-1, -1, 36]
    assert plan.errors[ERR_LOC_OUT_OF_RANGE] == 1


def test_the_history_region_is_gathered_in_place_in_owner_blocks():
    """Under CP the dense view's history region is ordered as the all-gather delivers it: rank k's block holds the
    distinct history pages it owns, packed from its pool straight into the view; a page two requests read is one
    slot (their inverse entries both point at it), and nothing is exchanged through a buffer of its own."""
    case = BatchCase(PAGE, 64, ((4, 9, 2, 7, 11), (4, 9, 5)), (256, 128), (10, 20), cp_size=2)
    for rank in range(2):
        plan = build_plan(
            [list(t) for t in case.page_tables],
            case.prefix_lens,
            case.extend_lens,
            torch.tensor(case.out_cache_loc(), dtype=torch.int64),
            capacity=case.capacity,
            page_size=PAGE,
            split=build_cp_split("interleave", case.extend_lens, 2, rank),
        )
        # distinct history pages 2, 4 (rank 0) and 7, 9 (rank 1): blocks of two, rank-major; then the own pages
        assert plan.gather_blocks == ((0, 2), (2, 2)) and plan.history_region_slots == 4
        assert plan.slot_pages.tolist()[:4] == [2, 4, 7, 9]
        start, count = plan.gather_blocks[rank]
        assert plan.pool_copy_slots.tolist() == list(range(start, start + count))
        assert plan.pool_copy_pages.tolist() == [p // 2 for p in plan.slot_pages.tolist()[start : start + count]]
        # pages 4 and 9: one slot each, read by both requests
        assert plan.request_slots(0).tolist()[:2] == plan.request_slots(1).tolist()[:2] == [1, 3]
        assert plan.needed_slots == 4 + 2  # the region and the own pages 11 and 5


def test_the_default_limit_holds_one_full_context_request_and_a_chunk_of_others_page_rounded():
    """One request of the full context (160K history and a 1024-token chunk) beside 31 requests of 224 tokens:
    the chunk's 7968 current tokens fit an 8192-token chunk, but each small request occupies 256 dense tokens
    (31 x 32 of rounding). Also the worst case the default is for: as many requests as the chunk has pages, each
    one token past a page."""
    context, chunk = 160 * 1024 + 1024, 8192
    batches = {
        "160K + 31 x 224": ([160 * 1024] + [0] * 31, [1024] + [224] * 31),
        # 127 others in the chunk's other 8191 tokens, each one token past a page: 126 x 65 + 1.
        "worst rounding": ([context - 1] + [0] * 127, [1] + [PAGE + 1] * 126 + [1]),
    }
    limit = default_max_batch_tokens(context, chunk, PAGE)
    reservation = Reservation(limit, chunk, PAGE, 1, False, 656, 132)
    for name, (prefix, extend) in batches.items():
        assert sum(extend) <= chunk, name
        pages = [-(-(p + e) // PAGE) for p, e in zip(prefix, extend)]
        tables, next_page = [], 0
        for n in pages:
            tables.append(list(range(next_page, next_page + n)))
            next_page += n
        locs = torch.tensor(
            [t[(p + i) // PAGE] * PAGE + (p + i) % PAGE for t, p, e in zip(tables, prefix, extend) for i in range(e)]
        )
        plan = build_plan(
            tables, prefix, extend, locs, capacity=next_page, page_size=PAGE, split=build_cp_split("none", extend, 1, 0)
        )
        dense_tokens = plan.needed_slots * PAGE
        reservation.check_batch(dense_tokens, plan.num_slots, plan.num_tokens, plan.entries)  # fits: no refusal
    # The worst case needs more than the context and the chunk page-rounded: the rounding is what counts.
    assert dense_tokens > page_rounded(context, PAGE) + page_rounded(chunk, PAGE)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))

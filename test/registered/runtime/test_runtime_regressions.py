"""The CP shared-KV runtime on hand-made batches: the seed's regressions, errors, checked mode, prefetch."""

import dataclasses
import sys

import pytest
import torch

from sglang_cpkv.ops import reference
from sglang_cpkv.ops.errors import CpSharedKvError, new_error_counter
from sglang_cpkv.runtime import (
    CHECKED_ENV_VAR,
    MAX_ROUNDING,
    LayerPipeline,
    SingleRankGroup,
    build_cp_split,
    build_plan,
    round_dense_slots,
    rows_kind,
)
from sglang_cpkv.testing.batches import (
    COLLISION,
    POISON_BYTE,
    REACHABLE,
    BatchCase,
    check_against_truth,
    error_counts,
    host_plan,
    inverse_table,
    make_pool_and_current,
    random_topk,
    run_case_on_ranks,
    same_bytes,
    truth_rows,
)
from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.value_keyed_inverse import value_keyed_pipeline

register_cpu_ci(est_time=15, suite="cpkv-cpu")

GROUP = SingleRankGroup()


def _pipeline(plan, pool, *, layer_ahead=False, pools=None):
    """The runtime's pipeline over one layer's pool (or ``pools``, one per layer), cp = 1."""
    kind = rows_kind("kv", pools or [pool], plan, layer_ahead=layer_ahead, fill_byte=POISON_BYTE)
    return LayerPipeline(plan, GROUP, [kind], layer_ahead=layer_ahead)


def _read(pipe, dense, r, loc):
    """What request r reads at pool location loc through the runtime."""
    d = int(pipe.remap(torch.tensor([[loc]]), torch.tensor([r]))[0, 0])
    return d, (dense[d] if d >= 0 else None)


# The seed's regression: page tables [[1, 5], [9, 5]] share physical page 5, partially filled, and
# both requests continue it with divergent current tokens (CURRENT_REUSE) - a collision-class state.
SHARED_5 = BatchCase(page_size=4, capacity=16, page_tables=((1, 5), (9, 5)), prefix_lens=(5, 5), extend_lens=(2, 2))


def test_shared_page_5_each_request_keeps_its_own_slot_and_current_write():
    case = SHARED_5
    assert case.state_class == COLLISION
    plan = host_plan(case, 0)
    C = case.capacity
    # The history region holds the history-only pages (1, 9: slots 0-1); page 5 takes current tokens of both
    # requests, so each request has its own slot of it (2 and 3), its history rows copied in from the pool (at cp 1
    # no view reads page 5 from the region, so the region has no slot of it).
    assert plan.history_region_slots == 2 and plan.slot_pages.tolist() == [1, 9, 5, 5]
    assert plan.slot_req.tolist() == [-1, -1, 0, 1]
    inverse = inverse_table(plan.inverse).tolist()
    assert inverse[0 * C + 5] == 2 and inverse[1 * C + 5] == 3
    assert inverse[0 * C + 1] == 0 and inverse[1 * C + 9] == 1
    # Current tokens: positions 5, 6 of each request, i.e. page 5 offsets 1, 2, in its OWN slot.
    assert plan.current_dense_locs.tolist() == [2 * 4 + 1, 2 * 4 + 2, 3 * 4 + 1, 3 * 4 + 2]
    pool, current = make_pool_and_current(case, torch.bfloat16, 8, seed=1)
    pipe = _pipeline(plan, pool)
    dense = pipe.dense_view("kv", 0, current)
    truth = truth_rows(case, pool, current)
    for r in range(2):
        for p in range(7):
            assert same_bytes(dense[plan.dense_location(r, p)], truth[r][p]), (r, p)
        _, row = _read(pipe, dense, r, 5 * 4 + 1)  # both requests read "their" loc 21
        assert same_bytes(row, current[2 * r]), f"request {r} read another request's current KV"


def test_per_request_lookups_refuse_what_is_outside_the_request():
    """Request 0 of SHARED_5 has 7 tokens on 2 pages; its position 8 (its last page's row past its tokens) and any
    position of request 2 or -1 would name another request's view (-1: the last one's): each lookup refuses."""
    plan = host_plan(SHARED_5, 0)
    assert plan.dense_location(0, 6) == plan.request_locations(0)[6]
    for lookup, named in (
        (lambda: plan.dense_location(0, 7), "position 7 is outside request 0's 7 tokens"),
        (lambda: plan.dense_location(0, -1), "position -1 is outside request 0's 7 tokens"),
        (lambda: plan.dense_location(2, 0), r"request 2 is not in the batch \(requests 0..1\)"),
        (lambda: plan.request_slots(-1), r"request -1 is not in the batch"),
        (lambda: plan.request_locations(0, 9), "request 0 has 7 tokens, asked for the locations of 9"),
    ):
        with pytest.raises(CpSharedKvError, match=named):
            lookup()


# A and B read pages 1 and 5 as history only (one shared history slot each) and write pages 2 and 3.
SHARED_HISTORY = BatchCase(
    page_size=4, capacity=16, page_tables=((1, 5, 2), (1, 5, 3)), prefix_lens=(8, 8), extend_lens=(2, 2)
)


@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "checked"])
def test_a_current_row_never_lands_in_a_shared_slot(checked):
    """B's out_cache_loc disagrees with its page table: its two current tokens name page 5, which B (and A) read
    as history only, so their dense slot through the inverse would be the shared history slot of page 5. Current rows
    land at their positions' locations (B's own page 3), and the disagreement is counted on the device (outside
    checked mode with no host sync: the plan refuses nothing): A's view keeps page 5's history, B's view is its
    page table's; checked mode raises, naming the kind."""
    case = SHARED_HISTORY
    locs = torch.tensor(case.out_cache_loc(), dtype=torch.int64)
    assert locs[2:].tolist() == [3 * 4 + 0, 3 * 4 + 1]
    locs[2:] = torch.tensor([5 * 4 + 0, 5 * 4 + 1])  # B's chunk "in" page 5
    kw = dict(
        capacity=case.capacity, page_size=4, split=build_cp_split("none", case.extend_lens, 1, 0), checked=checked
    )
    build = lambda: build_plan([list(t) for t in case.page_tables], case.prefix_lens, case.extend_lens, locs, **kw)  # noqa: E731
    message = "current token whose out_cache_loc is not the location its page table gives it"
    if checked:
        with pytest.raises(CpSharedKvError, match=message):
            build()
        return
    plan = build()
    shared_5 = int(plan.request_slots(0)[1])
    assert shared_5 == int(plan.request_slots(1)[1]) < plan.history_region_slots
    assert plan.errors.tolist() == error_counts(mismatch=2)
    assert plan.current_dense_locs.tolist()[2:] == [plan.dense_location(1, 8), plan.dense_location(1, 9)]
    pool, current = make_pool_and_current(case, torch.bfloat16, 8, seed=3)
    dense = _pipeline(plan, pool).dense_view("kv", 0, current)
    truth = truth_rows(case, pool, current)
    for r, tokens in ((0, 10), (1, 10)):  # A: its history (pages 1 and 5) and its chunk; B: its history and chunk
        for p in range(tokens):
            assert same_bytes(dense[plan.dense_location(r, p)], truth[r][p]), (r, p)
    with pytest.raises(CpSharedKvError, match=f"2 x {message}"):
        plan.raise_if_errors()


def test_the_region_holds_the_pages_some_view_reads_from_it():
    """64 requests on one shared 2-page prefix whose last page each continues (its own slot): at cp 1 the region
    holds the history-only pages only (an own slot's history comes from the pool); under CP every page read as
    history (own slots copy theirs from the gathered region). A request without current tokens whose history ends
    mid-page reads that page as history: a shared slot, not one of its own."""
    ps, n = 4, 64
    tables = tuple((1, 2, 3 + r) for r in range(n))
    case = BatchCase(ps, 80, tables, (10,) * n, (1,) * n)  # history ends in each request's own page 3 + r
    plan = host_plan(case, 0)
    assert plan.history_region_slots == 2 and plan.needed_slots == 2 + n
    cp2 = BatchCase(ps, 80, tables, (10,) * n, (1,) * n, cp_size=2)
    assert host_plan(cp2, 0).history_region_slots == 2 + n

    zero_extend = BatchCase(ps, 16, ((1, 5), (1, 6)), (6, 6), (0, 2))  # request 0 has no current tokens
    plan = host_plan(zero_extend, 0)
    assert int(plan.request_slots(0)[1]) < plan.history_region_slots  # page 5: history, a shared slot
    assert plan.slot_req.tolist()[: plan.needed_slots] == [-1, -1, 1]  # region (1, 5); only request 1 owns a slot
    pool, current = make_pool_and_current(zero_extend, torch.bfloat16, 8, seed=4)
    dense = _pipeline(plan, pool).dense_view("kv", 0, current)
    truth = truth_rows(zero_extend, pool, current)
    for r, tokens in ((0, 6), (1, 8)):
        for p in range(tokens):
            assert same_bytes(dense[plan.dense_location(r, p)], truth[r][p]), (r, p)


def test_shared_page_5_value_keyed_inverse_contaminates():
    """Negative control on the same batch: request 0 reads request 1's current KV."""
    case = SHARED_5
    pool, current = make_pool_and_current(case, torch.bfloat16, 8, seed=1)
    topk = torch.tensor([[21], [21], [21], [21]])
    dense, remapped = value_keyed_pipeline(case, pool, current, topk)
    read_by_request_0 = dense[int(remapped[0, 0])]
    assert same_bytes(read_by_request_0, current[2]) and not same_bytes(read_by_request_0, current[0])


def test_bs_gt_1_shared_prefix_and_current_reuse_equal_bs_1():
    # A and B share full page 3 (page-aligned radix sharing); A's history ends mid-page 7 and its
    # current chunk continues it (CURRENT_REUSE); C has no history. Reachable in 0.5.23.
    case = BatchCase(
        page_size=4,
        capacity=16,
        page_tables=((3, 7, 2), (3, 8), (11, 12)),
        prefix_lens=(6, 4, 0),
        extend_lens=(5, 3, 7),
    )
    assert case.state_class == REACHABLE
    for dtype, width in ((torch.bfloat16, 576), (torch.uint8, 656)):  # bf16 rows, packed FP8 rows as bytes
        pool, current = make_pool_and_current(case, dtype, width, seed=2)
        plan = host_plan(case, 0)
        dense = _pipeline(plan, pool).dense_view("kv", 0, current)
        start = 0
        for r in range(3):
            alone = BatchCase(4, 16, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],))
            cur = current[start : start + case.extend_lens[r]]
            start += case.extend_lens[r]
            solo_plan = host_plan(alone, 0)
            solo = _pipeline(solo_plan, pool).dense_view("kv", 0, cur)
            for p in range(case.prefix_lens[r] + case.extend_lens[r]):
                assert same_bytes(dense[plan.dense_location(r, p)], solo[solo_plan.dense_location(0, p)]), (dtype, r, p)
        topk, positions = random_topk(case, 5, seed=3)
        results = run_case_on_ranks(case, pool, current, topk)
        assert check_against_truth(case, pool, current, positions, results) == []


def test_c2_valid_history_loc_not_dropped_when_another_request_writes_that_page():
    # Collision class (C2): request 0's history page 6 (3 tokens) is the page request 1 writes its
    # current tokens to (a page id reused across requests in one batch).
    case = BatchCase(page_size=4, capacity=8, page_tables=((6,), (6, 2)), prefix_lens=(3, 0), extend_lens=(1, 6))
    assert case.state_class == COLLISION
    pool, current = make_pool_and_current(case, torch.bfloat16, 8, seed=4)
    plan = host_plan(case, 0)
    pipe = _pipeline(plan, pool.clone())
    dense = pipe.dense_view("kv", 0, current)
    pipe.persist_owned("kv", 0, current)
    for p in range(3):
        d, row = _read(pipe, dense, 0, 6 * 4 + p)
        assert d >= 0, f"request 0's valid history position {p} was dropped"
        assert same_bytes(row, pool[6 * 4 + p])
    # The value-keyed control drops or replaces it.
    topk = torch.tensor([[24, 25, 26]] * case.num_tokens)
    dense_1d, remapped_1d = value_keyed_pipeline(case, pool, current, topk)
    wrong = [
        p
        for p in range(3)
        if int(remapped_1d[0, p]) < 0 or not same_bytes(dense_1d[int(remapped_1d[0, p])], pool[24 + p])
    ]
    assert wrong, "the value-keyed control was expected to lose request 0's history"


def _build(case, cp_size=1, cp_rank=0, **overrides):
    args = dict(
        page_table=[list(t) for t in case.page_tables],
        prefix_lens=case.prefix_lens,
        extend_lens=case.extend_lens,
        out_cache_loc=torch.tensor(case.out_cache_loc()),
        capacity=case.capacity,
        page_size=case.page_size,
    )
    args.update(overrides)
    return build_plan(**args, split=build_cp_split("interleave", args["extend_lens"], cp_size, cp_rank))


def test_plan_build_errors_name_the_bad_value():
    case = SHARED_5
    with pytest.raises(CpSharedKvError, match=r"request 1: page ids outside \[0, capacity=16\).*\(0, 99\)"):
        _build(case, page_table=[[1, 5], [99, 5]])
    with pytest.raises(CpSharedKvError, match=r"request 0: page ids \[1\] appear twice"):
        _build(case, page_table=[[1, 1], [9, 5]])
    with pytest.raises(CpSharedKvError, match=r"more than int32 holds"):
        _build(case, page_size=1 << 30, prefix_lens=(1 << 31, 5), extend_lens=(2, 2))
    with pytest.raises(CpSharedKvError, match=r"page_table has 1 columns"):
        _build(case, page_table=[[1], [9]])
    with pytest.raises(CpSharedKvError, match="out_cache_loc has 3 entries, sum\\(extend_lens\\) = 4"):
        _build(case, out_cache_loc=torch.tensor([21, 22, 21]))
    with pytest.raises(CpSharedKvError, match="cp_rank 2 outside"):
        _build(case, cp_size=2, cp_rank=2)
    with pytest.raises(CpSharedKvError, match="prefix_lens must be >= 0"):
        _build(case, prefix_lens=(5, -1))
    with pytest.raises(CpSharedKvError, match="must hold integer token counts"):
        _build(case, prefix_lens=(5, 4.5))  # a float length never truncates silently
    with pytest.raises(CpSharedKvError, match="prefix_lens has 1 entries, extend_lens 2"):
        _build(case, prefix_lens=(5,))
    with pytest.raises(CpSharedKvError, match="outside the pool"):
        _build(case, out_cache_loc=torch.tensor([21, 22, 21, 64]))


class _RankOneOfTwo:
    """A CP group of two whose collectives are never reached (the checks come first)."""

    cp_size, cp_rank = 2, 1

    def all_gather_rows(self, local, out=None):
        raise AssertionError("no collective expected")


def test_mismatched_cp_split_or_group_is_an_error():
    plan = _build(SHARED_5, cp_size=2, cp_rank=1)  # N=4 over 2 ranks: 2 local rows, physical 2
    assert plan.split.physical_rows == 2 and plan.local_req_id.tolist() == [0, 1]
    with pytest.raises(CpSharedKvError, match="does not match the plan"):
        _pipeline(plan, torch.zeros(64, 8))
    pipe = LayerPipeline(
        plan, _RankOneOfTwo(), [rows_kind("kv", [torch.zeros(64, 8)], plan, layer_ahead=False)], layer_ahead=False
    )
    with pytest.raises(CpSharedKvError, match="the CP split gives this rank 2"):
        pipe.gather_current(torch.zeros(3, 8))
    with pytest.raises(CpSharedKvError, match="gathered 3 rows, expected cp_size\\*physical_rows"):
        plan.split.unshard(torch.zeros(3, 8))


def test_device_side_errors_are_counted_then_raised_at_sync_point():
    plan = _build(SHARED_5, checked=False)
    out = _pipeline(plan, torch.zeros(64, 8)).remap(torch.tensor([[21, 5]]), torch.tensor([7]))  # no request 7
    assert out.tolist() == [[-1, -1]]
    with pytest.raises(CpSharedKvError, match="request id out of range"):
        plan.raise_if_errors()


def test_checked_mode_raises_at_the_op(monkeypatch):
    monkeypatch.setenv(CHECKED_ENV_VAR, "1")
    plan = _build(SHARED_5)
    assert plan.checked
    with pytest.raises(CpSharedKvError, match="request id out of range"):
        _pipeline(plan, torch.zeros(64, 8)).remap(torch.tensor([[21]]), torch.tensor([7]))
    # out_cache_loc that disagrees with the page table (token 0 claims page 9 of request 1).
    with pytest.raises(CpSharedKvError, match="out_cache_loc disagrees with the page table"):
        _build(SHARED_5, out_cache_loc=torch.tensor([37, 22, 21, 22]))
    monkeypatch.setenv(CHECKED_ENV_VAR, "0")
    assert not _build(SHARED_5).checked


def test_page_ids_past_int32_are_bad_ids_not_wrapped():
    """An int64 page id of a device table is checked before the int32 cast: 2**32 + 5 must not become page 5."""
    from sglang_cpkv.runtime.plan import _entry_pages

    table = torch.tensor([[1, 2**32 + 5]], dtype=torch.int64)
    pages = _entry_pages(table, torch.tensor([0, 1]), capacity=16)
    assert pages.tolist() == [1, 16]  # 16 = C: counted as out of range by the inverse build
    errors = new_error_counter("cpu")
    inverse = reference.build_page_inverse(pages, torch.tensor([0, 0]), 1, 16, errors)
    assert errors.tolist() == [1, 0, 0, 0] and int(inverse_table(inverse)[5]) == -1


def test_checked_mode_remaps_zero_rows(monkeypatch):
    monkeypatch.setenv(CHECKED_ENV_VAR, "1")
    pipe = _pipeline(_build(SHARED_5), torch.zeros(64, 8))
    out = pipe.remap(torch.empty(0, 4, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, 4)


def test_required_request_ids_one_per_row():
    pipe = _pipeline(_build(SHARED_5), torch.zeros(64, 8))
    with pytest.raises(CpSharedKvError, match="one id per row"):
        pipe.remap(torch.tensor([[21, 22], [21, 22]]), torch.tensor([0]))


def test_layer_ahead_matches_synchronous_and_refuses_early_persist():
    """Three layers: the layer-ahead pipeline (double buffers) gives every layer the dense view the
    synchronous one (fused materialize_and_fill) gives; layers 0 and 2 share a buffer; owned rows are
    refused before their layer's history was taken."""
    case = BatchCase(page_size=2, capacity=12, page_tables=((3, 7, 2), (3, 8)), prefix_lens=(5, 3), extend_lens=(1, 1))
    plan = host_plan(case, 0)
    pools = [make_pool_and_current(case, torch.bfloat16, 4, seed=10 + layer)[0] for layer in range(3)]
    currents = [make_pool_and_current(case, torch.bfloat16, 4, seed=20 + layer)[1] for layer in range(3)]
    ahead = _pipeline(plan, None, layer_ahead=True, pools=[p.clone() for p in pools])
    sync = _pipeline(plan, None, pools=[p.clone() for p in pools])
    with pytest.raises(CpSharedKvError, match="before the layer's history was taken"):
        ahead.persist_owned("kv", 0, currents[0])
    views = []
    for layer in range(3):
        got = ahead.dense_view("kv", layer, currents[layer])
        want = sync.dense_view("kv", layer, currents[layer])
        for r in range(2):
            for p in range(case.prefix_lens[r] + case.extend_lens[r]):
                loc = plan.dense_location(r, p)
                assert same_bytes(got[loc], want[loc]), (layer, r, p)
        ahead.persist_owned("kv", layer, currents[layer])
        sync.persist_owned("kv", layer, currents[layer])
        views.append(got.data_ptr())
    assert views[0] == views[2] != views[1]
    with pytest.raises(CpSharedKvError, match="layer 5 has no kv"):
        ahead.dense_view("kv", 5)


def test_under_cp_a_rank_addresses_its_pool_by_owner_pool_page():
    """Page id ``p`` is rank ``p % cp``'s pool page ``p // cp`` (upstream's page-interleave allocator numbers cp x a
    pool's pages): the rows a rank persists and the pages it packs for the exchange are pool pages, and a pool sized
    for every page id (the layout before page ids were widened) is refused."""
    cp, ps = 2, 4
    case = BatchCase(ps, 16, ((3, 6, 9), (3, 10)), (10, 4), (2, 3)).on_cp(cp)
    out_cache_loc = torch.tensor(case.out_cache_loc(), dtype=torch.int64)
    history_pages = sorted({p for r, t in enumerate(case.page_tables) for p in t[: -(-case.prefix_lens[r] // ps)]})
    for rank in range(cp):
        plan = host_plan(case, rank)
        assert plan.pool_pages == 8
        page = out_cache_loc // ps
        expected = torch.where(page % cp == rank, (page // cp) * ps + out_cache_loc % ps, -1)
        assert torch.equal(plan.owned_cache_write_locs, expected)
        # The rank's block of the history region: its owned history pages, packed from their pool pages.
        mine = [p for p in history_pages if p % cp == rank]
        start, count = plan.gather_blocks[rank]
        assert plan.pool_copy_pages.tolist() == [p // cp for p in mine]
        assert plan.pool_copy_slots.tolist() == list(range(start, start + count)) and count == len(mine)
    # The rank's pool, sized for all 16 page ids, is refused at the history step.
    plan = host_plan(case, 0)
    pipe = LayerPipeline(
        plan, _LoneRank(cp, 0), [rows_kind("kv", [torch.zeros(16 * ps, 8)], plan, layer_ahead=False)], layer_ahead=False
    )
    with pytest.raises(
        CpSharedKvError, match=r"pool of layer 0 is \(16, 32\) pages, expected \[8 \(capacity 16 / cp 2\)"
    ):
        pipe.dense_pages("kv", 0)
    with pytest.raises(CpSharedKvError, match="capacity 15 is not a multiple of cp_size 2"):
        build_plan(
            [list(t) for t in case.page_tables],
            case.prefix_lens,
            case.extend_lens,
            out_cache_loc,
            capacity=15,
            page_size=ps,
            split=build_cp_split("interleave", case.extend_lens, cp, 0),
        )


class _LoneRank:
    """Rank ``cp_rank`` of a CP group whose collectives the test above never reaches."""

    def __init__(self, cp_size: int, cp_rank: int) -> None:
        self.cp_size, self.cp_rank = cp_size, cp_rank

    def all_gather_rows(self, local, out=None):
        raise AssertionError("the history step refuses the pool before any collective")


def test_dense_rounding_is_bounded():
    for slots in range(1, 5000):
        rounded = round_dense_slots(slots)
        assert slots <= rounded <= slots * (1 + MAX_ROUNDING), slots
    assert [round_dense_slots(n) for n in (0, 1, 63, 64, 65, 100, 4097)] == [1, 1, 63, 64, 66, 100, 4224]
    assert host_plan(SHARED_5, 0).num_slots == 4  # 2 history-region + 2 own slots, nothing to round below 64 slots


def test_a_kind_whose_dense_buffers_cannot_serve_the_batch_is_refused():
    """The buffer checks are made once per kind (it serves every batch of its backend); each refusal still names
    the fault, and a batch larger than the buffers is refused on every batch."""
    plan = host_plan(SHARED_5, 0)
    pool, _ = make_pool_and_current(SHARED_5, torch.float32, 2, seed=0)
    kind = rows_kind("kv", [pool], plan, layer_ahead=True)
    LayerPipeline(plan, GROUP, [kind], layer_ahead=True)
    small = dataclasses.replace(kind, buffers=tuple(b[: plan.num_slots - 1] for b in kind.buffers))
    for _ in range(2):
        with pytest.raises(CpSharedKvError, match=rf"kv: dense buffer of {plan.num_slots - 1} pages, the batch needs"):
            LayerPipeline(plan, GROUP, [small], layer_ahead=False)
    with pytest.raises(CpSharedKvError, match="layer-ahead history needs 2 dense buffers"):
        LayerPipeline(plan, GROUP, [dataclasses.replace(kind, buffers=kind.buffers[:1])], layer_ahead=True)
    with pytest.raises(CpSharedKvError, match="the two layer-ahead buffers are one tensor"):
        LayerPipeline(plan, GROUP, [dataclasses.replace(kind, buffers=kind.buffers[:1] * 2)], layer_ahead=True)
    mixed = (kind.buffers[0], kind.buffers[1].to(torch.float64))
    with pytest.raises(CpSharedKvError, match="dense buffers of different page shapes, dtypes or devices"):
        LayerPipeline(plan, GROUP, [dataclasses.replace(kind, buffers=mixed)], layer_ahead=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

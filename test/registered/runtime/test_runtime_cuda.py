"""The runtime on a GPU: byte-equal to the CPU run, no host sync per batch (cp=1) or per layer,
and the layer-ahead prefetch on its side stream.

Sync-freeness is asserted with ``torch.cuda.set_sync_debug_mode("error")`` whenever the ops
dispatch to a GPU kernel backend (the torch reference itself synchronizes by design).
"""

import random
import sys

import pytest
import torch

from sglang_cpkv import ops
from sglang_cpkv.runtime import LayerPipeline, SingleRankGroup, build_cp_split, build_plan, rows_kind
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.runtime.plan import PlanStaging, staging_bytes
from sglang_cpkv.testing.batches import (
    B300_GLM51_CAPACITY,
    B300_GLM51_RESERVATION,
    POISON_BYTE,
    BatchCase,
    RankResult,
    check_against_truth,
    host_plan,
    make_pool_and_current,
    random_case,
    random_topk,
    run_case_on_ranks,
    same_bytes,
    shared_prompt_batch,
)
from sglang_cpkv.testing.ci_register import register_cuda_ci

register_cuda_ci(est_time=60, stage="cpkv", runner_config="1-gpu")

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU suite covers the runtime on CPU)"
)

CASES = [
    BatchCase(4, 16, ((1, 5), (9, 5)), (5, 5), (2, 2)),  # the seed's shared partial page 5
    BatchCase(4, 16, ((3, 5, 8), (3, 9), (11, 12)), (6, 4, 0), (5, 3, 6)),  # aligned sharing + CURRENT_REUSE
] + [random_case(random.Random(s), max_cp=1) for s in range(6)]


@pytest.mark.parametrize("index", range(len(CASES)))
def test_gpu_layers_equal_cpu_without_host_sync(index):
    case = CASES[index]
    device = torch.device("cuda")
    layers = 3
    kv = [make_pool_and_current(case, torch.uint8, 656, seed=10 * index + layer) for layer in range(layers)]
    topk, topk_positions = random_topk(case, 8, seed=index)
    expected = [run_case_on_ranks(case, pool, current, topk)[0] for pool, current in kv]

    pools = [pool.to(device) for pool, _ in kv]
    currents = [current.to(device) for _, current in kv]
    topk_dev = topk.to(device)
    out_cache_loc = torch.tensor(case.out_cache_loc(), dtype=torch.int64).to(device)
    torch.cuda.synchronize()
    no_sync = ops.warm_up(device) != "torch"  # the CUDA probe synchronizes: at warm-up, never in the layers
    guard = torch.cuda.set_sync_debug_mode
    dense_out, remapped_out = [], []
    try:
        if no_sync:
            guard("error")
        plan = build_plan(
            [list(t) for t in case.page_tables],
            case.prefix_lens,
            case.extend_lens,
            out_cache_loc,
            capacity=case.capacity,
            page_size=case.page_size,
            split=build_cp_split("interleave", case.extend_lens, 1, 0),
            checked=False,
        )
        kind = rows_kind("kv", pools, plan, layer_ahead=True, fill_byte=POISON_BYTE)
        pipe = LayerPipeline(plan, SingleRankGroup(), [kind], layer_ahead=True)
        for layer in range(layers):
            # The next layer's history is prefetched on the side stream while this one persists.
            dense = pipe.dense_view("kv", layer, currents[layer])
            remapped_out.append(pipe.remap(topk_dev, plan.local_req_id))
            pipe.persist_owned("kv", layer, currents[layer])
            dense_out.append(dense.clone())
    finally:
        guard(0)
    plan.raise_if_errors("gpu test")
    for layer in range(layers):
        ref = expected[layer]
        rows = torch.tensor(
            [i for i in range(ref.dense.shape[0]) if not bool((ref.dense[i] == POISON_BYTE).all())], dtype=torch.int64
        )
        # Rows the CPU run wrote must match; a buffer reused two layers later may hold stale rows elsewhere.
        assert same_bytes(dense_out[layer].cpu()[rows], ref.dense[rows]), f"layer {layer}: dense view differs from CPU"
        assert torch.equal(remapped_out[layer].cpu(), ref.remapped), f"layer {layer}: remapped top-k differs from CPU"
        # Pool rows: collision-class batches write one pool location from two requests, and the
        # contract leaves that scatter's winner unspecified, so the pool is judged against the truth
        # (any writer of a duplicated location may win), not byte-compared with the CPU run.
        pool_before, current = kv[layer]
        got = RankResult(ref.dense, ref.remapped, ref.local_req_id, ref.current_full, pools[layer].cpu())
        problems = check_against_truth(case, pool_before, current, topk_positions, [got])
        assert not problems, f"layer {layer}: pool after persist: " + "; ".join(problems[:5])


def test_one_pinned_staging_serves_batch_after_batch_without_a_host_sync():
    """The serving hook's staging (one pinned buffer, reused): each batch's plan equals the CPU plan, and a batch's
    staging never overwrites what an earlier batch's copy still has to read."""
    device = torch.device("cuda")
    cases = CASES + [random_case(random.Random(100 + s), max_cp=4) for s in range(8)]
    entries = max(sum(map(len, c.page_tables)) for c in cases)
    staging = PlanStaging(staging_bytes(entries, round_dense_slots(entries)), device)
    assert staging.buffer.is_pinned()
    locs = [torch.tensor(case.out_cache_loc(), dtype=torch.int64).to(device) for case in cases]  # before the guard
    no_sync = ops.warm_up(device) != "torch"
    plans = []
    try:
        if no_sync:
            torch.cuda.set_sync_debug_mode("error")
        for case, out_cache_loc in zip(cases, locs):
            plans.append(
                build_plan(
                    [list(t) for t in case.page_tables],
                    case.prefix_lens,
                    case.extend_lens,
                    out_cache_loc,
                    capacity=case.capacity,
                    page_size=case.page_size,
                    split=build_cp_split(case.effective_strategy, case.extend_lens, case.cp_size, case.cp_size - 1),
                    checked=False,
                    staging=staging,
                )
            )
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for case, plan in zip(cases, plans):
        want = host_plan(case, case.cp_size - 1)
        for name, value in vars(want).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(getattr(plan, name).cpu(), value), (name, case)
        assert torch.equal(plan.inverse.keys.cpu(), want.inverse.keys), case
        assert torch.equal(plan.inverse.slots.cpu(), want.inverse.slots), case


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_the_plan_device_peak_of_the_b300_batch_is_inside_the_batch_plan_part(backend, monkeypatch):
    """What the allocator actually hands out while a batch's plan is built (the inverse's sort scratch, the
    staged entries, every plan tensor), measured, not counted: 1024 requests of 16 new tokens on one cached
    16-page prompt at the widened capacity fit the reservation's batch-plan part."""
    monkeypatch.setenv(ops.BACKEND_ENV, backend)
    device = torch.device("cuda")
    ops.warm_up(device)
    reserved, cp, page = B300_GLM51_RESERVATION, B300_GLM51_RESERVATION.cp_size, B300_GLM51_RESERVATION.page_size
    requests, prompt_pages, new_tokens = 1024, 16, 16
    table, prefix_lens, extend_lens, locs = shared_prompt_batch(requests, prompt_pages, new_tokens, cp, page)
    out_cache_loc = torch.tensor(locs, dtype=torch.int64, device=device)
    kwargs = dict(capacity=B300_GLM51_CAPACITY, page_size=page, checked=False)
    for rank in (0, cp - 1):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        split = build_cp_split("interleave", extend_lens, cp, rank)
        plan = build_plan(table, prefix_lens, extend_lens, out_cache_loc, split=split, **kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        reserved.check_batch(plan.needed_slots * page, plan.num_slots, plan.num_tokens, plan.entries)
        part = reserved.parts()["batch plan"]
        print(
            f"{backend} rank {rank}: plan peak {peak / 2**20:.2f} MiB, held {plan.device_bytes / 2**20:.2f} MiB, "
            f"batch-plan part {part / 2**20:.1f} MiB"
        )
        assert plan.entries == requests * (prompt_pages + 1)
        assert 0 < peak <= part, (peak, part)
        plan.raise_if_errors("b300 plan")
        del plan


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

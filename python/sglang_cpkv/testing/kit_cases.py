"""The batches, routes and CP rank workers the kit test files share (``test/registered/integration/test_cp_shared_kv_kit*.py``).

The kit tests are split by what they cost on the 2-core CI machine: routes and regressions at cp 1
(``test_cp_shared_kv_kit.py``), the sharing patterns and the MTP draft at cp 1 (``..._kit_sharing.py``), and cp 2
over gloo in two files (``..._kit_cp2.py``: every scenario mode off and on; ``..._kit_cp2_alone.py``: each request of
a batch alone, the MTP draft). Each cp 2 file spawns its ranks once (:func:`run_part`) and its tests read what the
ranks saved. The worlds are :class:`~sglang_cpkv.testing.dsa_kit.KitWorld` (upstream's DSA attention kit).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.dsa_kit import (
    PAGE,
    KitRoute,
    KitWorld,
    assert_reads_alone,
    init_cp_rank,
    kit_capacity,
    publish_prefill_cp_server_args,
    request_reads,
    run_kit_ranks,
)
from sglang_cpkv.testing.host_reads import HostReadCounter

PAGED_BF16 = KitRoute("flashmla_sparse")
RAGGED_FP8 = KitRoute("flashmla_sparse", fp8=True)
ROUTES = {
    "flashmla_sparse-bf16-paged": PAGED_BF16,
    "flashmla_sparse-fp8-ragged": RAGGED_FP8,
    "flashmla_kv-fp8-paged": KitRoute("flashmla_kv", fp8=True),
    "triton_sparse_mla-bf16-paged": KitRoute("triton_sparse_mla"),
    "flashmla_sparse-bf16-unfused": KitRoute("flashmla_sparse", fused_topk=False),
}
INDEX_SHARE = (False, True, False)  # layer 1 reuses layer 0's top-k: no index-K pool

# Three requests: A and B share two full prefix pages (a radix hit), A's history ends mid-page and its chunk
# continues that page (CURRENT_REUSE), C has no history; page ids interleave across the pool.
SHARED_SHAPE = (3, 300)
CP = 2


def kit_world(route, case_or_shape, mode_on, **kw):
    max_requests, longest = case_or_shape
    return KitWorld(route, max_requests=max_requests, longest=longest, mode_on=mode_on, device="cpu", **kw)


def assert_same_reads(off, on, what):
    for layer, (a, b) in enumerate(zip(off.kernel, on.kernel)):
        assert a.kernel == b.kernel, (what, layer)
        assert same_bytes(a.q, b.q), f"{what} layer {layer}: query rows differ"
        assert torch.equal(a.valid, b.valid), f"{what} layer {layer}: top-k padding differs"
        assert same_bytes(a.rows, b.rows), f"{what} layer {layer}: the kernel reads other KV rows with the mode on"
        assert int(a.valid.sum()) > 0
    assert off.index_k.keys() == on.index_k.keys()
    for layer in off.index_k:
        for x, y in zip(off.index_k[layer], on.index_k[layer]):
            assert same_bytes(x, y), f"{what} layer {layer}: the indexer reads other index K with the mode on"


# Runs of fresh worlds at cp 1, each computed once per process (:func:`run_case`).
_RUNS: dict = {}


def run_case(route, case, shape, mode_on, **kw):
    """``case``'s run (every layer) in a fresh world with its history written. A fresh world's run is a function of
    these arguments and the process's ``SGLANG_*`` settings, so it is computed once per process and shared by the
    tests that read it (tests only read runs)."""
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("SGLANG")))
    key = (route, case, shape, mode_on, tuple(sorted(kw.items())), settings)
    if key not in _RUNS:
        w = kit_world(route, shape, mode_on, **kw)
        w.write_history(case)
        _RUNS[key] = w.forward(case)
    return _RUNS[key]


def run_pair(route, case, shape, **kw):
    """``[mode off run, mode on run]`` of ``case`` (:func:`run_case`)."""
    return [run_case(route, case, shape, mode_on, **kw) for mode_on in (False, True)]


def run_alone(route, case, r, shape=SHARED_SHAPE, mode_on=True):
    """Request ``r`` of ``case`` alone (:func:`run_case`)."""
    return run_case(route, alone_case(case, r), shape, mode_on)


def shared_prefix_case(cp_size=1):
    capacity = kit_capacity(*SHARED_SHAPE, cp_size)
    return BatchCase(PAGE, capacity, ((4, 9, 2, 7), (4, 9, 5), (11, 3)), (170, 128, 0), (50, 40, 100), cp_size)


def alone_case(case, r):
    return BatchCase(
        PAGE, case.capacity, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],), case.cp_size
    )


def rows_of_request(run, case, r, layer=0):
    start = sum(case.extend_lens[:r])
    mine = [i for i, t in enumerate(run.local_tokens.tolist()) if start <= t < start + case.extend_lens[r]]
    reads = run.kernel[layer]
    return reads.rows[mine], reads.valid[mine]


def sharing_case(cp_size=1):
    """The dense layout's sharing patterns in one batch (testing/batches.sharing_patterns): A and B share pages 4
    and 9 as history only (one shared history slot each); B reads page 2 as history while A's history ends in it
    and A's chunk continues it (a shared page that is A's CURRENT_REUSE page); C reads page 7 as history while A
    writes its current tokens into page 7 (allocator reuse). The last two are collision-class states: upstream's
    own pool path cannot serve them (it writes the chunk into the pool before attention), so each request is
    compared with itself alone."""
    capacity = kit_capacity(*SHARED_SHAPE, cp_size)
    return BatchCase(PAGE, capacity, ((4, 9, 2, 7), (4, 9, 2, 5), (7, 3)), (170, 192, 64), (50, 40, 30), cp_size)


def target_and_draft(route, shape, mode_on, **kw):
    """The two DSA backends of an EAGLE/NextN prefill server: the target's, and its MTP draft's with a pool of its
    own (one layer at start layer 0, as upstream builds a NextN draft's pool) over the same page ids, other weights.
    Upstream's draft extend on a prefill server (``_draft_extend_for_prefill``) is an EXTEND batch of the target's
    requests, lengths and cache locations on the draft's backend, split like the target's under CP; the target's
    pool sizing charges the mode's buffers for both backends (``backends=2``)."""
    from sglang_cpkv.hooks.reservation import publish, published

    target = kit_world(route, shape, mode_on, **kw)
    draft = kit_world(dataclasses.replace(route, skip_topk_layers=(False,)), shape, mode_on, seed=1, **kw)
    if mode_on:
        publish(dataclasses.replace(published(), backends=2))
    return target, draft


def draft_extend(target, draft, case):
    """The target's extend, then the draft's of the same batch: ``(target run, draft run)``."""
    for w in (target, draft):
        w.write_history(case)
    return target.forward(case), draft.forward(case)


# --- cp = 2 over gloo ------------------------------------------------------------------------------------------


def allocator_case(allocator=None):
    """``(case, rotation bases)``: a bs 3 batch whose page tables upstream's ``PageInterleavePoolAllocator`` hands
    out at cp 2 (a fresh one sized as a mode-on KitWorld's, or ``allocator``), through ``alloc_extend`` with the
    rotation bases upstream's allocation passes: a cached two-page prefix prefilled first (a new chain: base None,
    resolved by the allocator), then requests A and B that hit it (the prefix chain's base, page-aligned prefix) and
    C, a new chain. Page ids stay global; each rank's pool holds its owned ones."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    capacity = kit_capacity(*SHARED_SHAPE, CP)
    if allocator is None:
        allocator = PageInterleavePoolAllocator(
            (capacity // CP - 1) * PAGE,
            physical_page_size=PAGE,
            shard_size=CP,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )

    def alloc(prefix_lens, seq_lens, last_loc, bases):
        p, q = torch.tensor(prefix_lens), torch.tensor(seq_lens)
        n = int((q - p).sum())
        return allocator.alloc_extend(p, p, q, q, torch.tensor(last_loc), n, rotation_bases=bases)

    prefix, extend = 2 * PAGE, (150, 90, 100)
    prefix_base = [None]
    prefix_locs = alloc([0], [prefix], [-1], prefix_base)
    shared = tuple((prefix_locs[::PAGE] // PAGE).tolist())
    bases = [prefix_base[0], prefix_base[0], None]
    prefix_lens = (prefix, prefix, 0)
    last = int(prefix_locs[-1])
    locs = alloc(list(prefix_lens), [p + e for p, e in zip(prefix_lens, extend)], [last, last, -1], bases).tolist()
    tables, start = [], 0
    for p, e in zip(prefix_lens, extend):
        new = tuple(dict.fromkeys(loc // PAGE for loc in locs[start : start + e]))  # extends start page-aligned
        tables.append((shared if p else ()) + new)
        start += e
    return BatchCase(PAGE, capacity, tuple(tables), prefix_lens, extend, CP), tuple(bases)


SHARING_CP2_ROUTES = {
    "sharing-paged": PAGED_BF16,
    "sharing-ragged-indexshare": KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE),
    "sharing-unfused": KitRoute("flashmla_sparse", fused_topk=False),
    "sharing-flashmla_kv-fp8": KitRoute("flashmla_kv", fp8=True),
    "sharing-triton_sparse_mla": KitRoute("triton_sparse_mla"),
}

# Each request of these batches is also run alone at cp 2 (mode on): shared-ragged's C has no history beside A's
# and B's radix hit (the RAGGED route's per-request keys).
ALONE_CP2 = (*SHARING_CP2_ROUTES, "shared-ragged")


def cp2_scenarios():
    """``[(name, route, cases, shape)]``: the batches every cp 2 rank runs mode off and on."""
    shared2 = shared_prefix_case(CP)
    # A request with one token: one rank holds none of it and drops it from its metadata (bs_idx).
    dropped = BatchCase(PAGE, shared2.capacity, ((4, 9, 2, 7), (6,), (4, 9, 5)), (170, 0, 128), (50, 1, 40), CP)
    # Chunked continuation: chunk 1 prefills 200 tokens of two requests; chunk 2 reads them as history (persisted
    # by chunk 1, owner-sharded under the mode) and continues mid-page.
    chunk1 = BatchCase(PAGE, shared2.capacity, ((4, 9, 2, 7), (11, 3, 8)), (0, 0), (200, 150), CP)
    chunk2 = BatchCase(PAGE, shared2.capacity, ((4, 9, 2, 7), (11, 3, 8)), (200, 150), (50, 30), CP)
    no_prefix = BatchCase(PAGE, shared2.capacity, ((4, 9), (6,), (11,)), (0, 0, 0), (100, 1, 40), CP)
    index_share = KitRoute("flashmla_sparse", skip_topk_layers=INDEX_SHARE)
    return [
        ("shared-ragged", RAGGED_FP8, [shared2], SHARED_SHAPE),
        ("dropped-paged", PAGED_BF16, [dropped], SHARED_SHAPE),
        (
            "dropped-ragged-indexshare",
            KitRoute("flashmla_sparse", fp8=True, skip_topk_layers=INDEX_SHARE),
            [dropped],
            SHARED_SHAPE,
        ),
        ("chunked-paged-indexshare", index_share, [chunk1, chunk2], SHARED_SHAPE),
        ("ragged-no-prefix-cut", RAGGED_FP8, [no_prefix], SHARED_SHAPE),
        # RAGGED chunk 1 has no prefix: no dense latent view, the owned rows go straight to the pool; chunk 2
        # reads them back as history through the view.
        ("chunked-ragged", RAGGED_FP8, [chunk1, chunk2], SHARED_SHAPE),
        # Page tables of upstream's page-interleave allocator (bs 3, a shared prefix of two requests).
        ("allocator-shared-prefix-paged", PAGED_BF16, [allocator_case()[0]], SHARED_SHAPE),
        # The sharing patterns of the dense layout, collision class: compared with each request alone.
        *((name, route, [sharing_case(CP)], SHARED_SHAPE) for name, route in SHARING_CP2_ROUTES.items()),
    ]


def scenario_case(name, index):
    return next(cases for n, _, cases, _ in cp2_scenarios() if n == name)[index]


def run_part(part: str, directory) -> list:
    """Both ranks' results of one part of the cp 2 runs (:func:`_gloo_rank`), in processes over gloo."""
    return run_kit_ranks(functools.partial(_gloo_rank, part=part), CP, directory)


def _gloo_rank(rank, model_dir, init_method, out_dir, part):
    """One CP rank: upstream's distributed init and (patched) model-parallel groups, then its part of the runs;
    writes what each forward read. ``part``: ``"scenarios"`` (every scenario mode off and on, with what the mode
    held and read on the host) or ``"alone"`` (the batches of :data:`ALONE_CP2` mode on, each of their requests
    alone, and an MTP draft beside its target)."""
    torch.set_num_threads(1)
    from sglang.srt.distributed import parallel_state

    from sglang_cpkv.hooks import exchange_group

    results = {}
    init_cp_rank(rank, CP, "cpu", init_method, model_dir)
    attn_cp = parallel_state.get_attn_cp_group()
    group = exchange_group.exchange_group()
    results["group"] = (group.cp_size, group.cp_rank, group.group is not attn_cp.device_group)
    if part == "scenarios":
        _run_scenarios(rank, model_dir, results)
    elif part == "alone":
        _run_alone(rank, model_dir, results)
    else:
        raise ValueError(part)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _cp2_world(route, shape, mode_on, rank):
    return KitWorld(
        route, max_requests=shape[0], longest=shape[1], mode_on=mode_on, device="cpu", cp_size=CP, cp_rank=rank
    )


def _run_scenarios(rank, model_dir, results):
    from sglang_cpkv.hooks import dsa_batch
    from sglang_cpkv.hooks.reservation import published

    for name, route, cases, shape in cp2_scenarios():
        for mode_on in (False, True):
            publish_prefill_cp_server_args(model_dir, CP, mode_on=mode_on)
            w = _cp2_world(route, shape, mode_on, rank)
            results[("pool pages", name, mode_on)] = w.pool.kv_buffer[0].shape[0] // PAGE
            if mode_on and name == "allocator-shared-prefix-paged":
                # The world's own allocator (built by the mode's hook) hands out the same page tables.
                results[("allocator", name)] = (type(w.allocator).__name__, allocator_case(w.allocator))
            runs = []
            for i, case in enumerate(cases):
                if i == 0:
                    w.write_history(case)
                with HostReadCounter() as reads:
                    runs.append(w.forward(case))
                results[("host reads", name, mode_on, i)] = dict(reads.counts)
                state = getattr(w.backend, dsa_batch.STATE_ATTR, None)
                results[("latent bytes", name, mode_on, i)] = 0 if state is None else state.buffers.held_bytes("latent")
                if mode_on:
                    reserved = published()
                    plan_part = reserved.backends * reserved.parts()["batch plan"]
                    results[("held bytes", name, i)] = (state.buffers.held_bytes(""), reserved.total_bytes - plan_part)
                    plan = state.batch.plan
                    staged = plan.entries * (4 + 4 + 8)
                    results[("plan bytes", name, i)] = (plan.device_bytes + staged, plan_part)
            seed = _mtp_seed(w) if name == "ragged-no-prefix-cut" else None
            results[(name, mode_on)] = (runs, seed)


def _run_alone(rank, model_dir, results):
    for name, route, cases, shape in cp2_scenarios():
        if name not in ALONE_CP2:
            continue
        publish_prefill_cp_server_args(model_dir, CP, mode_on=True)
        w = _cp2_world(route, shape, True, rank)
        w.write_history(cases[0])
        results[(name, True)] = w.forward(cases[0])
        for r in range(cases[0].num_requests):
            solo_case = alone_case(cases[0], r)
            solo = _cp2_world(route, shape, True, rank)
            solo.write_history(solo_case)
            results[("alone", name, r)] = (solo.forward(solo_case), solo_case)
    # An MTP draft's extend beside its target's: two backends, one exchange group.
    for mode_on in (False, True):
        publish_prefill_cp_server_args(model_dir, CP, mode_on=mode_on)
        worlds = target_and_draft(RAGGED_FP8, SHARED_SHAPE, mode_on, cp_size=CP, cp_rank=rank)
        results[("mtp-draft", mode_on)] = draft_extend(*worlds, shared_prefix_case(CP))
    sharing = sharing_case(CP)
    for r, case in [(None, sharing), *((r, alone_case(sharing, r)) for r in range(sharing.num_requests))]:
        worlds = target_and_draft(RAGGED_FP8, SHARED_SHAPE, True, cp_size=CP, cp_rank=rank)
        results[("mtp-draft sharing", r)] = draft_extend(*worlds, case)[1]


def _mtp_seed(w):
    """The MTP IndexShare seed export of the last forward (a fused RAGGED top-k of every local row)."""
    backend = w.backend
    metadata = backend.forward_metadata
    rows = metadata.topk_indices_offset.shape[0]
    seq = metadata.dsa_cache_seqlens_int32.to(torch.int64)[:rows]
    positions = torch.arange(8).expand(rows, 8)
    topk = torch.where(positions < seq[:, None], positions + metadata.topk_indices_offset[:, None], -1).to(torch.int32)
    with w.up["context"](backend):
        return backend.prepare_mtp_seed_indices(topk, w.up["extend"]).clone()


def assert_cp2_reads_alone(gloo_results, name, case, num_layers):
    """Scenario ``name``'s batch at cp 2 (both ranks' query rows together) reads, at every position of every request
    and every layer, what that request reads alone at cp 2 (mode on): both from the ``"alone"`` part's results."""
    for layer in range(num_layers):
        batch = request_reads([(results[(name, True)], case) for results in gloo_results], layer)
        solo = {}
        for r in range(case.num_requests):
            runs = [results[("alone", name, r)] for results in gloo_results]
            solo.update({(r, p): v for (_, p), v in request_reads(runs, layer).items()})
        assert_reads_alone(batch, solo, f"{name} layer {layer}")

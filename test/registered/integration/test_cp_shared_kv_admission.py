"""Requests are admitted against ``--cp-shared-kv-max-batch-tokens``: upstream's prefill adder with the patched hook (CPU).

Each case resolves a real ``ServerArgs`` for the local GLM-5 DSA config as a P/D prefill server with CP 8 and the
mode on (off for the baseline), publishes it, builds the token allocator upstream's configurator builds for it
(with the mode under CP the page-interleave allocator of ``hooks/page_ids.py``; off, upstream's plain paged one, page
64) over a small MLA pool on CPU, upstream's default tree cache (``UnifiedRadixCache``, full-attention component) and
upstream's ``PrefillAdder`` with the arguments upstream's scheduler gives it, and
drives it as ``Scheduler._get_new_batch_prefill_raw`` does (``init_next_round_input`` then ``add_one_req`` for each
waiting request until one is not ``CONTINUE``). The reservation the pool-sizing hook would publish at start-up is
published directly with a small limit. Checked, on the adder's own results (``can_run_list``, ``extend_end``, the
returned ``AddReqResult``), against ``sglang_cpkv.hooks.reservation.defers_request``:

* a limit of two page-rounded 100-token requests (2 x 128) admits two of three; the third gets ``OTHER`` and stays
  out; one token less than 2 x 128 admits only the first (the rounding is what is counted);
* the first request of a batch is admitted even when it alone is past the limit; the next one waits;
* with no reservation published (the mode off) the same three requests are all admitted (upstream's behaviour);
* under a chunk budget smaller than a long prompt, the long request counts only its chunk (the batch's remaining
  chunk budget, page-rounded), not its whole prompt: it is admitted as the batch's chunked request;
* with the radix cache off, a chunked request's continuation (upstream's checkpoint, ``add_chunked_req``) counts its
  history as its own pages, which no radix node holds;
* requests on one cached prompt (a radix hit) count the prompt once, as the plan's shared history slots hold it: the
  issue's 16 requests on a 60K-token prompt are admitted whole under the deployment's default limit;
* the running tally of a pass follows a radix node that a later request's match splits, as a walk of the whole batch
  does, and the hook's time per request stays flat from 256 to 1024 requests (shared and distinct prompts).
"""

from __future__ import annotations

import sys
from array import array
from pathlib import Path

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.upstream_import import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.runtime_context import get_schedule  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from sglang_cpkv.capacity.upstream import prefill_cp_server  # noqa: E402
from sglang_cpkv.hooks import reservation as reservation_hooks  # noqa: E402
from sglang_cpkv.hooks import state  # noqa: E402
from sglang_cpkv.runtime.reservation import Reservation, default_max_batch_tokens  # noqa: E402
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: context per test)
from sglang_cpkv.testing.prefill_admission import AdmissionWorld  # noqa: E402

GLM5_DIR = Path(__file__).parents[1] / "upstream" / "fixtures" / "glm5_dsa"
PAGE = 64
CHUNK = 8192
POOL_TOKENS = 64 * PAGE  # a small real pool: 64 pages
MAX_CONTEXT = 4096
VOCAB = 154880
SERVER = prefill_cp_server(str(GLM5_DIR), chunked_prefill_size=CHUNK)


def World(monkeypatch, mode_on: bool, *, pool_tokens=POOL_TOKENS, rows=8, max_context=MAX_CONTEXT, **server):
    """The server's scheduler-side objects, the mode's reservation at the default limit for ``max_context``."""
    return AdmissionWorld(
        monkeypatch,
        {**SERVER, **server},
        mode_on=mode_on,
        pool_tokens=pool_tokens,
        rows=rows,
        max_context=max_context,
        reservation=lambda: limit(default_max_batch_tokens(max_context, get_schedule().chunked_prefill_size, PAGE)),
    )


def make_req(rid: str, num_tokens: int, first_token: int) -> Req:
    """A real request of ``num_tokens`` distinct prompt tokens (no shared prefix with the others)."""
    sampling_params = SamplingParams(max_new_tokens=16, temperature=0.0)
    sampling_params.normalize(None)
    sampling_params.verify(VOCAB)
    return Req(rid, "", array("q", range(first_token, first_token + num_tokens)), sampling_params)


def three_requests(lengths=(100, 100, 100)) -> list[Req]:
    return [make_req(f"r{i}", n, 1000 * (i + 1)) for i, n in enumerate(lengths)]


def limit(max_batch_tokens: int, chunk_tokens: int = CHUNK) -> Reservation:
    return Reservation(
        max_batch_tokens=max_batch_tokens,
        chunk_tokens=chunk_tokens,
        page_size=PAGE,
        cp_size=8,
        layer_ahead=True,
        latent_token_bytes=656,
        index_k_token_bytes=132,
    )


def publish_limit(max_batch_tokens: int, chunk_tokens: int = CHUNK) -> Reservation:
    return reservation_hooks.publish(limit(max_batch_tokens, chunk_tokens))


def walked_dense_pages(tree_cache, requests, page_size=PAGE) -> int:
    """The dense pages of ``(request, end)`` pairs by a walk of every request's radix path (the figure admission keeps
    as a running tally): each distinct node's pages once, a history off the tree as the request's own, and each
    request's own pages from its first page that takes current tokens."""
    shared, region, own = {}, 0, 0
    for req, end in requests:
        node, path = req.last_node, []
        if req.prefix_len and not hasattr(node, "parent"):
            node = tree_cache.tree_core.node_by_id(node)
        while req.prefix_len and node is not None and node.parent is not None and node.key is not None:
            path.append(node)
            node = node.parent
        if sum(len(n.key) for n in path) != req.prefix_len:
            region += -(-req.prefix_len // page_size)
        else:
            shared.update((id(n), len(n.key)) for n in path)
        own += -(-end // page_size) - req.prefix_len // page_size
    return region + sum(-(-tokens // page_size) for tokens in shared.values()) + own


def rids(adder: PrefillAdder) -> list[str]:
    return [req.rid for req in adder.can_run_list]


@pytest.fixture(autouse=True)
def no_reservation():
    with state.scoped():
        yield


def test_limit_of_two_page_rounded_requests_admits_two_of_three(monkeypatch):
    world = World(monkeypatch, mode_on=True)
    publish_limit(2 * 128)  # 100-token prompts occupy 128 tokens (two pages) of dense view each
    waiting = three_requests()
    adder, results = world.prefill_pass(waiting)
    assert rids(adder) == ["r0", "r1"]
    assert results == {"r0": AddReqResult.CONTINUE, "r1": AddReqResult.CONTINUE, "r2": AddReqResult.OTHER}
    assert [req.extend_end for req in adder.can_run_list] == [100, 100]
    assert waiting[2].extend_end is None  # nothing was reserved for the deferred request
    assert adder.new_chunked_req is None


def test_the_limit_counts_page_rounded_tokens(monkeypatch):
    # 2 x 100 raw tokens fit 255, 2 x 128 page-rounded do not: the second request already waits
    world = World(monkeypatch, mode_on=True)
    publish_limit(2 * 128 - 1)
    adder, results = world.prefill_pass(three_requests())
    assert rids(adder) == ["r0"]
    assert results == {"r0": AddReqResult.CONTINUE, "r1": AddReqResult.OTHER}


def test_first_request_is_admitted_past_the_limit(monkeypatch):
    world = World(monkeypatch, mode_on=True)
    publish_limit(128)
    adder, results = world.prefill_pass(three_requests(lengths=(1000, 100, 100)))
    assert rids(adder) == ["r0"]  # 1024 tokens of dense view, alone past 128: never deferred
    assert adder.can_run_list[0].extend_end == 1000
    assert results == {"r0": AddReqResult.CONTINUE, "r1": AddReqResult.OTHER}


def test_without_a_reservation_upstream_admits_all_three(monkeypatch):
    world = World(monkeypatch, mode_on=False)
    assert state.current().config is None
    adder, results = world.prefill_pass(three_requests())
    assert rids(adder) == ["r0", "r1", "r2"]
    assert set(results.values()) == {AddReqResult.CONTINUE}
    assert [req.extend_end for req in adder.can_run_list] == [100, 100, 100]


def test_a_chunked_request_counts_only_its_chunk(monkeypatch):
    chunk = 256
    world = World(monkeypatch, mode_on=True, chunked_prefill_size=chunk)
    assert get_schedule().chunked_prefill_size == chunk
    # after r0 (100 tokens, charged 128 of the chunk) r1 has 128 chunk tokens left: 128 + 128 of dense view,
    # where its whole prompt would take 128 + 1024
    publish_limit(128 + 128, chunk_tokens=chunk)
    waiting = three_requests(lengths=(100, 1000, 100))
    adder, results = world.prefill_pass(waiting)
    assert rids(adder) == ["r0", "r1"]
    assert adder.new_chunked_req is waiting[1]
    assert waiting[1].extend_end == 128  # upstream's chunk of the long prompt
    # admitted, yet OTHER: add_one_req returns the budget left for the next candidate, and the chunk is spent
    assert results["r1"] == AddReqResult.OTHER
    assert adder.rem_chunk_tokens == 0
    assert "r2" not in results

    # one token less: the chunk part alone no longer fits next to r0, so the long request waits
    state.reset()
    world = World(monkeypatch, mode_on=True, chunked_prefill_size=chunk)
    publish_limit(128 + 128 - 1, chunk_tokens=chunk)
    waiting = three_requests(lengths=(100, 1000, 100))
    adder, results = world.prefill_pass(waiting)
    assert rids(adder) == ["r0"]
    assert results == {"r0": AddReqResult.CONTINUE, "r1": AddReqResult.OTHER}
    assert adder.new_chunked_req is None


@pytest.mark.parametrize("limit_pages, admitted", [(16, ["r0", "r1"]), (15, ["r0"])])
def test_a_chunked_continuation_without_a_radix_cache_counts_its_history(monkeypatch, limit_pages, admitted):
    """The radix cache off, a P/D prefill server's chunked request: pass 1 prefills r0's first 512 tokens (a chunk),
    and upstream's checkpoint (``checkpoint_kv_cache``, which a disabled tree does not record) leaves r0 a history
    no radix node holds. Pass 2 continues it as the scheduler does (``add_chunked_req``): its 8 history pages count as
    its own, with its 7 pages of new tokens, so r1 (one page) fits a limit of 16 pages and waits at 15. Counting the
    history from the (empty) radix path instead would admit r1 at 15 pages."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    chunk = 512
    world = World(monkeypatch, mode_on=True, chunked_prefill_size=chunk, disable_radix_cache=True)
    assert world.tree_cache.disable
    publish_limit(limit_pages * PAGE, chunk_tokens=chunk)
    r0, r1 = make_req("r0", 960, 1000), make_req("r1", 50, 5000)
    adder, _ = world.prefill_pass([r0])
    assert adder.new_chunked_req is r0 and r0.extend_end == chunk
    checkpoint_kv_cache(r0, world.tree_cache)
    assert r0.prefix_len == chunk

    adder = world.adder([r1])
    r0.init_next_round_input()
    assert adder.add_chunked_req(r0) is None  # its last chunk: 448 tokens, 64 of the chunk budget left
    r1.init_next_round_input(world.tree_cache)
    result = adder.add_one_req(r1, has_chunked_req=True, truncation_align_size=None)
    assert rids(adder) == admitted, result
    tally = reservation_hooks.admission_tally(adder)
    assert tally.pages == walked_dense_pages(world.tree_cache, [(r, r.extend_end) for r in adder.can_run_list])
    assert tally.pages == 8 + 7 + (len(admitted) - 1)


def _cache_prompt(world: World, tokens: list[int]) -> None:
    """A prompt already prefilled and cached (page-aligned): its pages allocated as one chain of the page-interleave
    allocator (owner classes from 0) and inserted in the radix tree with that rotation base."""
    locs = world.allocator.alloc_cyclic(0, len(tokens))
    world.tree_cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=locs, rotation_base=0))


def _shared_prompt_requests(prompt: list[int], count: int, suffix: int) -> list[Req]:
    sampling_params = SamplingParams(max_new_tokens=16, temperature=0.0)
    sampling_params.normalize(None)
    sampling_params.verify(VOCAB)
    return [
        Req(
            f"s{i}",
            "",
            array("q", prompt + list(range(50_000 + 1000 * i, 50_000 + 1000 * i + suffix))),
            sampling_params,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize(("limit", "admitted"), [((3 + 4) * PAGE, 4), ((3 + 4) * PAGE - 1, 3)])
def test_a_shared_prompt_counts_once(monkeypatch, limit, admitted):
    """Four requests on one cached 3-page prompt, one page of their own each: the batch's dense view holds the prompt
    once (shared history slots) and four own pages, 7 pages, where one copy per request would be 16. A limit of 7
    pages admits all four, one token less three (the fourth would make 3 + 4 pages)."""
    world = World(monkeypatch, mode_on=True)
    prompt = list(range(7000, 7000 + 3 * PAGE))
    _cache_prompt(world, prompt)
    publish_limit(limit)
    waiting = _shared_prompt_requests(prompt, 4, suffix=PAGE)
    adder, results = world.prefill_pass(waiting)
    assert [req.prefix_len for req in waiting[:admitted]] == [3 * PAGE] * admitted  # the radix hit
    assert rids(adder) == [f"s{i}" for i in range(admitted)]
    assert list(results.values())[admitted:] == ([AddReqResult.OTHER] if admitted < 4 else [])
    assert walked_dense_pages(world.tree_cache, [(r, r.extend_end) for r in adder.can_run_list]) == 3 + admitted


@pytest.mark.parametrize("limit_pages, waits", [(1 + 4 + 1, False), (1 + 4, True)])
def test_a_hicache_host_hit_counts_as_pages_to_load(monkeypatch, limit_pages, waits):
    """A HiCache host hit (``host_hit_length``, as upstream's match sets it beside the device prefix) is loaded back into
    fresh page ids before the request's chunk starts: the candidate's dense view counts those pages as its own, before
    the chunk budget. A chunk of 2 pages: r0 (one page) is admitted, leaving one page of chunk; s0 has no device prefix
    and a host hit of 4 pages, then its chunk of one page: 1 + 4 + 1 pages (without the hit, 1 + 1)."""
    world = World(monkeypatch, mode_on=True, chunked_prefill_size=2 * PAGE)
    publish_limit(limit_pages * PAGE, chunk_tokens=2 * PAGE)
    first, candidate = make_req("r0", PAGE, 1000), make_req("s0", 8 * PAGE, 9000)
    adder = world.adder([first, candidate])
    for req in (first, candidate):
        req.init_next_round_input(world.tree_cache)
    assert adder.add_one_req(first, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
    assert adder.rem_chunk_tokens == PAGE and candidate.prefix_len == 0
    candidate.host_hit_length = 4 * PAGE
    assert reservation_hooks.defers_request(adder, candidate) is waits


def test_sixteen_requests_on_a_60k_prompt_are_admitted_whole_under_the_default_limit(monkeypatch):
    """The issue's batch: 16 requests of 1K new tokens each on one cached 60K-token prompt, under the default limit
    of the deployment's server (context 202,752, chunk 65,536: 332,800 tokens). Held once, the prompt and the own
    pages are 960 + 16 x 16 pages (77,824 tokens); one copy per request would be 16 x 61,440 + 16 x 1,024 tokens,
    past the limit after five requests."""
    chunk, prompt_tokens, suffix, count = 65536, 60 * 1024, 1024, 16
    world = World(
        monkeypatch,
        mode_on=True,
        pool_tokens=16 * 1024,  # x 8 page ids per CP rank's pool page: 131,072 token locations
        rows=count,
        max_context=prompt_tokens + 2 * suffix,
        chunked_prefill_size=chunk,
    )
    limit = default_max_batch_tokens(202752, chunk, PAGE)
    assert limit == 332800
    publish_limit(limit, chunk_tokens=chunk)
    prompt = list(range(7000, 7000 + prompt_tokens))
    _cache_prompt(world, prompt)
    waiting = _shared_prompt_requests(prompt, count, suffix=suffix)
    adder, results = world.prefill_pass(waiting)
    assert rids(adder) == [f"s{i}" for i in range(count)]
    # The last one is admitted, yet OTHER: its 1K tokens spend upstream's input budget (16 x 1024 = 16384).
    assert list(results.values()) == [AddReqResult.CONTINUE] * (count - 1) + [AddReqResult.OTHER]
    assert adder.rem_input_tokens == 0
    assert all(req.prefix_len == prompt_tokens for req in waiting)
    batch = [(r, r.extend_end) for r in adder.can_run_list]
    assert walked_dense_pages(world.tree_cache, batch) == 960 + count * 16
    assert sum(-(-end // PAGE) for _, end in batch) * PAGE > limit  # one view per request would not fit


def test_page_table_entries_past_the_plan_bound_wait(monkeypatch):
    """100 requests of one page of their own on one cached 512-page prompt, limit 45,000 tokens: the dense view
    (the prompt once, 612 pages, 39,168 tokens) fits, but each request's page table has 513 entries and the
    reservation bounds a batch's plan at as many entries as the limit has tokens: 87 requests are admitted
    (87 x 513 = 44,631), the 88th waits (45,144)."""
    count, prompt_pages, limit = 100, 512, 45_000
    world = World(
        monkeypatch,
        mode_on=True,
        pool_tokens=(prompt_pages + 16 * count) * PAGE // 8,  # x 8 page ids per pool page
        rows=count,
        max_context=(prompt_pages + 2) * PAGE,
        max_running_requests=count,
        max_prefill_tokens=count * 2 * PAGE,
        chunked_prefill_size=count * 2 * PAGE,
    )
    reserved = publish_limit(limit, chunk_tokens=count * 2 * PAGE)
    assert reserved.max_batch_entries == limit
    prompt = list(range(7000, 7000 + prompt_pages * PAGE))
    _cache_prompt(world, prompt)
    waiting = _shared_prompt_requests(prompt, count, suffix=PAGE)
    adder, _ = world.prefill_pass(waiting)
    admitted = limit // (prompt_pages + 1)
    assert rids(adder) == [f"s{i}" for i in range(admitted)]
    batch = [(r, r.extend_end) for r in adder.can_run_list]
    assert walked_dense_pages(world.tree_cache, batch) * PAGE <= limit  # the view alone would admit more
    assert (prompt_pages + count) * PAGE <= limit
    assert sum(-(-end // PAGE) for _, end in batch) == admitted * (prompt_pages + 1)


def test_the_tally_follows_a_node_split_mid_pass_as_a_walk_of_the_batch_does(monkeypatch):
    """A and B hit a cached 4-page prompt, one radix node, counted as such when B is the candidate; C's match splits
    that node (C shares only the first 2 pages): the node keeps the last 2 pages and a new parent takes the first 2.
    Before every candidate the running tally equals a walk of the whole batch (4 prompt pages once, not 4 + 2), and the
    limit at exactly that figure admits all three."""
    prompt = list(range(7000, 7000 + 4 * PAGE))
    head = prompt[: 2 * PAGE]

    def requests():
        sampling_params = SamplingParams(max_new_tokens=16, temperature=0.0)
        sampling_params.normalize(None)
        sampling_params.verify(VOCAB)
        prompts = [prompt + list(range(60_000, 60_000 + PAGE)), prompt + list(range(61_000, 61_000 + PAGE))]
        prompts.append(head + list(range(62_000, 62_000 + PAGE)))
        return [Req(f"q{i}", "", array("q", tokens), sampling_params) for i, tokens in enumerate(prompts)]

    batch_pages = 4 + 3  # the prompt's 4 pages once, and one page of its own for each of the three
    for limit, admitted in ((batch_pages * PAGE, 3), (batch_pages * PAGE - 1, 2)):
        state.reset()
        world = World(monkeypatch, mode_on=True)
        _cache_prompt(world, prompt)
        publish_limit(limit)
        waiting = requests()
        adder = world.adder(waiting)
        node = None
        for req in waiting:
            req.init_next_round_input(world.tree_cache)
            if req.rid == "q0":
                node = world.tree_cache.tree_core.node_by_id(req.last_node)
                assert len(node.key) == 4 * PAGE  # one node before the split
            if adder.can_run_list:
                batch = [(r, r.extend_end) for r in adder.can_run_list] + [(req, len(req.full_untruncated_fill_ids))]
                walk = walked_dense_pages(world.tree_cache, batch)
                assert reservation_hooks.admission_tally(adder).with_candidate(req, batch[-1][1]) == walk
            result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            if result != AddReqResult.CONTINUE:
                break
        assert len(node.key) == 2 * PAGE and node.parent.key is not None  # q2's match split it below a new parent
        assert rids(adder) == [f"q{i}" for i in range(admitted)]


@pytest.mark.parametrize("shared", [True, False], ids=["one-shared-prompt", "distinct-prompts"])
def test_admission_hook_time_per_request_is_flat_in_the_batch(monkeypatch, shared):
    """The hook's time per admitted request at n = 256 and n = 1024 requests of 16 new tokens (on one cached 16-page
    prompt, or each on a cached 2-page prompt of its own): flat, where re-walking every admitted path per candidate
    grew with n (5.2 s of hook time at n = 1024 on an 8-node shared path). Timed around the real hook, per call."""
    import gc
    import statistics
    import time

    per_request = {}
    for n in (256, 1024):
        state.reset()
        own_prompt = 0 if shared else 2 * PAGE
        world = World(
            monkeypatch,
            mode_on=True,
            pool_tokens=(16 + n * 32) * PAGE // 8 + 8 * PAGE,  # x 8 page ids per pool page; cp pages reserved per chain
            rows=n,
            max_context=16 * PAGE + 2 * PAGE + 64,
            max_running_requests=n,
            max_prefill_tokens=n * 128,
            chunked_prefill_size=n * 128,
        )
        publish_limit(10**9, chunk_tokens=n * 128)
        sampling_params = SamplingParams(max_new_tokens=16, temperature=0.0)
        sampling_params.normalize(None)
        sampling_params.verify(VOCAB)
        if shared:
            prompt = list(range(7000, 7000 + 16 * PAGE))
            _cache_prompt(world, prompt)
            prompts = [prompt + list(range(100_000 + 16 * i, 100_000 + 16 * i + 16)) for i in range(n)]
        else:
            prompts = []
            for i in range(n):
                own = list(range(200_000 + own_prompt * i, 200_000 + own_prompt * (i + 1)))
                _cache_prompt(world, own)
                prompts.append(own + list(range(900_000 + 16 * i, 900_000 + 16 * i + 16)))
        waiting = [Req(f"t{i}", "", array("q", tokens), sampling_params) for i, tokens in enumerate(prompts)]
        calls = []
        hook = reservation_hooks.defers_request

        def timed(adder, req, hook=hook, calls=calls):
            start = time.perf_counter()
            try:
                return hook(adder, req)
            finally:
                calls.append(time.perf_counter() - start)

        monkeypatch.setattr(reservation_hooks, "defers_request", timed)
        # The median call, with the collector off: a shared 2-core runner's stalls and a gen-2 collection over the
        # larger heap land on a few calls, a re-walk's growth lands on every call (its median grows with n).
        gc.disable()
        try:
            adder, _ = world.prefill_pass(waiting)
        finally:
            gc.enable()
        assert len(adder.can_run_list) == n
        per_request[n] = statistics.median(calls)
        print(
            f"{'shared' if shared else 'distinct'} n={n}: {sum(calls) * 1e3:.1f} ms of hook, "
            f"median {per_request[n] * 1e6:.1f} us/request"
        )
        monkeypatch.setattr(reservation_hooks, "defers_request", hook)
    assert per_request[1024] < 2.5 * per_request[256], per_request


def test_an_ignore_eos_chunk_ends_on_a_page_with_the_radix_cache_off(monkeypatch):
    """The radix cache off, an ``ignore_eos`` request longer than a chunk of 200 tokens (not a page multiple): upstream's
    ``add_one_req`` sends it down ``add_one_req_ignore_eos``, which cut the first chunk at 200, so the continuation
    started mid-page and the mode's page-interleave allocator asserted in ``alloc_extend`` (a prefill server crash,
    found by the soak). With ``patches/upstream-fixes/end-ignore-eos-chunks-on-a-page.patch`` the chunk ends on a page
    and both chunks allocate."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    chunk = 200
    world = World(monkeypatch, mode_on=True, chunked_prefill_size=chunk, disable_radix_cache=True)
    assert world.tree_cache.disable and world.allocator.shard_size == 8
    sampling_params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    sampling_params.normalize(None)
    sampling_params.verify(VOCAB)
    req = Req("r0", "", array("q", range(1000, 1500)), sampling_params)
    adder, results = world.prefill_pass([req])
    assert adder.new_chunked_req is req and results == {"r0": AddReqResult.CONTINUE}
    assert req.extend_end == 192  # three pages of the 200-token chunk budget
    for prefix, end in ((0, req.extend_end), (req.extend_end, 500)):
        locs = world.allocator.alloc_extend(
            prefix_lens=torch.tensor([prefix]),
            prefix_lens_cpu=torch.tensor([prefix]),
            seq_lens=torch.tensor([end]),
            seq_lens_cpu=torch.tensor([end]),
            last_loc=torch.tensor([-1]),
            extend_num_tokens=end - prefix,
            rotation_bases=[0],
        )
        assert locs is not None and locs.numel() == end - prefix
        if prefix == 0:
            checkpoint_kv_cache(req, world.tree_cache)
            assert req.prefix_len == 192


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

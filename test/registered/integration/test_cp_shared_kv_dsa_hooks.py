"""The DSA extend hooks on upstream's real objects (CPU): a bs>1 batch sharing prefix pages under cp=2.

Upstream objects: ``ReqToTokenPool`` and ``MLATokenToKVPool`` (``device="cpu"``; its writer is a
Triton kernel, run by the interpreter), the interleave CP strategy (``build_metadata``,
``pad_logical_token_to_physical``, ``shard_per_request``). The two CP ranks run in one process in
lockstep; the all-gather of owned history pages is a concatenation of both ranks' packs (the
collective itself is tested with gloo in the runtime's tests).

The batch (page size 64, 161 current tokens, so both ranks carry a padding row):

* requests 0 and 1 share history pages 1 and 2 (page-aligned prefix sharing, reachable in 0.5.23);
* request 2's history ends mid-page (page 7), its current tokens continue that page
  (CURRENT_REUSE) and then go to page 2 - a page id another request of the batch reads as
  history (reachable only with an allocator that reuses a page id across requests in one batch:
  the contract's second class).

Checked, with ``SGLANG_CPKV_CHECKED=1`` (the plan's invariants raise on violation):

* each rank's dense view holds, for every request, exactly its own history and its own current
  KV (the contract's truth), read through the remapped page table of upstream's CP cut;
* each rank persists exactly the current rows of its owned pages;
* with the mode off the hooks hand back upstream's own values.
"""

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="cpkv-cpu")

CP = 2
PAGE = 64
CAPACITY = 12
KV_LORA, ROPE = 8, 4
PREFIX = [128, 128, 100]
EXTEND = [40, 71, 50]
PAGES = [[1, 2, 3], [1, 2, 4, 5], [6, 7, 2]]
REQ_POOL_INDICES = [3, 1, 2]


@pytest.fixture(scope="module")
def up():
    from sglang_cpkv.testing.upstream_env import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.layers.cp.base import get_cp_strategy, init_cp_strategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_size=CP, attn_cp_rank=0)
    init_cp_strategy(enable_prefill_cp=True, cp_size=CP, cp_strategy="interleave")
    return SimpleNamespace(
        strategy=get_cp_strategy(), pad=pad_logical_token_to_physical, pool_cls=MLATokenToKVPool,
        req_pool_cls=ReqToTokenPool, parallel=get_parallel,
    )


def _loc(r, pos):
    return PAGES[r][pos // PAGE] * PAGE + pos % PAGE


def _req_to_token(up):
    req_pool = up.req_pool_cls(size=4, max_context_len=4 * PAGE, device="cpu", enable_memory_saver=False)
    for r, row in enumerate(REQ_POOL_INDICES):
        seq = PREFIX[r] + EXTEND[r]
        req_pool.req_to_token[row, :seq] = torch.tensor([_loc(r, p) for p in range(seq)], dtype=torch.int32)
    return req_pool.req_to_token


def _out_cache_loc():
    return torch.tensor([_loc(r, p) for r in range(3) for p in range(PREFIX[r], PREFIX[r] + EXTEND[r])], dtype=torch.int64)


def _pool(up):
    return up.pool_cls(
        size=(CAPACITY - 1) * PAGE, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE,
        layer_num=1, device="cpu", enable_memory_saver=False, use_dsa=True,
    )


class PrecomputedAllGather:
    """Every rank's contribution to one all-gather, known up front (ranks run in lockstep here)."""

    def __init__(self, contributions, rank):
        self.contributions, self.cp_rank, self.cp_size = contributions, rank, len(contributions)

    def all_gather_rows(self, local):
        assert torch.equal(local, self.contributions[self.cp_rank])
        return torch.cat(self.contributions)


@pytest.fixture(scope="module")
def batch(up):
    """Both ranks after one layer: dense views, pools, plans, the truth."""
    from sglang_cpkv.integration import dsa_hooks
    from sglang_cpkv.runtime.layer import pack_owned_history

    g = torch.Generator().manual_seed(1)
    history_rows = torch.randn(CAPACITY * PAGE, 1, KV_LORA + ROPE, generator=g).to(torch.bfloat16)
    n = sum(EXTEND)
    k = torch.randn(n, 1, KV_LORA, generator=g).to(torch.bfloat16)
    k_rope = torch.randn(n, 1, ROPE, generator=g).to(torch.bfloat16)
    current_rows = torch.cat([k, k_rope], dim=-1)
    out_cache_loc = _out_cache_loc()
    req_to_token = _req_to_token(up)
    md = up.strategy.build_metadata(num_tokens=n, seqs_len=[p + e for p, e in zip(PREFIX, EXTEND)], extend_seqs_len=EXTEND)
    up.pad(md)
    assert md.per_rank_logical_token == [81, 80] and md.per_rank_actual_token == [82, 82]

    history_pages = {PAGES[r][j] for r in range(3) for j in range(-(-PREFIX[r] // PAGE))}
    pools, states = [], []
    old = os.environ.get("SGLANG_CPKV_CHECKED")
    os.environ["SGLANG_CPKV_CHECKED"] = "1"
    try:
        for rank in range(CP):
            pool = _pool(up)
            buf = pool.kv_buffer[0].view(CAPACITY, PAGE, 1, -1)
            for page in history_pages:
                if page % CP == rank:  # a rank's pool holds only the pages it owns
                    buf[page] = history_rows.view(CAPACITY, PAGE, 1, -1)[page]
            pools.append(pool)
            states.append(
                dsa_hooks.build_extend_state(
                    pool=pool, req_to_token=req_to_token, req_pool_indices=torch.tensor(REQ_POOL_INDICES),
                    prefix_lens=PREFIX, extend_lens=EXTEND, out_cache_loc=out_cache_loc, cp_size=CP, cp_rank=rank,
                    strategy="interleave", group=None,
                    upstream_split=(md.per_rank_logical_token, md.per_rank_actual_token),
                )
            )
    finally:
        if old is None:
            os.environ.pop("SGLANG_CPKV_CHECKED")
        else:
            os.environ["SGLANG_CPKV_CHECKED"] = old
    packs = [pack_owned_history(s.plan, p.kv_buffer[0]) for s, p in zip(states, pools)]
    dense, selected = [], []
    for rank in range(CP):
        states[rank].group = PrecomputedAllGather(packs, rank)
        fb = SimpleNamespace(**{dsa_hooks.BATCH_ATTR: states[rank]})
        dense.append(dsa_hooks.extend_dense_kv(pools[rank], 0, fb, k, k_rope).clone())
        pools[rank].set_mla_kv_buffer(None, dsa_hooks.cache_write_locs(fb, out_cache_loc, n), k, k_rope, layer_id_override=0)
        with up.parallel().override(attn_cp_rank=rank):
            _, _, bs_idx_cpu, bs_idx = up.strategy.shard_per_request(EXTEND, torch.tensor(EXTEND, dtype=torch.int32))
        seq_max = max(p + e for p, e in zip(PREFIX, EXTEND))
        table = req_to_token[torch.tensor(REQ_POOL_INDICES)][:, :seq_max][bs_idx_cpu]
        selected.append((bs_idx_cpu, dsa_hooks.remap_page_table(states[rank].plan, table, bs_idx)))
    return SimpleNamespace(
        dense=dense, pools=pools, states=states, selected=selected, history_rows=history_rows,
        current_rows=current_rows, out_cache_loc=out_cache_loc,
    )


def _truth(batch, r, pos):
    if pos < PREFIX[r]:
        return batch.history_rows[_loc(r, pos)]
    t = sum(EXTEND[:r]) + pos - PREFIX[r]
    return batch.current_rows[t]


@pytest.mark.parametrize("rank", range(CP))
def test_plan_is_checked_and_error_free(batch, rank):
    plan = batch.states[rank].plan
    assert plan.checked
    plan.raise_if_errors()


@pytest.mark.parametrize("rank", range(CP))
def test_each_request_reads_exactly_its_own_kv_through_the_remapped_table(batch, rank):
    bs_idx_cpu, remapped = batch.selected[rank]
    assert bs_idx_cpu == [0, 1, 2]  # every request has local tokens on both ranks here
    dense = batch.dense[rank]
    for row, r in enumerate(bs_idx_cpu):
        for pos in range(PREFIX[r] + EXTEND[r]):
            loc = int(remapped[row, pos])
            assert loc >= 0, f"request {r} position {pos}: no dense location"
            assert torch.equal(dense[loc], _truth(batch, r, pos)), f"rank {rank} request {r} position {pos}"


@pytest.mark.parametrize("rank", range(CP))
def test_shared_and_aliased_pages_have_one_slot_per_request(batch, rank):
    plan = batch.states[rank].plan
    inverse = plan.inverse.view(plan.num_requests, plan.capacity)
    slots = [int(inverse[r, 2]) for r in range(3)]  # page 2: history of 0 and 1, current of 2
    assert len(set(slots)) == 3 and min(slots) >= 0


@pytest.mark.parametrize("rank", range(CP))
def test_each_rank_persists_only_current_rows_of_owned_pages(batch, rank):
    pool = batch.pools[rank].kv_buffer[0]
    owned = (batch.out_cache_loc // PAGE) % CP == rank
    assert torch.equal(pool[batch.out_cache_loc[owned]], batch.current_rows[owned])
    others = batch.out_cache_loc[~owned]
    assert not pool[others].any(), "a rank wrote current rows of a page it does not own"


def test_hooks_hand_back_upstream_values_when_the_mode_is_off(up):
    from sglang_cpkv.integration import dsa_hooks

    assert not dsa_hooks.enabled()  # no server args published in this process: the flag is off
    fb = SimpleNamespace()
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert dsa_hooks.on_extend_metadata(None, fb, table, None) is table
    assert dsa_hooks.batch_state(fb) is None
    assert dsa_hooks.extend_dense_kv(_pool(up), 0, fb, None, None) is None
    loc = _out_cache_loc()
    assert dsa_hooks.cache_write_locs(fb, loc, loc.shape[0]) is loc


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

"""Owned-page cache writes under CP shared-KV with upstream's real split, padding and pool (CPU).

The batch is the seed's shape: 509 current tokens over cp=8 (interleave), so upstream's
``build_metadata`` + ``pad_logical_token_to_physical`` give logical rows [64]*5 + [63]*3 and 64
physical rows on every rank (ranks 5-7 carry one padding row). Checked:

* the runtime's split plan is the split upstream runs, padding included;
* the seed's bug reproduces: writing the all-gathered chunk (509 rows) at this rank's compute-row
  locations (64, upstream's own shard of ``out_cache_loc``) fails in upstream's
  ``MLATokenToKVPool.set_mla_kv_buffer``; our selection refuses that pairing by name and writes
  with the plan's owned locations instead;
* per rank, its pool (``CAPACITY / cp`` pages: page id ``p`` of its owner at pool page ``p // cp``, the page
  ids of upstream's page-interleave allocator) then holds exactly the rows of its owned pages (equal to
  upstream's full replica there), nothing elsewhere (reserved pool page 0 included); the union over ranks,
  each pool page put back at its page id, is upstream's full replica;
* upstream's padded per-rank rows, all-gathered rank-major, come back to token order through the
  plan without a padding row.
"""

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # upstream's MLA write is a Triton kernel

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=25, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

CP = 8
PAGE = 64
PREFIX = [128, 64]
EXTEND = [300, 209]  # N = 509
# Pages of each request: shared history page 11, then fresh current pages; none in [0, CP), the page ids upstream's
# page-interleave allocator reserves (pool page 0 of every rank).
PAGES = [[11, 12, 13, 14, 15, 16, 17, 18], [11, 19, 20, 21, 22]]
CAPACITY = 24  # page ids: CP x 3 pool pages per rank
KV_LORA, ROPE = 8, 4


@pytest.fixture(scope="module")
def up():
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.layers.cp.base import get_cp_strategy, init_cp_strategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_size=CP, attn_cp_rank=0)
    init_cp_strategy(enable_prefill_cp=True, cp_size=CP, cp_strategy="interleave")
    return SimpleNamespace(
        strategy=get_cp_strategy(), pad=pad_logical_token_to_physical, pool_cls=MLATokenToKVPool, parallel=get_parallel
    )


def _out_cache_loc():
    locs = []
    for pages, prefix, extend in zip(PAGES, PREFIX, EXTEND):
        for pos in range(prefix, prefix + extend):
            locs.append(pages[pos // PAGE] * PAGE + pos % PAGE)
    return torch.tensor(locs, dtype=torch.int64)


def _metadata(up):
    md = up.strategy.build_metadata(
        num_tokens=sum(EXTEND), seqs_len=[p + e for p, e in zip(PREFIX, EXTEND)], extend_seqs_len=EXTEND
    )
    up.pad(md)
    return md


def _plan(rank, md=None):
    """The batch's plan on CP rank ``rank``, with upstream's split (its padded metadata ``md``) or our own."""
    from sglang_cpkv.runtime.cp_split import build_cp_split, upstream_interleave_split
    from sglang_cpkv.runtime.plan import build_plan

    if md is None:
        split = build_cp_split("interleave", EXTEND, CP, rank)
    else:
        split = upstream_interleave_split(sum(EXTEND), md.per_rank_logical_token, md.per_rank_actual_token, rank)
    return build_plan(
        PAGES, PREFIX, EXTEND, _out_cache_loc(), capacity=CAPACITY, page_size=PAGE, split=split, checked=True
    )


def _pool(up, pages=CAPACITY):
    """Upstream's pool of ``pages`` pages (page 0 reserved): ``CAPACITY`` for a replica, ``CAPACITY // CP`` for a
    rank's pool under the mode."""
    return up.pool_cls(
        size=(pages - 1) * PAGE,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=KV_LORA,
        qk_rope_head_dim=ROPE,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        use_dsa=True,
    )


def _gathered_kv(n):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(n, 1, KV_LORA, generator=g).to(torch.bfloat16) + 1  # never all-zero rows
    k_rope = torch.randn(n, 1, ROPE, generator=g).to(torch.bfloat16) + 1
    return k, k_rope


def test_the_split_taken_from_upstreams_metadata_is_the_independent_one(up):
    """The serving path takes upstream's split from its padded metadata; our own interleave split (the tests'
    independent one) agrees with it row for row, padding included, and both cut a token-major tensor into the rows
    upstream's strategy gives each rank, in its order."""
    md = _metadata(up)
    assert md.per_rank_logical_token == [64] * 5 + [63] * 3 and md.per_rank_actual_token == [64] * 8
    tokens = torch.arange(1, sum(EXTEND) + 1)
    for rank in (0, 5):
        theirs, ours = _plan(rank, md).split, _plan(rank).split
        assert (theirs.per_rank_logical, theirs.physical_rows) == (ours.per_rank_logical, ours.physical_rows)
        assert torch.equal(theirs.local_token_index, ours.local_token_index)
        assert torch.equal(theirs.gather_index, ours.gather_index)
        with up.parallel().override(attn_cp_rank=rank):
            upstream_rows = up.strategy.shard_hidden_states(tokens, SimpleNamespace(attn_cp_metadata=md))
        real = ours.per_rank_logical[rank]
        assert torch.equal(theirs.shard(tokens, -1)[:real], upstream_rows[:real])


def test_metadata_that_is_not_an_interleave_split_is_named(up):
    from sglang_cpkv.ops.errors import CpSharedKvError
    from sglang_cpkv.runtime.cp_split import upstream_interleave_split

    md = _metadata(up)
    n = sum(EXTEND)
    with pytest.raises(
        CpSharedKvError, match=r"not an interleave split of 509 tokens .* \[64, 64, 64, 64, 64, 64, 64, 64\]"
    ):
        upstream_interleave_split(n, [64] * 8, md.per_rank_actual_token, 0)
    with pytest.raises(CpSharedKvError, match="per_rank_actual_token \\[64, 64, 64, 64, 64, 64, 64, 63\\]"):
        upstream_interleave_split(n, md.per_rank_logical_token, [64] * 7 + [63], 0)
    unpadded = up.strategy.build_metadata(
        num_tokens=n, seqs_len=[p + e for p, e in zip(PREFIX, EXTEND)], extend_seqs_len=EXTEND
    )
    with pytest.raises(CpSharedKvError, match="no per_rank_logical_token: its padding"):
        upstream_interleave_split(n, unpadded.per_rank_logical_token, unpadded.per_rank_actual_token, 0)
    with pytest.raises(CpSharedKvError, match="the CP split is of 509 tokens, the batch extends 510"):
        from sglang_cpkv.runtime.plan import build_plan

        split = upstream_interleave_split(n, md.per_rank_logical_token, md.per_rank_actual_token, 0)
        build_plan(
            PAGES,
            PREFIX,
            [*EXTEND[:-1], EXTEND[-1] + 1],
            _out_cache_loc(),
            capacity=CAPACITY,
            page_size=PAGE,
            split=split,
        )


def test_seed_mismatch_reproduces_and_owned_selection_fixes_it(up):
    from sglang_cpkv.hooks.cache_write import check_cache_write_rows, owned_pool_write_locs
    from sglang_cpkv.ops.errors import CpSharedKvError

    rank = 5  # 63 real rows + 1 padding row
    md = _metadata(up)
    plan = _plan(rank)
    k, k_rope = _gathered_kv(plan.num_tokens)
    with up.parallel().override(attn_cp_rank=rank):
        compute_row_locs = up.strategy.shard_hidden_states(_out_cache_loc(), SimpleNamespace(attn_cp_metadata=md))
    assert (compute_row_locs.shape[0], k.shape[0]) == (64, 509)

    # Without the fix: the gathered chunk written at this rank's compute-row locations (on a pool of every page id,
    # so that the row count, not a location, is what fails).
    with pytest.raises((IndexError, RuntimeError)):
        _pool(up).set_mla_kv_buffer(None, compute_row_locs, k, k_rope, layer_id_override=0)
    with pytest.raises(CpSharedKvError, match=r"64 rows = this CP rank's padded compute rows .* N=509"):
        check_cache_write_rows(plan, compute_row_locs.shape[0], "set_mla_kv_buffer")

    # With it: the plan's owned locations (rows of this rank's pool), one per gathered row.
    check_cache_write_rows(plan, k.shape[0], "set_mla_kv_buffer")
    pool = _pool(up, CAPACITY // CP)
    pool.set_mla_kv_buffer(None, owned_pool_write_locs(plan), k, k_rope, layer_id_override=0)
    assert pool.get_key_buffer(0).abs().sum() > 0


def test_each_rank_persists_exactly_its_owned_pages(up):
    from sglang_cpkv.hooks.cache_write import owned_pool_write_locs

    k, k_rope = _gathered_kv(sum(EXTEND))
    replica = _pool(up)  # upstream with the mode off: every rank writes every row
    replica.set_mla_kv_buffer(None, _out_cache_loc(), k, k_rope, layer_id_override=0)
    full = replica.get_key_buffer(0).view(CAPACITY, PAGE, -1)

    assert not full[:CP].any()  # no token of the batch is on a reserved page id
    union = torch.zeros_like(full)
    for rank in range(CP):
        plan = _plan(rank)
        assert plan.pool_pages == CAPACITY // CP
        pool = _pool(up, plan.pool_pages)
        pool.set_mla_kv_buffer(None, owned_pool_write_locs(plan), k, k_rope, layer_id_override=0)
        got = pool.get_key_buffer(0).view(CAPACITY // CP, PAGE, -1)
        assert not got[0].any(), f"rank {rank} wrote its reserved pool page 0"
        for pool_page in range(1, CAPACITY // CP):
            page = pool_page * CP + rank  # the page id this rank's pool page holds
            assert torch.equal(got[pool_page], full[page]), f"rank {rank} pool page {pool_page} (page {page})"
            union[page] = got[pool_page]
    assert torch.equal(union, full)


def test_padded_rank_major_gather_returns_to_token_order_without_padding(up):
    md = _metadata(up)
    k, _ = _gathered_kv(sum(EXTEND))
    rank_major = []
    for rank in range(CP):
        with up.parallel().override(attn_cp_rank=rank):
            rank_major.append(up.strategy.shard_hidden_states(k, SimpleNamespace(attn_cp_metadata=md)))
    assert {t.shape[0] for t in rank_major} == {64}
    plan = _plan(2)
    assert torch.equal(plan.split.unshard(torch.cat(rank_major)), k)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

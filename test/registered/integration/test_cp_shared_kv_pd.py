"""P/D under CP shared-KV: each prefill CP rank sends exactly the pages it owns (CPU).

Runs upstream's patched ``CommonKVSender._prepare_send_indices`` (the sender's chunk
pre-processing) on sender state holding the fields it reads, in both modes:

* flag off: the all-CP-ranks path is upstream's own (``filter_kv_indices_for_cp_rank``:
  contiguous page ranges);
* flag on: each rank keeps the pages with ``page_id % cp == rank`` at their page ids (no ``// N``
  compression, unlike upstream's kv-sharding) with their positions in the request's page list;
  over all ranks and chunks the sends partition the request's pages.
"""

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")

CP = 4
PAGES = np.array([17, 3, 8, 8 + 4, 22, 5, 9, 30, 31, 6], dtype=np.int32)  # one request's page list
CHUNKS = [4, 3, 3]


@pytest.fixture(scope="module")
def up():
    from sglang_cpkv.testing.upstream_env import install_torchvision_stub

    install_torchvision_stub()
    from sglang.srt.disaggregation.common.conn import CommonKVSender
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_cp_rank, filter_kv_indices_for_shard_rank
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(enable_dsa_cache_layer_split=False)  # read on the all-ranks path

    return SimpleNamespace(
        sender=CommonKVSender, by_range=filter_kv_indices_for_cp_rank, by_shard=filter_kv_indices_for_shard_rank
    )


@pytest.fixture
def mode():
    """Server args published with ``enable_cp_shared_kv`` as each test asks (what the hooks read)."""
    from sglang.srt.runtime_context import get_context

    from sglang_cpkv.testing.upstream_env import set_cp_shared_kv_flag

    override = get_context().override_server_args()
    override.install()
    yield set_cp_shared_kv_flag
    override.restore()


def _sends(up, rank):
    kv_mgr = SimpleNamespace(
        kv_shard_size=1,
        enable_all_cp_ranks_for_transfer=True,
        attn_cp_rank=rank,
        attn_cp_size=CP,
        is_dummy_cp_rank=rank != 0,
    )
    sender = SimpleNamespace(curr_idx=0, num_kv_indices=len(PAGES), kv_mgr=kv_mgr)
    out, start = [], 0
    for n in CHUNKS:
        out.append(up.sender._prepare_send_indices(sender, PAGES[start : start + n]))
        start += n
    return kv_mgr, out


def test_flag_off_keeps_upstreams_contiguous_ranges(up, mode):
    mode(False)
    for rank in range(CP):
        kv_mgr, sends = _sends(up, rank)
        start = 0
        for n, (kv, index_slice, _, _skip) in zip(CHUNKS, sends):
            want_kv, want_slice = up.by_range(
                kv_mgr, PAGES[start : start + n], slice(start, start + n), total_pages=len(PAGES)
            )
            assert np.array_equal(kv, want_kv) and index_slice == want_slice
            start += n


def test_flag_on_each_rank_sends_its_owned_pages_and_ranks_partition_the_request(up, mode):
    mode(True)
    sent_positions = []
    for rank in range(CP):
        _, sends = _sends(up, rank)
        for kv, positions, last, skip in sends:
            if skip:
                assert len(kv) == 0 and not last
                continue
            assert np.all(kv % CP == rank)
            assert np.array_equal(PAGES[positions], kv)  # same page ids, at their positions
            sent_positions.extend(positions.tolist())
        # Same owned positions as upstream's owner rule (which also compresses the ids: // N).
        owned_ids, owned_pos = up.by_shard(
            kv_indices=PAGES, index_slice=slice(0, len(PAGES)), shard_rank=rank, shard_size=CP
        )
        mine = [p for p in range(len(PAGES)) if PAGES[p] % CP == rank]
        assert owned_pos.tolist() == mine and np.array_equal(owned_ids, PAGES[mine] // CP)
    assert sorted(sent_positions) == list(range(len(PAGES)))


def test_state_pages_follow_the_owner_rule():
    from sglang_cpkv.hooks.pd import filter_owned_state_pages

    dst = list(range(100, 100 + len(PAGES)))
    got = [filter_owned_state_pages(PAGES.tolist(), dst, rank, CP) for rank in range(CP)]
    assert sorted(d for _, ds in got for d in ds) == dst
    for rank, (src, _) in enumerate(got):
        assert all(p % CP == rank for p in src)
    with pytest.raises(RuntimeError, match="page count mismatch"):
        filter_owned_state_pages([1, 2], [3], 0, CP)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

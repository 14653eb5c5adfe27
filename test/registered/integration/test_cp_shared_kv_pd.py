"""P/D under CP shared-KV: each prefill CP rank sends exactly the pages it owns, and the decode pulls from all (CPU).

Runs upstream's patched ``CommonKVSender._prepare_send_indices`` (the sender's chunk
pre-processing) on sender state holding the fields it reads, in both modes:

* flag off: the all-CP-ranks path is upstream's own (``filter_kv_indices_for_cp_rank``:
  contiguous page ranges);
* flag on: each rank keeps the pages with ``page_id % cp == rank`` and sends them as its pool pages
  ``page_id // cp`` (the page ids are upstream's page-interleave allocator's, ``hooks/page_ids.py``: the
  ``// N`` compression of upstream's kv-sharding) with their positions in the request's page list;
  over all ranks and chunks the sends partition the request's pages, and each sent page is the row of
  its owner's pool that upstream's ``PageInterleavePlacement`` puts that page id at.

The handshake tests run upstream's bootstrap server and ``CommonKVManager`` on both sides
(:mod:`sglang_cpkv.testing.pd_handshake`, one process per deployment): a prefill with the flag
publishes the mode, and a decode started without ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``
follows it and pulls from every prefill CP rank; with the flag off everything is upstream's.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="cpkv-cpu")
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: upstream's context per test)

MODEL_DIR = Path(__file__).resolve().parents[1] / "upstream" / "fixtures" / "dsa_v32"  # DeepseekV32ForCausalLM
ALL_RANKS_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"

CP = 4
# One request's page list: every owner, two pages of one owner side by side; no page id in [0, CP) (reserved by
# upstream's page-interleave allocator: pool page 0 of every rank).
PAGES = np.array([17, 15, 8, 8 + 4, 22, 5, 9, 30, 31, 6], dtype=np.int32)
CHUNKS = [4, 3, 3]


@pytest.fixture(scope="module")
def up():
    from sglang_cpkv.upstream_import import install_torchvision_stub

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


def _rank_pools(pages, page_size=4):
    """Each CP rank's pool with every page of ``pages`` where upstream's kv-sharding placement puts it
    (``PageInterleavePlacement``: the owner and its local rows), each row holding its token location; -1 elsewhere."""
    import torch
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec

    pools = {}
    for rank in range(CP):
        spec = PageShardSpec(shard_rank=rank, shard_size=CP, page_size=page_size, max_prefix_tokens=0, chunk_tokens=0)
        placement = PageInterleavePlacement(spec)
        locs = (torch.as_tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).flatten()
        rows = placement.filter_local(locs, rank)
        pool = torch.full((int(max(pages)) // CP * page_size + page_size,), -1, dtype=torch.int64)
        pool[rows] = locs[placement.local_mask(locs, rank)]
        pools[rank] = pool.view(-1, page_size)
    return pools


def _decode_reads(pools, rank, src_pages, positions, page_size=4):
    """What the decode writes at each position: the token locations of the rows of ``src_pages`` in ``rank``'s pool."""
    got = {}
    for src, pos in zip(np.asarray(src_pages).tolist(), np.asarray(positions).tolist()):
        rows = pools[rank][src].tolist()
        assert rows[0] >= 0, f"rank {rank} sent pool page {src}, which holds no page of the request"
        assert rows == [rows[0] + o for o in range(page_size)] and rows[0] % page_size == 0
        got[pos] = rows[0] // page_size
    return got


def test_flag_on_each_rank_sends_its_owned_pages_and_ranks_partition_the_request(up, mode):
    mode(True)
    pools = _rank_pools(PAGES)
    sent_positions, read = [], {}
    for rank in range(CP):
        _, sends = _sends(up, rank)
        for kv, positions, last, skip in sends:
            if skip:
                assert len(kv) == 0 and not last
                continue
            assert np.all(PAGES[positions] % CP == rank)  # its owned page ids ...
            assert np.array_equal(kv, PAGES[positions] // CP)  # ... as its pool pages, at their positions
            read.update(_decode_reads(pools, rank, kv, positions))
            sent_positions.extend(positions.tolist())
        # Same owned positions and pool pages as upstream's owner rule (filter_kv_indices_for_shard_rank).
        owned_ids, owned_pos = up.by_shard(
            kv_indices=PAGES, index_slice=slice(0, len(PAGES)), shard_rank=rank, shard_size=CP
        )
        mine = [p for p in range(len(PAGES)) if PAGES[p] % CP == rank]
        assert owned_pos.tolist() == mine and np.array_equal(owned_ids, PAGES[mine] // CP)
    assert sorted(sent_positions) == list(range(len(PAGES)))  # a partition: every position once
    # The decode's page of each position holds that position's page, read from the pool its owner holds it in.
    assert read == {pos: int(page) for pos, page in enumerate(PAGES)}


def test_flag_on_sends_of_the_allocators_pages_address_the_owners_pool(up, mode):
    """The request's pages as upstream's page-interleave allocator hands them out (every owner class, cyclic)."""
    import torch
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    mode(True)
    ps = 4
    allocator = PageInterleavePoolAllocator(
        8 * ps, physical_page_size=ps, shard_size=CP, dtype=torch.int64, device="cpu", kvcache=None, need_sort=False
    )
    n = 7 * ps + 1  # 8 pages
    zero, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([n])
    locs = allocator.alloc_extend(zero, zero, lens, lens, zero, n, rotation_bases=[None])
    pages = (locs[::ps] // ps).numpy().astype(np.int32)
    assert len(pages) == 8 and pages.min() >= CP and sorted(set(pages % CP)) == list(range(CP))
    pools = _rank_pools(pages, ps)
    read = {}
    for rank in range(CP):
        kv, pos = up.sender._prepare_send_indices(
            SimpleNamespace(
                curr_idx=0,
                num_kv_indices=len(pages),
                kv_mgr=SimpleNamespace(
                    kv_shard_size=1,
                    enable_all_cp_ranks_for_transfer=True,
                    attn_cp_rank=rank,
                    attn_cp_size=CP,
                    is_dummy_cp_rank=rank != 0,
                ),
            ),
            pages,
        )[:2]
        got = _decode_reads(pools, rank, kv, pos, ps)
        assert not set(got) & set(read)
        read.update(got)
    assert read == {pos: int(page) for pos, page in enumerate(pages)}


def test_state_pages_follow_the_owner_rule():
    from sglang_cpkv.hooks.pd import filter_owned_state_pages

    dst = list(range(100, 100 + len(PAGES)))
    got = [filter_owned_state_pages(PAGES.tolist(), dst, rank, CP) for rank in range(CP)]
    assert sorted(d for _, ds in got for d in ds) == dst
    by_dst = dict(zip(dst, PAGES.tolist()))
    for rank, (src, ds) in enumerate(got):
        # Each rank's owned state pages, as the pool pages its index-K pool holds them at.
        assert src == [by_dst[d] // CP for d in ds] and all(by_dst[d] % CP == rank for d in ds)


@pytest.mark.parametrize("drift", [-1, 1], ids=["decode-has-more", "prefill-has-more"])
def test_state_page_count_drift_is_truncated_as_upstream_tolerates(drift):
    # Upstream's Mooncake state send truncates the longer paged-DSA list to the shorter one; under the mode
    # each rank sends those same positional pairs, restricted to the pages it owns.
    from sglang_cpkv.hooks.pd import filter_owned_state_pages

    src, dst = PAGES.tolist(), list(range(100, 100 + len(PAGES)))
    if drift < 0:
        src = src[:-1]
    else:
        dst = dst[:-1]
    paired = min(len(src), len(dst))
    sent = {}
    for rank in range(CP):
        owned_src, owned_dst = filter_owned_state_pages(src, dst, rank, CP)
        assert len(owned_src) == len(owned_dst)
        sent.update((d, (rank, p)) for d, p in zip(owned_dst, owned_src))
    # Each pair upstream would send, from its owner's pool page.
    assert sent == {d: (p % CP, p // CP) for d, p in zip(dst[:paired], src[:paired])}


# ---------------------------------------------------------------------------------- bootstrap handshake


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_argv(port: int, *extra: str) -> list[str]:
    return [
        "--model-path",
        str(MODEL_DIR),
        "--skip-tokenizer-init",
        "--device",
        "cuda",
        "--random-seed",
        "1",
        "--host",
        "127.0.0.1",
        "--disaggregation-bootstrap-port",
        str(port),
        "--tp",
        str(CP),
        *extra,
    ]


def _start_handshake(prefill_flags: list[str]) -> subprocess.Popen:
    """A CP-4 prefill (every rank sending) and a TP-4 decode started without the all-ranks variable."""
    port = _free_port()
    case = {
        "prefill": {
            "argv": _server_argv(
                port, "--disaggregation-mode", "prefill", "--enable-prefill-cp", "--cp-strategy", "interleave"
            )
            + prefill_flags,
            "env": {ALL_RANKS_ENV: "1"},
        },
        "decode": {"argv": _server_argv(port, "--disaggregation-mode", "decode")},
    }
    env = {k: v for k, v in os.environ.items() if k != ALL_RANKS_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_cpkv.testing.pd_handshake"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    proc.stdin.write(json.dumps(case))
    proc.stdin.close()
    return proc


@pytest.fixture(scope="module")
def handshakes():
    # Both deployments at once (two processes; the upstream imports dominate).
    procs = {"on": _start_handshake(["--enable-cp-shared-kv"]), "off": _start_handshake([])}
    results = {}
    for name, proc in procs.items():
        out, err = proc.stdout.read(), proc.stderr.read()
        assert proc.wait(timeout=300) == 0, err[-4000:]
        results[name] = json.loads(out)
        assert "error" not in results[name], results[name]
    return results


def test_decode_follows_a_prefill_that_publishes_the_mode(handshakes):
    got = handshakes["on"]
    assert got["info"]["enable_cp_shared_kv"] is True and got["info"]["attn_cp_size"] == CP
    assert got["prefill_ranks"] == [{"cp_rank": r, "sends": True} for r in range(CP)]
    # The decode has no SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER, yet pulls from every owner.
    assert got["decode"] == {"target_cp_ranks": list(range(CP)), "required_prefill_response_num": CP}


def test_flag_off_keeps_upstreams_bootstrap_info_and_rank_mapping(handshakes):
    got = handshakes["off"]
    # Upstream's payload (an unpatched decode parses it), and upstream's rule: without the variable on the
    # decode, a full-replica CP prefill is read from CP rank 0.
    assert "enable_cp_shared_kv" not in got["info"] and got["info"]["attn_cp_size"] == CP
    assert got["prefill_ranks"] == [{"cp_rank": r, "sends": True} for r in range(CP)]
    assert got["decode"] == {"target_cp_ranks": [0], "required_prefill_response_num": 1}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

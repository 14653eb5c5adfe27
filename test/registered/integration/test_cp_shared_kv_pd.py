"""P/D under CP shared-KV: each prefill CP rank sends exactly the pages it owns, and the decode pulls from all (CPU).

Runs upstream's patched ``CommonKVSender._prepare_send_indices`` (the sender's chunk
pre-processing) on sender state holding the fields it reads, in both modes:

* flag off: the all-CP-ranks path is upstream's own (``filter_kv_indices_for_cp_rank``:
  contiguous page ranges);
* flag on: each rank keeps the pages with ``page_id % cp == rank`` at their page ids (no ``// N``
  compression, unlike upstream's kv-sharding) with their positions in the request's page list;
  over all ranks and chunks the sends partition the request's pages.

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
        assert len(owned_src) == len(owned_dst) and all(p % CP == rank for p in owned_src)
        sent.update(zip(owned_dst, owned_src))
    assert sent == dict(zip(dst[:paired], src[:paired]))


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

"""CP split of the current tokens: companion request ids, padding, and parity with upstream 0.5.23."""

import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime import build_plan
from sglang_cpkv.runtime.cp_split import build_cp_split, split_applies
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="cpkv-cpu")

# (extend_lens, cp) batches: uneven totals force padding rows on some ranks.
BATCHES = [
    ([3, 1, 6], 2),
    ([3, 1, 6], 4),
    ([5, 9, 2, 7], 8),
    ([10], 4),
    ([1, 1, 1, 1, 1, 1, 1, 1, 2], 8),
    ([16, 17], 8),
]


def _plan_for(extend_lens, cp, rank, strategy):
    """A plan with one fresh page per token (page_size 1), so locations are easy to read."""
    n = sum(extend_lens)
    tables, start = [], 0
    for e in extend_lens:
        tables.append(list(range(start, start + e)))
        start += e
    loc = torch.arange(n, dtype=torch.int64)
    return build_plan(
        tables,
        [0] * len(extend_lens),
        extend_lens,
        loc,
        capacity=cp * -(-n // cp),  # cp x each rank's pool pages
        page_size=1,
        split=build_cp_split(strategy, extend_lens, cp, rank),
    )


@pytest.mark.parametrize("extend_lens,cp", BATCHES)
def test_interleave_companion_request_ids_follow_the_locations(extend_lens, cp):
    n = sum(extend_lens)
    token_req = [r for r, e in enumerate(extend_lens) for _ in range(e)]
    longest = -(-n // cp)
    physical = -(-longest // cp) * cp  # roundup(ceil(N/cp), cp)
    seen = []
    for rank in range(cp):
        plan = _plan_for(extend_lens, cp, rank, "interleave")
        assert plan.split.physical_rows == physical
        locs = plan.local_out_cache_loc.tolist()
        reqs = plan.local_req_id.tolist()
        real = list(range(rank, n, cp))
        assert locs[: len(real)] == real  # page_size 1 and identity pages: loc == token index
        assert reqs[: len(real)] == [token_req[t] for t in real]
        assert locs[len(real) :] == [-1] * (physical - len(real))
        assert reqs[len(real) :] == [-1] * (physical - len(real))
        seen += real
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("extend_lens,cp", [([16, 17], 2), ([16, 17], 4), ([16, 20, 31], 8), ([9, 8], 4)])
def test_zigzag_companion_request_ids_and_padding(extend_lens, cp):
    n = sum(extend_lens)
    token_req = [r for r, e in enumerate(extend_lens) for _ in range(e)]
    seen = []
    for rank in range(cp):
        plan = _plan_for(extend_lens, cp, rank, "zigzag")
        physical = plan.split.physical_rows
        assert physical % (2 * cp) == 0
        logical = plan.split.per_rank_logical[rank]
        locs = plan.local_out_cache_loc.tolist()
        reqs = plan.local_req_id.tolist()
        assert reqs[:logical] == [token_req[t] for t in locs[:logical]]
        assert locs[logical:] == [-1] * (physical - logical) and reqs[logical:] == [-1] * (physical - logical)
        # Rank r holds block r of each request, then block 2cp-1-r of each request.
        first_blocks = list(locs[:logical])
        starts = [sum(extend_lens[:r]) for r in range(len(extend_lens))]
        expect = []
        for half in (rank, 2 * cp - 1 - rank):
            for r, e in enumerate(extend_lens):
                base, rem = divmod(e, 2 * cp)
                sizes = [base + (b < rem) for b in range(2 * cp)]
                s = starts[r] + sum(sizes[:half])
                expect += list(range(s, s + sizes[half]))
        assert first_blocks == expect
        seen += locs[:logical]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("strategy", ["interleave", "zigzag"])
def test_unshard_restores_token_order(strategy):
    extend_lens, cp = [16, 21, 18], 4
    x = torch.arange(sum(extend_lens) * 3, dtype=torch.float32).reshape(-1, 3)
    splits = [build_cp_split(strategy, extend_lens, cp, r) for r in range(cp)]
    gathered = torch.cat([s.shard(x, 0) for s in splits])
    for s in splits:
        assert torch.equal(s.unshard(gathered), x)


def test_split_errors_name_the_bad_value():
    with pytest.raises(CpSharedKvError, match="cp_rank 4 outside"):
        build_cp_split("interleave", [8], 4, 4)
    with pytest.raises(CpSharedKvError, match="does not apply"):
        build_cp_split("interleave", [1, 1], 4, 0)  # N < cp: upstream runs it un-split
    with pytest.raises(CpSharedKvError, match="does not apply"):
        build_cp_split("zigzag", [8, 3], 2, 0)  # a request shorter than 2*cp
    with pytest.raises(CpSharedKvError, match="unknown CP strategy"):
        build_cp_split("ring", [8], 2, 0)
    assert not split_applies("interleave", [1, 1], 4)
    none = build_cp_split("none", [1, 1], 4, 3)
    assert none.physical_rows == 2 and none.local_token_index.tolist() == [0, 1]


def _upstream():
    """Upstream 0.5.23's CP strategy modules, or skip saying why they do not import here."""
    try:
        from sglang_cpkv.upstream_import import install_torchvision_stub

        install_torchvision_stub()
        import sglang.srt.layers.cp.base as base
        import sglang.srt.layers.cp.interleave as interleave
        import sglang.srt.layers.cp.padding as padding
        import sglang.srt.layers.cp.zigzag as zigzag
    except Exception as exc:  # any import failure of the pinned wheel on this machine
        pytest.skip(f"upstream sglang 0.5.23 CP modules do not import on this machine: {exc!r}")
    return base, interleave, padding, zigzag


@pytest.mark.parametrize("strategy", ["interleave", "zigzag"])
def test_split_matches_upstream_0_5_23(strategy, monkeypatch):
    base, interleave, padding, zigzag = _upstream()
    batches = [([3, 1, 6], 2), ([3, 1, 6], 4), ([5, 9, 2, 7], 8), ([10], 4), ([16, 17], 8), ([40, 19, 33], 4)]
    compared = 0
    for extend_lens, cp in batches:
        if not split_applies(strategy, extend_lens, cp):
            continue
        n = sum(extend_lens)
        x = torch.arange(1, n + 1, dtype=torch.float32).reshape(-1, 1).repeat(1, 2)  # no zero row
        upstream_shards = []
        for rank in range(cp):
            parallel = SimpleNamespace(attn_cp_size=cp, attn_cp_rank=rank)
            monkeypatch.setattr(base, "get_parallel", lambda p=parallel: p)
            monkeypatch.setattr(padding, "get_parallel", lambda p=parallel: p)
            monkeypatch.setattr(base, "is_zigzag", lambda s=strategy: s == "zigzag")
            cls = interleave.InterleaveCPStrategy if strategy == "interleave" else zigzag.ZigzagCPStrategy
            upstream = cls(cp)
            metadata = upstream.build_metadata(n, None, list(extend_lens))
            padding.pad_logical_token_to_physical(metadata)
            up_local = upstream.shard_hidden_states(x, SimpleNamespace(attn_cp_metadata=metadata))
            ours = build_cp_split(strategy, extend_lens, cp, rank)
            assert list(ours.per_rank_logical) == list(metadata.per_rank_logical_token)
            assert ours.physical_rows == metadata.per_rank_actual_token[rank]
            assert torch.equal(ours.shard(x, 0), up_local), (strategy, extend_lens, cp, rank)
            upstream_shards.append(up_local)
            compared += 1
        # Our unshard restores token order from upstream's own shards.
        assert torch.equal(ours.unshard(torch.cat(upstream_shards)), x)
    assert compared >= 8


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

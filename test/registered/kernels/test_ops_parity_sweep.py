"""GPU parity sweep of the CP shared-KV ops: torch == Triton == CUDA, byte for byte.

Grid: batch_rows {1,2,3,4,8} x page sizes {16,64} x row layouts (bf16 1152-byte rows, 656-byte
packed FP8 rows as uint8) x patterns (cp 1, synchronous: history and current rows in one fused op;
cp 2, layer-ahead: owned pages exchanged between two ranks, CP-split current rows with padding),
on sparse page sets sharing a page across requests, through the runtime's layer pipeline on each
ops backend (every rank's dense view, remapped top-k and pool equal across backends and equal the
truth). Plus CP split shapes (cp 2 and 4), bad ids, the [[1,5],[9,5]] shared-page regression and
one realistic-size case per op (multi-chunk launches of the GPU auto configuration).

The CUDA provider runs only where ``sglang_cpkv.ops.cuda.is_available()``; every test skips
cleanly without a GPU. The CPU subset (torch vs the Triton interpreter) is in
``test_triton_ops.py``.
"""

import sys

import pytest
import torch

from sglang_cpkv import ops
from sglang_cpkv.ops import reference
from sglang_cpkv.ops.errors import (
    new_error_counter,
)
from sglang_cpkv.testing import batches
from sglang_cpkv.testing.ci_register import register_cuda_ci

register_cuda_ci(est_time=60, stage="cpkv", runner_config="1-gpu")

BATCH_ROWS = [1, 2, 3, 4, 8]
PAGE_SIZES = [16, 64]
LAYOUTS = sorted(batches.ROW_LAYOUTS)
PATTERNS = ["dense", "masked"]
PROVIDERS = ["triton", "cuda"]

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the parity sweep needs a CUDA GPU (CPU subset: test_triton_ops.py)"
)


def _cuda_ops():
    """``sglang_cpkv.ops.cuda`` when installed and built, else None."""
    try:
        from sglang_cpkv.ops import cuda
    except ModuleNotFoundError as exc:
        if exc.name != "sglang_cpkv.ops.cuda":
            raise
        return None
    return cuda if cuda.is_available() else None


def _provider(name: str):
    if name == "triton":
        from sglang_cpkv.ops import triton as triton_ops

        if triton_ops.INTERPRETED:
            pytest.skip("TRITON_INTERPRET=1: Triton kernels are interpreted, they cannot run CUDA tensors")
        return triton_ops
    module = _cuda_ops()
    if module is None:
        pytest.skip("sglang_cpkv.ops.cuda is not installed or its extension is not built")
    return module


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pipeline_runs(case: batches.BatchCase, layout: str, provider: str, monkeypatch, *, layer_ahead: bool, topk: int):
    """Every rank's pipeline results on the reference and on ``provider``; both checked against the truth."""
    _provider(provider)  # skips when the provider cannot run here
    pool = batches.random_rows(case.capacity * case.page_size, layout, _gen(case.capacity))
    current = batches.random_rows(case.num_tokens, layout, _gen(case.num_tokens))
    locs, positions = batches.random_topk(case, topk, seed=case.num_tokens)
    runs = []
    for backend in ("torch", provider):
        monkeypatch.setenv(ops.BACKEND_ENV, backend)
        results = batches.run_case_on_ranks(case, pool, current, locs, "cuda", layer_ahead=layer_ahead)
        monkeypatch.setenv(ops.BACKEND_ENV, "torch")  # the truth's host plans run on the CPU
        problems = batches.check_against_truth(case, pool, current, positions, results)
        assert problems == [], f"{backend}: {problems[:4]}"
        runs.append(results)
    out_locs = case.out_cache_loc()
    # A pool location two requests write (independent draws may collide) has an unspecified winner.
    fields = ("dense", "remapped", "current_full") + (("pool_after",) if len(set(out_locs)) == len(out_locs) else ())
    for rank, (ref, got) in enumerate(zip(*runs)):
        for field in fields:
            a, b = getattr(ref, field), getattr(got, field)
            if not batches.same_bytes(a, b):
                diff = (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).nonzero()
                raise AssertionError(f"rank {rank} {field}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("batch_rows", BATCH_ROWS)
def test_layer_pipeline_parity(batch_rows, page_size, layout, pattern, provider, monkeypatch):
    seed = batch_rows * 1000 + page_size * 10 + LAYOUTS.index(layout) * 2 + PATTERNS.index(pattern)
    # Sparse page sets from a 512-page pool, page 3 shared by every request.
    base = batches.sparse_case(batch_rows, page_size, 512, 24, _gen(seed), shared_pages=(3,))
    cp = 2 if pattern == "masked" else 1
    case = base.on_cp(cp)
    _pipeline_runs(case, layout, provider, monkeypatch, layer_ahead=cp > 1, topk=64)


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("batch_rows", [3, 8])
def test_cp_split_shapes(batch_rows, cp_size, provider, monkeypatch):
    """Each rank remaps and fills its interleave share (rows padded with -1 to a common length)."""
    base = batches.sparse_case(batch_rows, 64, 256, 6, _gen(cp_size * 10 + batch_rows), shared_pages=(5,))
    case = base.on_cp(cp_size)
    _pipeline_runs(case, "fp8_packed", provider, monkeypatch, layer_ahead=True, topk=33)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_shared_page_regression(provider):
    """[[1,5],[9,5]]: both requests hold page 5 and continue it with divergent current tokens."""
    impl = _provider(provider)
    page_size, capacity = 64, 16
    table = torch.tensor([[1, 5], [9, 5]], dtype=torch.int32, device="cuda")
    results = []
    for backend in (reference, impl):
        errors = new_error_counter("cuda")
        gen = _gen(9)
        pool = batches.random_rows(capacity * page_size, "bf16", gen, "cuda")
        dense = batches.random_rows(4 * page_size, "bf16", gen, "cuda")
        current = batches.random_rows(8, "bf16", gen, "cuda")
        inverse = backend.build_page_inverse(*batches.flat_slots(table), 2, capacity, errors)
        backend.copy_pages(
            pool.view(capacity, -1),
            table.view(-1),
            dense.view(4, -1),
            torch.arange(4, dtype=torch.int32, device="cuda"),
            errors,
        )
        locs = torch.tensor([5 * 64 + 60 + i for i in range(4)] * 2, dtype=torch.int64, device="cuda")
        req = torch.tensor([0] * 4 + [1] * 4, device="cuda")
        dense_locs = backend.remap_locs(locs, req, inverse, page_size, errors)
        backend.scatter_rows(current, dense_locs, dense, errors)
        results.append((batches.inverse_table(inverse), dense_locs, dense, errors))
    for a, b in zip(*results):
        assert batches.same_bytes(a, b)
    *_, dense_locs, dense, errors = results[1]
    assert dense_locs.tolist() == [124, 125, 126, 127, 252, 253, 254, 255]
    assert errors.tolist() == [0, 0, 0, 0]
    assert batches.same_bytes(dense[124:128], current[:4]) and batches.same_bytes(dense[252:256], current[4:])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_bad_ids_dropped_and_counted(provider):
    impl = _provider(provider)
    counts = []
    for backend in (reference, impl):
        errors = new_error_counter("cuda")
        table = torch.tensor([[3, 12, -1], [-7, 2, 40]], dtype=torch.int32, device="cuda")
        inverse = backend.build_page_inverse(*batches.flat_slots(table), 2, 12, errors)
        locs = torch.tensor([[200, 48 * 4, -1], [8, 9, 10]], dtype=torch.int32, device="cuda")
        backend.remap_locs(locs, torch.tensor([0, 5], device="cuda"), inverse, 4, errors)
        src = batches.random_rows(3, "fp8_packed", _gen(1), "cuda")
        guard = batches.random_rows(6, "fp8_packed", _gen(2), "cuda")
        before = guard.clone()
        backend.scatter_rows(src, torch.tensor([4, 1, -9], device="cuda"), guard[1:5], errors)
        backend.copy_pages(
            src,
            torch.tensor([0, 3], dtype=torch.int32, device="cuda"),
            guard[1:5],
            torch.tensor([4, 0], dtype=torch.int32, device="cuda"),
            errors,
        )
        assert batches.same_bytes(guard[0], before[0]) and batches.same_bytes(guard[5], before[5])
        counts.append((errors.tolist(), guard))
    (ref_err, ref_guard), (got_err, got_guard) = counts
    # page: inverse 12, -7, 40; remap 200, 192 (C = 12); copy 4 (dst), 3 (src). req: request 5 of 2, three real
    # locations. loc: 4 (= M) and -9.
    expected = batches.error_counts(page=3 + 2 + 2, req=3, loc=2)
    assert got_err == ref_err == expected
    assert batches.same_bytes(ref_guard, got_guard)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_realistic_sizes(provider):
    """GPU auto configuration on serving sizes: 40K-page pool, 8 requests of 1024 pages of 64,
    4096 x 2048 int32 top-k, and a history materialize + fill of 656-byte rows."""
    impl = _provider(provider)
    gen = _gen(42)
    case = batches.sparse_case(8, 64, 40960, 1024, gen)
    outputs = []
    for backend in (reference, impl):
        errors = new_error_counter("cuda")
        table = batches.padded_page_table(case, 1024).cuda()
        inverse = backend.build_page_inverse(*batches.flat_slots(table), 8, 40960, errors)
        tk_locs, tk_req = batches.topk_locs(case, 4096, 2048, _gen(43))
        topk = backend.remap_locs(tk_locs.to(torch.int32).cuda(), tk_req.cuda(), inverse, 64, errors)
        pool = batches.random_rows(4096 * 64, "fp8_packed", _gen(44), "cuda").view(4096, -1)
        dense = torch.zeros(2048, 64 * 656, dtype=torch.uint8, device="cuda")
        src_page = torch.randint(0, 4096, (2048,), generator=_gen(45), dtype=torch.int32).cuda()
        dst_page = torch.randperm(2048, generator=_gen(46)).to(torch.int32).cuda()
        backend.copy_pages(pool, src_page, dense, dst_page, errors)
        rows = batches.random_rows(50000, "fp8_packed", _gen(47), "cuda")
        backend.scatter_rows(
            rows, torch.randperm(2048 * 64, generator=_gen(48))[:50000].cuda(), dense.view(-1, 656), errors
        )
        outputs.append((batches.inverse_table(inverse), topk, dense, errors))
    for a, b in zip(*outputs):
        assert batches.same_bytes(a, b)
    assert outputs[1][-1].tolist() == [0, 0, 0, 0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

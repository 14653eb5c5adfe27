"""GPU parity sweep of the CP shared-KV ops: torch == Triton == CUDA, byte for byte.

Grid: batch_rows {1,2,3,4,8} x page sizes {16,64} x row layouts (bf16 1152-byte rows, 656-byte
packed FP8 rows as uint8) x patterns (dense: every page materialized, every current token
written; masked: pages owned by another CP rank masked with -1, a tenth of current tokens
without a location, CP-split fill with -1 padding), on sparse page sets sharing a page across
requests. Plus CP split shapes (cp 2 and 4), bad ids, the [[1,5],[9,5]] shared-page regression
and one realistic-size case per op (multi-chunk launches of the GPU auto configuration).

The CUDA provider runs only where ``sglang_cpkv.ops.cuda.is_available()``; every test skips
cleanly without a GPU. The CPU subset (torch vs the Triton interpreter) is in
``test_triton_ops.py``.
"""

import sys

import pytest
import torch

from sglang_cpkv.ops import reference
from sglang_cpkv.ops.errors import ERR_LOC_OUT_OF_RANGE, ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE, new_error_counter
from sglang_cpkv.testing.ci_register import register_cuda_ci
from sglang_cpkv.testing.ops_cases import (
    ROW_LAYOUTS,
    random_batch,
    random_rows,
    run_layer_sequence,
    same_bytes,
    topk_locs,
    truth_dense,
)

register_cuda_ci(est_time=60, stage="cpkv", runner_config="1-gpu")

BATCH_ROWS = [1, 2, 3, 4, 8]
PAGE_SIZES = [16, 64]
LAYOUTS = sorted(ROW_LAYOUTS)
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


def _assert_same(ref: dict, got: dict, keys=("inverse", "dense", "topk_dense", "errors")):
    for key in keys:
        a, b = ref[key], got[key]
        if not same_bytes(a, b):
            diff = (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).nonzero()
            raise AssertionError(f"{key}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("batch_rows", BATCH_ROWS)
def test_layer_sequence_parity(batch_rows, page_size, layout, pattern, provider):
    impl = _provider(provider)
    seed = batch_rows * 1000 + page_size * 10 + LAYOUTS.index(layout) * 2 + PATTERNS.index(pattern)
    # Sparse page sets from a 512-page pool, page 3 shared by every request, tables padded to a bucket.
    batch = random_batch(batch_rows, page_size, 512, 24, _gen(seed), shared_pages=(3,), pages_per_request=32)
    kwargs = dict(
        cp_size=2 if pattern == "masked" else 1,
        skip=0.1 if pattern == "masked" else 0.0,
        topk_shape=(64, 512),
        seed=seed,
        device="cuda",
    )
    ref = run_layer_sequence(reference, batch, layout, **kwargs)
    got = run_layer_sequence(impl, batch, layout, **kwargs)
    _assert_same(ref, got)
    assert got["errors"].tolist() == [0, 0, 0]
    assert same_bytes(got["dense"].cpu(), truth_dense(batch, got))


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("batch_rows", [3, 8])
def test_cp_split_shapes(batch_rows, cp_size, provider):
    """Each rank remaps and fills its interleave share (rows padded with -1 to a common length)."""
    impl = _provider(provider)
    batch = random_batch(batch_rows, 64, 256, 6, _gen(cp_size * 10 + batch_rows), shared_pages=(5,))
    kwargs = dict(cp_size=cp_size, skip=0.05, topk_shape=(33, 100), seed=cp_size, device="cuda")
    ref = run_layer_sequence(reference, batch, "fp8_packed", **kwargs)
    got = run_layer_sequence(impl, batch, "fp8_packed", **kwargs)
    _assert_same(ref, got)
    assert same_bytes(got["dense"].cpu(), truth_dense(batch, got))


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
        pool = random_rows(capacity * page_size, "bf16", gen, "cuda")
        dense = random_rows(4 * page_size, "bf16", gen, "cuda")
        current = random_rows(8, "bf16", gen, "cuda")
        inverse = backend.build_page_inverse(table, capacity, errors)
        backend.copy_pages(
            pool.view(capacity, -1),
            table.view(-1),
            dense.view(4, -1),
            torch.arange(4, dtype=torch.int32, device="cuda"),
            errors,
        )
        locs = torch.tensor([5 * 64 + 60 + i for i in range(4)] * 2, dtype=torch.int64, device="cuda")
        req = torch.tensor([0] * 4 + [1] * 4, device="cuda")
        dense_locs = backend.remap_locs(locs, req, inverse, capacity, page_size, errors)
        backend.scatter_rows(current, dense_locs, dense, errors)
        results.append((inverse, dense_locs, dense, errors))
    for a, b in zip(*results):
        assert same_bytes(a, b)
    inverse, dense_locs, dense, errors = results[1]
    assert dense_locs.tolist() == [124, 125, 126, 127, 252, 253, 254, 255]
    assert errors.tolist() == [0, 0, 0]
    assert same_bytes(dense[124:128], current[:4]) and same_bytes(dense[252:256], current[4:])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_bad_ids_dropped_and_counted(provider):
    impl = _provider(provider)
    counts = []
    for backend in (reference, impl):
        errors = new_error_counter("cuda")
        table = torch.tensor([[3, 12, -1], [-7, 2, 40]], dtype=torch.int32, device="cuda")
        inverse = backend.build_page_inverse(table, 12, errors)
        locs = torch.tensor([[200, 48 * 4, -1], [8, 9, 10]], dtype=torch.int32, device="cuda")
        backend.remap_locs(locs, torch.tensor([0, 5], device="cuda"), inverse, 12, 4, errors)
        src = random_rows(3, "fp8_packed", _gen(1), "cuda")
        guard = random_rows(6, "fp8_packed", _gen(2), "cuda")
        before = guard.clone()
        backend.scatter_rows(src, torch.tensor([4, 1, -9], device="cuda"), guard[1:5], errors)
        backend.copy_pages(
            src,
            torch.tensor([0, 3], dtype=torch.int32, device="cuda"),
            guard[1:5],
            torch.tensor([4, 0], dtype=torch.int32, device="cuda"),
            errors,
        )
        assert same_bytes(guard[0], before[0]) and same_bytes(guard[5], before[5])
        counts.append((errors.tolist(), guard))
    (ref_err, ref_guard), (got_err, got_guard) = counts
    expected = [0] * 3
    expected[ERR_PAGE_OUT_OF_RANGE] = 3 + 2 + 2  # inverse: 12, -7, 40; remap: 200, 192 (C = 12); copy: 4 (dst), 3 (src)
    expected[ERR_REQ_OUT_OF_RANGE] = 3  # request 5 of 2, three real locations
    expected[ERR_LOC_OUT_OF_RANGE] = 2  # 4 (= M) and -9
    assert got_err == ref_err == expected
    assert same_bytes(ref_guard, got_guard)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_realistic_sizes(provider):
    """GPU auto configuration on serving sizes: 40K-page pool, 8 requests of 1024 pages of 64,
    4096 x 2048 int32 top-k, and a history materialize + fill of 656-byte rows."""
    impl = _provider(provider)
    gen = _gen(42)
    batch = random_batch(8, 64, 40960, 1024, gen, pages_per_request=1024)
    outputs = []
    for backend in (reference, impl):
        errors = new_error_counter("cuda")
        table = batch.page_table.cuda()
        inverse = backend.build_page_inverse(table, 40960, errors)
        tk_locs, tk_req = topk_locs(batch, 4096, 2048, _gen(43))
        topk = backend.remap_locs(tk_locs.to(torch.int32).cuda(), tk_req.cuda(), inverse, 40960, 64, errors)
        pool = random_rows(4096 * 64, "fp8_packed", _gen(44), "cuda").view(4096, -1)
        dense = torch.zeros(2048, 64 * 656, dtype=torch.uint8, device="cuda")
        src_page = torch.randint(0, 4096, (2048,), generator=_gen(45), dtype=torch.int32).cuda()
        dst_page = torch.randperm(2048, generator=_gen(46)).to(torch.int32).cuda()
        backend.copy_pages(pool, src_page, dense, dst_page, errors)
        rows = random_rows(50000, "fp8_packed", _gen(47), "cuda")
        backend.scatter_rows(
            rows, torch.randperm(2048 * 64, generator=_gen(48))[:50000].cuda(), dense.view(-1, 656), errors
        )
        outputs.append((inverse, topk, dense, errors))
    for a, b in zip(*outputs):
        assert same_bytes(a, b)
    assert outputs[1][3].tolist() == [0, 0, 0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

"""The plan's compiled host layout (``csrc/cp_shared_kv_host/plan_layout.cc``) against its numpy reference.

Every value a batch stages for the device (the int64 and int32 arrays, byte for byte), the host slots of its entries,
its region, own slots and gather blocks, on random batches of every sharing pattern and collision class at cp 1-8
(each rank's view), on large batches (64 requests, shared prompts, distinct histories), with page ids on the host
(int32, int64, narrower tables) and not (a device table without history), and whole plans built both ways.
"""

import random
import sys

import pytest
import torch

from sglang_cpkv.ops.errors import NUM_ERROR_KINDS, CpSharedKvError
from sglang_cpkv.runtime import host_layout, plan
from sglang_cpkv.runtime.buckets import round_dense_slots
from sglang_cpkv.testing.batches import BatchCase, host_plan, padded_page_table, random_case, sparse_case
from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="cpkv-cpu")


@pytest.fixture(scope="module")
def lib():
    library = host_layout.library()
    assert library is not None, (
        "the compiled host layout is not built for these sources: `python -m sglang_cpkv.runtime.host_layout_build` "
        "(scripts/setup_env.sh runs it)"
    )
    return library


def _layouts(lib, case: BatchCase, cp_rank: int, table: torch.Tensor | None, validate: bool = True):
    prefix, extend = plan._validate_lengths(case.prefix_lens, case.extend_lens)
    width = max(len(t) for t in case.page_tables) if table is None else table.shape[1]
    pages_needed = plan._pages_needed(width, prefix, extend, case.page_size)
    kwargs = dict(page_size=case.page_size, cp_size=case.cp_size, cp_rank=cp_rank, capacity=case.capacity)
    reference = plan._NumpyLayout(table, width, prefix, extend, pages_needed, validate=validate, **kwargs)
    compiled = host_layout.CompiledLayout(lib, table, width, prefix, extend, pages_needed, validate=validate, **kwargs)
    return reference, compiled


def _staged(layout, num_slots: int) -> bytes:
    sizes64, sizes32 = layout.stage_sizes(num_slots, NUM_ERROR_KINDS)
    buffer = torch.full((8 * sum(sizes64) + 4 * sum(sizes32),), 0xA5, dtype=torch.uint8)  # no byte left unwritten
    layout.fill(buffer, num_slots, NUM_ERROR_KINDS)
    return buffer.numpy().tobytes()


def assert_same_layout(lib, case: BatchCase, table: torch.Tensor | None, cp_rank: int = 0) -> None:
    reference, compiled = _layouts(lib, case, cp_rank, table, validate=table is not None)
    for name in ("num_entries", "region_slots", "own_slots", "gather_blocks", "pages_known", "bad_request"):
        assert getattr(compiled, name) == getattr(reference, name), (name, case)
    assert compiled.entry_starts == reference.entry_starts
    num_slots = round_dense_slots(reference.region_slots + reference.own_slots)
    assert compiled.stage_sizes(num_slots, NUM_ERROR_KINDS) == reference.stage_sizes(num_slots, NUM_ERROR_KINDS)
    # The compiled staging reads the library's scratch of the last layout: staged before the next one is made.
    compiled_bytes = _staged(compiled, num_slots)
    assert compiled_bytes == _staged(reference, num_slots), case


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_stage_the_same_bytes_on_every_rank(lib, seed):
    """Sharing at a position, partial pages, CURRENT_REUSE, colliding ids, zero-history requests; cp 1-8."""
    rng = random.Random(seed)
    for _ in range(60):
        case = random_case(rng, max_requests=8, max_cp=8, page_sizes=(1, 2, 4, 64))
        table = padded_page_table(case, max(len(t) for t in case.page_tables))
        for cp_rank in range(case.cp_size):
            assert_same_layout(lib, case, table, cp_rank)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16])
def test_the_page_table_dtypes(lib, dtype):
    case = random_case(random.Random(7), max_requests=8, max_cp=1, page_sizes=(4,))
    table = padded_page_table(case, max(len(t) for t in case.page_tables)).to(dtype)
    assert_same_layout(lib, case, table)


@pytest.mark.parametrize("cp_size", [1, 2, 8])
@pytest.mark.parametrize("shared_pages", [0, 40])
def test_large_batches(lib, cp_size, shared_pages):
    """64 requests of up to 150 pages of 64 tokens over a pool they fill (ids from the whole pool), with and without
    a shared prompt: the sizes the benchmarks time."""
    gen = torch.Generator().manual_seed(cp_size * 100 + shared_pages)
    case = sparse_case(64, 64, 10_000, 150, gen, shared_pages=tuple(range(1, shared_pages + 1))).on_cp(cp_size)
    table = padded_page_table(case, 150)
    for cp_rank in sorted({0, cp_size - 1}):
        assert_same_layout(lib, case, table, cp_rank)


def test_page_ids_not_on_the_host(lib):
    """A device table without history: the ids stay on the device, every entry its own slot, the cells staged."""
    case = BatchCase(4, 64, ((3, 9), (9,), (20, 21, 22)), (0, 0, 0), (5, 2, 9))
    assert_same_layout(lib, case, None)


def test_a_width_past_the_entries_and_a_strided_table(lib):
    case = random_case(random.Random(3), max_requests=6, max_cp=2, page_sizes=(2,))
    wide = padded_page_table(case, 12)
    strided = torch.full((case.num_requests, 24), -1, dtype=torch.int64)[:, ::2]
    strided.copy_(wide)
    assert not strided.is_contiguous()
    for cp_rank in range(case.cp_size):
        assert_same_layout(lib, case, strided, cp_rank)


@pytest.mark.parametrize(
    "tables, message",
    [
        (((70, 1), (2, 3)), r"request 0: page ids outside \[0, capacity=64\) at page index/value \[\(0, 70\)\]"),
        (((2, 3), (5, 5)), r"request 1: page ids \[5\] appear twice"),
        (((2, 3), (-1, 1)), r"request 1: page ids outside"),
    ],
)
def test_a_bad_host_id_is_named_as_the_reference_names_it(lib, tables, message):
    case = BatchCase(4, 64, tables, (4, 4), (4, 4))
    reference_args = (case, 0, padded_page_table(case, 2))
    with pytest.raises(CpSharedKvError, match=message):
        _layouts(lib, *reference_args)
    with pytest.raises(CpSharedKvError, match=message):
        host_plan(case, 0)
    compiled = _layouts(lib, case, 0, padded_page_table(case, 2), validate=False)[1]
    assert compiled.bad_request is None  # validation only where asked (a device table's ids are counted on the device)


def test_a_layout_staged_after_the_next_one_is_refused(lib):
    """The staging reads the library's per-thread scratch of the last layout: staging an earlier one is an error,
    never another batch's values."""
    first, second = (BatchCase(4, 64, ((3, 9),), (4,), (n,)) for n in (3, 4))
    earlier = _layouts(lib, first, 0, padded_page_table(first, 2))[1]
    later = _layouts(lib, second, 0, padded_page_table(second, 2))[1]
    num_slots = round_dense_slots(earlier.region_slots + earlier.own_slots)
    with pytest.raises(RuntimeError, match="staged after another layout was made"):
        _staged(earlier, num_slots)
    assert _staged(later, num_slots)  # the last layout still stages


def test_the_build_names_the_library_by_its_source_and_removes_other_builds():
    """A build from other sources is never loaded (its name differs) and a rebuild leaves only its own library."""
    from sglang_cpkv.runtime import host_layout_build

    stale = host_layout_build.prebuilt_dir() / "libsglang_cpkv_plan_layout-0000000000000000.so"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"not a library")
    built = host_layout_build.build()
    assert built.name == host_layout_build.library_name() and built.is_file()
    assert sorted(host_layout_build.prebuilt_dir().glob("libsglang_cpkv_plan_layout-*.so")) == [built]


def _plan_values(p) -> dict:
    values = {}
    for name, value in vars(p).items():
        if isinstance(value, torch.Tensor):
            values[name] = value.tolist()
        elif isinstance(value, (int, tuple, bool)):
            values[name] = value
    values["inverse"] = (p.inverse.table_size, p.inverse.held_entries())
    return values


def test_whole_plans_are_the_same_built_either_way(lib, monkeypatch):
    rng = random.Random(11)
    cases = [random_case(rng, max_requests=8, max_cp=4, page_sizes=(1, 4)) for _ in range(40)]
    compiled = [_plan_values(host_plan(case, rank)) for case in cases for rank in range(case.cp_size)]
    monkeypatch.setattr(host_layout, "library", lambda: None)
    reference = [_plan_values(host_plan(case, rank)) for case in cases for rank in range(case.cp_size)]
    assert compiled == reference


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

"""Quick timing of the CUDA CP shared-KV ops against plain torch and the device-to-device copy roofline (one GPU).

Providers: ``cuda`` (sglang_cpkv.ops.cuda), and the best plain-torch formulation of the same operation
(``index_select`` for page gathers; ``index_put``, ``index_copy`` and per-request contiguous ``copy_`` for the fill;
vectorized gather for remap; ``full`` + ``index_put`` for the inverse). Every figure is the median of >= 10 CUDA-event
timings after warm-up; bandwidth counts bytes read plus bytes written; "of copy" is the fraction of the measured
>= 1 GiB device-to-device copy. Small ops are also timed by CUDA-graph replay (launch overhead removed).

    PYTHONPATH=python python sgl-kernel/benchmark/bench_cp_shared_kv_cuda.py [--json OUT.json]

The cross-backend benchmark (torch / Triton / CUDA) of issue #8 is ``benchmark/``; this one checks the CUDA kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from sglang_cpkv.ops import cuda, reference
from sglang_cpkv.ops.errors import new_error_counter

PAGE_SIZE = 64
CAPACITY = 40960  # pool pages (the pool of 40K pages)
REQUESTS = 8
ROW_LAYOUTS = {"fp8_packed": (torch.uint8, 656), "bf16": (torch.bfloat16, 576)}
REPS = 20


def median_ms(fn, reps: int = REPS, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_median_ms(fn, calls: int = 50, reps: int = REPS) -> float:
    """Median time of one call, from replays of a graph holding ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_ms(graph.replay, reps) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every row as JSON here")
    args = parser.parse_args()
    if not cuda.is_available():
        print(f"CUDA ops unavailable: {cuda.unavailable_reason()}")
        return 1
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list[dict] = []

    def report(op: str, case: str, provider: str, ms: float, nbytes: int | None, roofline: float | None) -> None:
        gbs = nbytes / ms / 1e6 if nbytes else None
        rows.append({"op": op, "case": case, "provider": provider, "us": ms * 1e3, "GB/s": gbs, "of_copy": gbs / roofline if gbs and roofline else None})
        frac = f"{gbs / roofline:6.1%}" if gbs and roofline else "      "
        rate = f"{gbs:8.0f} GB/s" if gbs else " " * 13
        print(f"{op:22s} {case:34s} {provider:22s} {ms * 1e3:10.1f} us {rate} {frac}", flush=True)

    # Roofline: a 2 GiB device-to-device copy.
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    big_out = torch.empty_like(big)
    ms = median_ms(lambda: big_out.copy_(big))
    roofline = 2 * big.numel() / ms / 1e6
    report("d2d_copy", "2 GiB", "torch copy_", ms, 2 * big.numel(), roofline)
    del big, big_out

    errors = new_error_counter(dev)
    for layout, (dtype, width) in ROW_LAYOUTS.items():
        row_bytes = width * torch.empty((), dtype=dtype).element_size()
        pool = torch.randint(0, 256, (CAPACITY, PAGE_SIZE * row_bytes), dtype=torch.uint8, device=dev, generator=gen).view(dtype)
        for tokens in (8192, 65536):
            pages = REQUESTS * tokens // PAGE_SIZE
            case = f"{layout} {REQUESTS}x{tokens // 1024}K tok"
            src_page = torch.randperm(CAPACITY, device=dev, generator=gen)[:pages].to(torch.int32)
            dst_page = torch.arange(pages, dtype=torch.int32, device=dev)
            dense = torch.empty((pages, pool.shape[1]), dtype=dtype, device=dev)
            nbytes = 2 * pages * PAGE_SIZE * row_bytes
            report("copy_pages", case, "cuda", median_ms(lambda: cuda.copy_pages(pool, src_page, dense, dst_page, errors)), nbytes, roofline)
            report("copy_pages", case, "torch index_select", median_ms(lambda: torch.index_select(pool, 0, src_page, out=dense)), nbytes, roofline)
            want = pool[src_page.long()]
            assert torch.equal(dense.view(torch.uint8), want.view(torch.uint8))

            # Fill: each request's current rows go to its own contiguous dense rows, after a partial history page.
            current = torch.randint(0, 256, (REQUESTS * tokens, row_bytes), dtype=torch.uint8, device=dev, generator=gen).view(dtype)
            dense_rows = dense.view(-1, width)
            per_request = dense_rows.shape[0] // REQUESTS
            offset = 37  # history tokens of the partial page
            starts = torch.arange(REQUESTS, device=dev) * per_request + offset
            fill_tokens = per_request - offset
            cur = current[: REQUESTS * fill_tokens]
            dst_loc = (starts[:, None] + torch.arange(fill_tokens, device=dev)).reshape(-1).to(torch.int32)
            dst_loc_long = dst_loc.long()
            nbytes = 2 * cur.shape[0] * row_bytes
            report("scatter_rows (fill)", case, "cuda", median_ms(lambda: cuda.scatter_rows(cur, dst_loc, dense_rows, errors)), nbytes, roofline)
            report("scatter_rows (fill)", case, "torch index_put_", median_ms(lambda: dense_rows.index_put_((dst_loc_long,), cur)), nbytes, roofline)
            report("scatter_rows (fill)", case, "torch index_copy_", median_ms(lambda: dense_rows.index_copy_(0, dst_loc_long, cur)), nbytes, roofline)

            def per_request_copy():
                for r in range(REQUESTS):
                    s = r * per_request + offset
                    dense_rows[s : s + fill_tokens].copy_(cur[r * fill_tokens : (r + 1) * fill_tokens])

            report("scatter_rows (fill)", case, "torch per-request copy_", median_ms(per_request_copy), nbytes, roofline)

            # Fused per-layer dense view vs the two launches (history pages, then current rows).
            nbytes = 2 * (pages * PAGE_SIZE + cur.shape[0]) * row_bytes

            def two_launches():
                cuda.copy_pages(pool, src_page, dense, dst_page, errors)
                cuda.scatter_rows(cur, dst_loc, dense_rows, errors)

            report("materialize+fill", case, "cuda two launches", median_ms(two_launches), nbytes, roofline)
            report("materialize+fill", case, "cuda fused", median_ms(lambda: cuda.materialize_and_fill(pool, src_page, dense, dst_page, cur, dst_loc, errors)), nbytes, roofline)
            report("materialize+fill", case, "cuda two launches graph", graph_median_ms(two_launches, calls=5), nbytes, roofline)
            report("materialize+fill", case, "cuda fused graph", graph_median_ms(lambda: cuda.materialize_and_fill(pool, src_page, dense, dst_page, cur, dst_loc, errors), calls=5), nbytes, roofline)
            del dense, current, cur, dense_rows, dst_loc, dst_loc_long, want
        del pool
        torch.cuda.empty_cache()

    # Remap 4096 x 2048 top-k locations (int32) through the per-request inverse.
    page_table = torch.stack([torch.randperm(CAPACITY, device=dev, generator=gen)[:2048] for _ in range(REQUESTS)]).to(torch.int32)
    inverse = cuda.build_page_inverse(page_table, CAPACITY, errors)
    req_id = torch.arange(4096, device=dev) * REQUESTS // 4096
    pick = torch.randint(0, 2048, (4096, 2048), device=dev, generator=gen)
    locs = (page_table.long()[req_id[:, None], pick] * PAGE_SIZE + torch.randint(0, PAGE_SIZE, (4096, 2048), device=dev, generator=gen)).to(torch.int32)
    locs[:, -100:] = -1
    nbytes = 2 * locs.numel() * 4

    def torch_remap():
        page = torch.div(locs, PAGE_SIZE, rounding_mode="floor").long()
        slot = inverse[(req_id[:, None] * CAPACITY + page).clamp_(min=0)]
        return torch.where((locs >= 0) & (slot >= 0), slot * PAGE_SIZE + locs % PAGE_SIZE, -1)

    got = cuda.remap_locs(locs, req_id, inverse, CAPACITY, PAGE_SIZE, errors)
    assert torch.equal(got, reference.remap_locs(locs, req_id, inverse, CAPACITY, PAGE_SIZE, new_error_counter(dev)))
    report("remap_locs", "4096x2048 int32, R=8", "cuda", median_ms(lambda: cuda.remap_locs(locs, req_id, inverse, CAPACITY, PAGE_SIZE, errors)), nbytes, roofline)
    report("remap_locs", "4096x2048 int32, R=8", "cuda graph", graph_median_ms(lambda: cuda.remap_locs(locs, req_id, inverse, CAPACITY, PAGE_SIZE, errors), calls=10), nbytes, roofline)
    report("remap_locs", "4096x2048 int32, R=8", "torch gather", median_ms(torch_remap), nbytes, roofline)
    # The one-element path (row base off a 16-byte boundary), for comparison with the 16-byte path above.
    locs_wide = torch.empty((4096, 2052), dtype=torch.int32, device=dev)
    locs_unaligned = locs_wide[:, 1:2049]
    locs_unaligned.copy_(locs)
    report("remap_locs", "4096x2048 int32, R=8", "cuda 1-element path", median_ms(lambda: cuda.remap_locs(locs_unaligned, req_id, inverse, CAPACITY, PAGE_SIZE, errors)), nbytes, roofline)

    # Inverse build per batch: P = 2048 pages (128K tokens) per request, C = 40960.
    for batch in (1, 2, 4, 8):
        table = page_table[:batch].contiguous()
        case = f"R={batch} P=2048 C={CAPACITY}"

        def torch_inverse():
            inv = torch.full((batch * CAPACITY,), -1, dtype=torch.int32, device=dev)
            flat = table.reshape(-1).long()
            slot = torch.arange(flat.numel(), device=dev)
            inv[slot // 2048 * CAPACITY + flat] = slot.to(torch.int32)
            return inv

        nbytes = batch * CAPACITY * 4
        report("build_page_inverse", case, "cuda", median_ms(lambda: cuda.build_page_inverse(table, CAPACITY, errors)), nbytes, None)
        report("build_page_inverse", case, "cuda graph", graph_median_ms(lambda: cuda.build_page_inverse(table, CAPACITY, errors)), nbytes, None)
        report("build_page_inverse", case, "torch full+index_put", median_ms(torch_inverse), nbytes, None)
        try:
            report("build_page_inverse", case, "torch graph", graph_median_ms(torch_inverse), nbytes, None)
        except RuntimeError as exc:  # a torch formulation that cannot be captured is reported, not fatal
            print(f"build_page_inverse {case} torch graph: capture failed: {exc}")
    assert errors.tolist() == [0, 0, 0], errors.tolist()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

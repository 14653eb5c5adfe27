"""Probe: can the copy engines hide the layer-ahead history copy at cp 1 that the SM copy kernel does not?

At cp 1 the mode copies every history page of the batch into the dense view each layer (8 x 32K rows x 656 bytes =
172 MB read and written at the deployed shape), about 1.6% of a ``flashmla_kv`` FP8 forward. This probe runs
``bench_kit_layer.measure`` (upstream's kit, mode off / layer-ahead / synchronous taking turns) three times in one
process: with the mode's own ``copy_pages`` kernel, and with the layer-ahead side stream's page copies replaced by one
``cudaMemcpyBatchAsync`` per call (runs of consecutive pages and slots coalesced), with and without
``cudaMemcpyFlagPreferOverlapWithCompute``. The synchronous configuration is the same in all three (its fused kernel
is not replaced): it shows the drift between the blocks.

A probe, not a data path: the replacement reads the page ids on the host once per plan tensor and caches them by
address (every timed forward of one configuration plans the same batch), counts no bad ids, and assumes pages are
rows of contiguous bytes. ``--contiguous`` gives each request consecutive pages (what a fresh allocator hands out)
instead of the bench's random pages (every run one page: 4,096 copies per call at 8 x 32K).

    python benchmark/probe_history_copy_engine.py --history 32768 [--contiguous] --out probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kit_layer

from sglang_cpkv import ops
from sglang_cpkv.testing import dsa_kit

# cudaMemcpyAttributes: srcAccessOrder, srcLocHint {type, id}, dstLocHint {type, id}, flags (six 32-bit fields).
_ACCESS_ORDER_STREAM = 1
_LOCATION_DEVICE = 1
_PREFER_OVERLAP_WITH_COMPUTE = 1
VARIANTS = (
    ("sm kernel", None),
    ("copy engine, prefer overlap", _PREFER_OVERLAP_WITH_COMPUTE),
    ("copy engine, default", 0),
)


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (the same library instance, so its context and streams)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                lib = ctypes.CDLL(line.split()[-1])
                fn = lib.cudaMemcpyBatchAsync
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_size_t] + [ctypes.c_void_p] * 2
                fn.argtypes += [ctypes.c_size_t, ctypes.c_void_p]
                return lib
    raise SystemExit("libcudart is not loaded in this process")


class CopyEngineCopies:
    """``ops.copy_pages`` on a side stream as one batched copy-engine call; elsewhere the mode's kernel."""

    def __init__(self) -> None:
        self.batch = _cudart().cudaMemcpyBatchAsync
        self.kernel = ops.copy_pages
        self.flags: int | None = None  # None: the mode's kernel everywhere
        self.host_pages: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.host_us: list[float] = []
        self.runs: list[int] = []

    def __call__(self, src, src_page, dst, dst_page, errors) -> None:
        stream = torch.cuda.current_stream()
        if self.flags is None or stream.cuda_stream == torch.cuda.default_stream().cuda_stream:
            return self.kernel(src, src_page, dst, dst_page, errors)
        start = time.perf_counter()
        key = (src_page.data_ptr(), dst_page.data_ptr(), src_page.numel())
        if key not in self.host_pages:
            self.host_pages[key] = (src_page.cpu().numpy().astype(np.int64), dst_page.cpu().numpy().astype(np.int64))
        sp, dp = self.host_pages[key]
        if len(sp) == 0:
            return None
        breaks = np.flatnonzero((np.diff(sp) != 1) | (np.diff(dp) != 1)) + 1
        first = np.concatenate([[0], breaks])
        pages = np.diff(np.concatenate([first, [len(sp)]]))
        item = src.element_size()
        page_bytes = src[0].numel() * item
        srcs = (src.data_ptr() + sp[first] * (src.stride(0) * item)).astype(np.uint64)
        dsts = (dst.data_ptr() + dp[first] * (dst.stride(0) * item)).astype(np.uint64)
        sizes = (pages * page_bytes).astype(np.uint64)
        attrs = (ctypes.c_int * 6)(
            _ACCESS_ORDER_STREAM, _LOCATION_DEVICE, src.device.index, _LOCATION_DEVICE, dst.device.index, self.flags
        )
        first_copy = (ctypes.c_size_t * 1)(0)
        rc = self.batch(
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            len(first),
            attrs,
            first_copy,
            1,
            ctypes.c_void_p(stream.cuda_stream),
        )
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync returned {rc}")
        self.host_us.append((time.perf_counter() - start) * 1e6)
        self.runs.append(len(first))
        return None


def _contiguous_tables(lengths, capacity: int, seed: int, cp_size: int = 1) -> tuple[tuple[int, ...], ...]:
    out, page = [], cp_size
    for n in lengths:
        count = -(-n // dsa_kit.PAGE)
        out.append(tuple(range(page, page + count)))
        page += count
    return tuple(out)


def _check_equal(copies: CopyEngineCopies) -> bool:
    """The batched copy writes the same view as the mode's kernel (random pages into random slots)."""
    pool = torch.randint(0, 255, (1000, 64 * 656), dtype=torch.uint8, device="cuda")
    pages = torch.randperm(999, device="cuda")[:700].add(1).int()
    slots = torch.randperm(800, device="cuda")[:700].int()
    errors = ops.new_error_counter(pool.device)
    want = torch.zeros(800, 64 * 656, dtype=torch.uint8, device="cuda")
    got = want.clone()
    copies.kernel(pool, pages, want, slots, errors)
    copies.flags = _PREFER_OVERLAP_WITH_COMPUTE
    with torch.cuda.stream(torch.cuda.Stream()):
        copies(pool, pages, got, slots, errors)
    torch.cuda.synchronize()
    return bool(torch.equal(want, got))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, default=32768)
    parser.add_argument("--contiguous", action="store_true", help="consecutive pages per request")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    copies = CopyEngineCopies()
    ops.copy_pages = copies
    if args.contiguous:
        bench_kit_layer.distinct_page_tables = _contiguous_tables
    bench = SimpleNamespace(
        backend="flashmla_kv",
        fp8=True,
        heads=64,
        topk=2048,
        requests=8,
        history=[args.history],
        extend=1024,
        sharing=["distinct"],
        layers=6,
        reps=args.reps,
        cp=1,
        model_layers=78,
        profile=False,
    )
    out: dict = {"args": vars(args), "device": torch.cuda.get_device_name(), "variants": {}}
    for name, flags in VARIANTS:
        copies.flags, copies.host_us, copies.runs = flags, [], []
        figures = {}
        for row in bench_kit_layer.measure(bench):
            rounds = row["rounds"]
            forwards = [plan + first + (bench.model_layers - 1) * later for plan, first, later in rounds]
            figures[row["config"]] = {
                "later_layer_ms": statistics.median(later for *_, later in rounds),
                "forward_ms": statistics.median(forwards),
            }
        off = figures["mode off"]
        for fig in figures.values():
            fig["later_vs_off"] = fig["later_layer_ms"] / off["later_layer_ms"]
            fig["forward_vs_off"] = fig["forward_ms"] / off["forward_ms"]
        figures["host_us_per_call"] = statistics.median(copies.host_us) if copies.host_us else None
        figures["copies_per_call"] = statistics.median(copies.runs) if copies.runs else None
        out["variants"][name] = figures
        print(name, json.dumps(figures), flush=True)
    out["copy_engine_equals_kernel"] = _check_equal(copies)
    print("copy engine == kernel:", out["copy_engine_equals_kernel"])
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

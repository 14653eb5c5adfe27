#!/usr/bin/env python3
"""Benchmark of the CP shared-KV ops on one GPU, in one run.

    PYTHONPATH=python python benchmark/bench_cp_shared_kv_ops.py --out bench.json

What it measures, in order (issue #8, contract "Measuring"):

1. **Roofline**: device-to-device copy of >= 1 GiB (``--copy-gib``), bytes read + written: the best
   of one ``copy_`` of the whole buffer and of its 8 and 64 slices (see :meth:`Bench.copy_bandwidth`).
2. **Each op per provider** at serving sizes, page size 64:
   * ``copy_pages`` (materialize history): 8 requests x 8K..128K tokens, pages drawn sparsely from
     a 40K-page pool, 656-byte packed FP8 rows (uint8) and 1152-byte bf16 rows;
   * ``scatter_rows`` (fill current KV into each request's dense slots): 8 requests x 8K..128K
     current tokens starting mid-page, both row layouts, int32 dense locations;
   * ``remap_locs``: 4096 x 2048 int32 top-k locations (and the current tokens' int32 locations),
     bs 8 inverse over a 40K-page pool;
   * ``build_page_inverse``: bs 1..8, 2048 pages per request, 40K-page pool.
   Providers: ``torch_ref`` (:mod:`sglang_cpkv.ops.reference`, clarity first, synchronizes),
   ``torch_best`` (the best plain-torch formulation of the same op, never a loop over rows:
   ``index_select(out=)`` for the page gather; ``index_put_``, ``index_copy_`` and a per-request
   contiguous ``copy_`` for the fill; a ``torch.where`` gather for remap; ``full(-1)`` +
   ``index_put_`` for the inverse), ``triton`` (auto knobs, plus a few knob variants at the largest
   size, named ``triton[knobs]``) and ``cuda`` (:mod:`sglang_cpkv.ops.cuda`, when built; its fused
   ``materialize_and_fill`` too). Every provider's output is checked byte-equal with ``torch_best``.
3. **Plan build** at bs 1..8 (:func:`sglang_cpkv.runtime.plan.build_plan`, host wall clock to a
   device sync), when that module is present.
4. **No host sync**: one layer's op sequence through the dispatcher, run eagerly under
   ``torch.cuda.set_sync_debug_mode("error")``, captured in a CUDA graph, replayed and compared.

Timing: warm-up, then a CUDA graph holding ``inner`` calls (enough for ~2 ms) is replayed ``--reps``
times between CUDA events; time per call = median replay / ``inner``. ``torch_ref`` synchronizes
(boolean-mask indexing), so it is timed eagerly: events around each call, median. GB/s counts the
fewest bytes the op must move (each input read once, each output written once); ``frac`` is that
over the measured copy bandwidth.

``--smoke`` runs every step at tiny sizes (CPU tensors use the Triton interpreter and a wall clock):
a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

# Issue #8's targets, reported next to the figures.
TARGETS = {
    "copy_pages": "triton/cuda >= 0.90 of copy bandwidth at >= 64K tokens/request, never slower than index_select",
    "scatter_rows": ">= 0.85 of copy bandwidth at >= 64K current tokens/request",
    "remap_locs": "4096 x 2048 int32 top-k <= 60 us",
    "build_page_inverse": "<= 8 us at bs <= 8",
}
ROW_BYTES = {"fp8_packed": 656, "bf16": 1152}
PAGE_SIZE = 64
POOL_PAGES = 40960
BATCH = 8


class Timer:
    """Per-call device time of a callable: graph replay between CUDA events on a GPU, a wall clock on CPU."""

    def __init__(self, device: torch.device, reps: int, target_ms: float = 2.0):
        self.device, self.reps, self.target_ms = device, reps, target_ms
        self.cuda = device.type == "cuda"

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def eager(self, fn) -> float:
        """Median microseconds of ``fn()`` timed call by call (for ops that synchronize)."""
        fn()
        self._sync()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def graph(self, fn) -> float:
        """Median microseconds per call of ``fn()`` from CUDA-graph replays (no launch gaps)."""
        if not self.cuda:
            return self.eager(fn)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (Triton compiles here) off the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        single = self.eager(fn)
        inner = max(1, min(200, math.ceil(self.target_ms * 1e3 / max(single, 1e-3))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        graph.replay()
        self._sync()
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / inner)
        del graph
        return statistics.median(times)


class Bench:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.timer = Timer(self.device, args.reps)
        self.records: list[dict] = []
        self.copy_gbps: float | None = None
        self.errors: list[str] = []
        from sglang_cpkv.ops import errors as err_mod
        from sglang_cpkv.ops import reference
        from sglang_cpkv.ops import triton as triton_ops

        self.reference, self.triton, self.new_errors = reference, triton_ops, err_mod.new_error_counter
        self.cuda = self._cuda_ops()

    def _cuda_ops(self):
        if self.device.type != "cuda":
            return None
        try:
            from sglang_cpkv.ops import cuda
        except ModuleNotFoundError as exc:
            print(f"# cuda provider: {exc}")
            return None
        if not cuda.is_available():
            print(f"# cuda provider unavailable: {cuda.unavailable_reason()}")
            return None
        return cuda

    def providers(self, op: str) -> list[tuple[str, object]]:
        found = [("triton", self.triton)]
        if self.cuda is not None:
            found.append(("cuda", self.cuda))
        return found

    def record(
        self,
        op: str,
        provider: str,
        params: dict,
        time_us: float | None,
        nbytes: int,
        *,
        verified: bool | None = None,
        note: str = "",
    ):
        rec = {"op": op, "provider": provider, **params, "time_us": time_us, "bytes": nbytes}
        if time_us:
            rec["gbps"] = nbytes / (time_us * 1e-6) / 1e9
            rec["frac_copy"] = rec["gbps"] / self.copy_gbps if self.copy_gbps else None
        if verified is not None:
            rec["verified"] = verified
        if note:
            rec["note"] = note
        self.records.append(rec)
        shape = " ".join(f"{k}={v}" for k, v in params.items())
        t = f"{time_us:10.2f}" if time_us else "       n/a"
        gbps = f"{rec.get('gbps', 0):9.1f}" if time_us else "      n/a"
        frac = f"{rec['frac_copy']:6.3f}" if time_us and rec.get("frac_copy") else "   n/a"
        ok = {True: "ok", False: "MISMATCH", None: ""}[verified]
        print(f"{op:20s} {provider:28s} {shape:44s} {t} us {gbps} GB/s {frac} {ok} {note}", flush=True)

    def measure(self, op, provider, params, fn, nbytes, *, check=None, eager=False):
        """Time ``fn`` and record it; a failure is recorded and reported, never fatal."""
        try:
            verified = check() if check is not None else None
            time_us = self.timer.eager(fn) if eager else self.timer.graph(fn)
            self.record(op, provider, params, time_us, nbytes, verified=verified)
        except Exception as exc:
            self.errors.append(f"{op} {provider} {params}: {exc!r}")
            self.record(op, provider, params, None, nbytes, note=f"FAILED: {exc!r}"[:200])
            traceback.print_exc()

    # -- roofline -----------------------------------------------------------------------------

    def copy_bandwidth(self):
        """The best of several contiguous device-to-device copies of the whole buffer.

        One ``copy_`` of 2 GiB captured in a graph measured 2773 GB/s on the H200 (2026-11-30) while
        eight ``copy_`` of 151 MB in the same run reached 4139 GB/s, so the roofline is the maximum
        over the whole buffer and its 8 and 64 equal slices (every variant moves all the bytes).
        """
        nbytes = int(self.args.copy_gib * (1 << 30)) // 64 * 64
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=self.device).view(torch.int64)
        dst = torch.empty_like(src)
        measured = []
        for slices in (1, 8, 64):
            pairs = list(zip(dst.chunk(slices), src.chunk(slices)))

            def copy(pairs=pairs):
                for d, s in pairs:
                    d.copy_(s)

            measured.append((f"torch copy_ {slices} slice{'s' if slices > 1 else ''}", self.timer.graph(copy)))
        self.copy_gbps = max(2 * nbytes / (t * 1e-6) / 1e9 for _, t in measured)
        for name, time_us in measured:
            self.record("copy_roofline", name, {"GiB": round(nbytes / (1 << 30), 3)}, time_us, 2 * nbytes)
        src = dst = None  # free before the next size

    # -- ops ----------------------------------------------------------------------------------

    def _rows(self, n_rows: int, layout: str) -> torch.Tensor:
        raw = torch.randint(0, 256, (n_rows, ROW_BYTES[layout]), dtype=torch.uint8, device=self.device)
        return raw.view(torch.bfloat16) if layout == "bf16" else raw

    def bench_copy_pages(self):
        gen = torch.Generator().manual_seed(1)
        for layout in ("fp8_packed", "bf16"):
            pool = self._rows(self.args.pool_pages * PAGE_SIZE, layout).view(self.args.pool_pages, -1)
            page_bytes = PAGE_SIZE * ROW_BYTES[layout]
            for tokens in self.args.tokens:
                n_pages = BATCH * tokens // PAGE_SIZE
                src_page = torch.randperm(self.args.pool_pages, generator=gen)[:n_pages].to(torch.int32).to(self.device)
                dst_page = torch.arange(n_pages, dtype=torch.int32, device=self.device)
                dense = torch.empty(n_pages, pool.shape[1], dtype=pool.dtype, device=self.device)
                params = {"layout": layout, "tokens_per_req": tokens, "pages": n_pages}
                nbytes = 2 * n_pages * page_bytes
                errors = self.new_errors(self.device)
                expected = torch.index_select(pool, 0, src_page)

                def same():
                    return torch.equal(dense.view(torch.uint8), expected.view(torch.uint8))

                def run_and_check(fn):
                    def check():
                        dense.zero_()
                        fn()
                        return same()

                    return check

                ref = lambda: self.reference.copy_pages(pool, src_page, dense, dst_page, errors)
                self.measure("copy_pages", "torch_ref", params, ref, nbytes, check=run_and_check(ref), eager=True)
                best = lambda: torch.index_select(pool, 0, src_page, out=dense)
                self.measure("copy_pages", "torch_best index_select", params, best, nbytes, check=run_and_check(best))
                for name, impl in self.providers("copy_pages"):
                    fn = lambda impl=impl: impl.copy_pages(pool, src_page, dense, dst_page, errors)
                    self.measure("copy_pages", name, params, fn, nbytes, check=run_and_check(fn))
                if tokens == max(self.args.tokens):
                    for block_words, num_warps in ((1024, 4), (2048, 8), (256, 4)):
                        fn = lambda b=block_words, w=num_warps: self.triton.copy_pages(
                            pool, src_page, dense, dst_page, errors, block_words=b, num_warps=w
                        )
                        self.measure(
                            "copy_pages",
                            f"triton[bw={block_words},nw={num_warps}]",
                            params,
                            fn,
                            nbytes,
                            check=run_and_check(fn),
                        )
                dense = expected = None  # free before the next size
            pool = None

    def bench_scatter_rows(self):
        gen = torch.Generator().manual_seed(2)
        for layout in ("fp8_packed", "bf16"):
            for tokens in self.args.tokens:
                offsets = torch.randint(0, PAGE_SIZE, (BATCH,), generator=gen).tolist()
                pages = max(-(-(o + tokens) // PAGE_SIZE) for o in offsets)
                span = pages * PAGE_SIZE
                starts = [r * span + offsets[r] for r in range(BATCH)]
                loc = torch.cat([torch.arange(s, s + tokens) for s in starts]).to(torch.int32).to(self.device)
                loc64 = loc.to(torch.int64)
                src = self._rows(BATCH * tokens, layout)
                dst = torch.empty(BATCH * span, src.shape[1], dtype=src.dtype, device=self.device)
                params = {"layout": layout, "tokens_per_req": tokens}
                nbytes = 2 * src.numel() * src.element_size()
                errors = self.new_errors(self.device)

                def check_of(fn):
                    def check():
                        dst.zero_()
                        fn()
                        return torch.equal(dst[loc64].view(torch.uint8), src.view(torch.uint8))

                    return check

                def per_request_copy():
                    for r, s in enumerate(starts):
                        dst[s : s + tokens].copy_(src[r * tokens : (r + 1) * tokens])

                candidates = [
                    ("torch_ref", lambda: self.reference.scatter_rows(src, loc, dst, errors), True),
                    ("torch_best index_put_", lambda: dst.index_put_((loc64,), src), False),
                    ("torch_best index_copy_", lambda: dst.index_copy_(0, loc64, src), False),
                    ("torch_best per-request copy_", per_request_copy, False),
                ]
                candidates += [
                    (name, lambda impl=impl: impl.scatter_rows(src, loc, dst, errors), False)
                    for name, impl in self.providers("scatter_rows")
                ]
                if tokens == max(self.args.tokens):
                    for block_rows, num_warps in ((16, 4), (32, 8), (4, 4)):
                        fn = lambda b=block_rows, w=num_warps: self.triton.scatter_rows(
                            src, loc, dst, errors, block_rows=b, num_warps=w
                        )
                        candidates.append((f"triton[br={block_rows},nw={num_warps}]", fn, False))
                for name, fn, eager in candidates:
                    self.measure("scatter_rows", name, params, fn, nbytes, check=check_of(fn), eager=eager)
                src = dst = None  # free before the next size

    def _inverse(self, rows: int, pages_per_request: int, gen: torch.Generator):
        """A ``[rows, P]`` table of distinct pages per request (the ragged layout of full requests: slots r*P+j)."""
        table = torch.stack(
            [torch.randperm(self.args.pool_pages, generator=gen)[:pages_per_request] for _ in range(rows)]
        ).to(torch.int32)
        return table.to(self.device)

    def bench_remap(self):
        from sglang_cpkv.testing.batches import inverse_table

        gen = torch.Generator().manual_seed(3)
        capacity, ppr = self.args.pool_pages, self.args.pages_per_request
        table = self._inverse(BATCH, ppr, gen)
        inverse = self.reference.build_page_inverse(*_slots(table), BATCH, capacity, self.new_errors(self.device))
        table_form = inverse_table(inverse)
        n, k = self.args.topk
        req = torch.randint(0, BATCH, (n,), generator=gen)
        j = torch.randint(0, ppr, (n, k), generator=gen)
        topk = table.cpu()[req[:, None], j].to(torch.int64) * PAGE_SIZE + torch.randint(
            0, PAGE_SIZE, (n, k), generator=gen
        )
        topk[torch.rand(n, k, generator=gen) < 0.05] = -1
        cur_tokens = BATCH * max(self.args.tokens) // 2
        cur_req = torch.arange(BATCH).repeat_interleave(cur_tokens // BATCH)
        cur_j = torch.randint(0, ppr, (cur_tokens,), generator=gen)
        cur = table.cpu()[cur_req, cur_j].to(torch.int64) * PAGE_SIZE + torch.randint(
            0, PAGE_SIZE, (cur_tokens,), generator=gen
        )
        for what, locs, req_id in (("topk", topk, req), ("current", cur, cur_req)):
            locs = locs.to(torch.int32).to(self.device)
            req_id = req_id.to(self.device)
            params = {"locs": what, "shape": "x".join(map(str, locs.shape)), "dtype": "int32"}
            nbytes = 2 * locs.numel() * 4 + req_id.numel() * 8
            errors = self.new_errors(self.device)
            expected = self.reference.remap_locs(locs, req_id, inverse, PAGE_SIZE, errors)

            def best():
                # The lookup an R x C table allows (what the batch-sized inverse replaced): one gather.
                loc = locs.to(torch.int64)
                rq = req_id[:, None] if loc.dim() == 2 else req_id
                valid = (loc >= 0) & (rq >= 0)
                slot = table_form[
                    torch.where(valid, rq * capacity + torch.div(loc, PAGE_SIZE, rounding_mode="floor"), 0)
                ]
                return torch.where(valid & (slot >= 0), slot.to(torch.int64) * PAGE_SIZE + loc % PAGE_SIZE, -1).to(
                    torch.int32
                )

            candidates = [
                (
                    "torch_ref",
                    lambda: self.reference.remap_locs(locs, req_id, inverse, PAGE_SIZE, errors),
                    True,
                ),
                ("torch R x C table gather+where", best, False),
            ]
            candidates += [
                (
                    name,
                    lambda impl=impl: impl.remap_locs(locs, req_id, inverse, PAGE_SIZE, errors),
                    False,
                )
                for name, impl in self.providers("remap_locs")
            ]
            if what == "topk":
                for bn, bk, nw in ((8, 512, 4), (4, 1024, 8), (16, 256, 4)):
                    fn = lambda bn=bn, bk=bk, nw=nw: self.triton.remap_locs(
                        locs, req_id, inverse, PAGE_SIZE, errors, block_n=bn, block_k=bk, num_warps=nw
                    )
                    candidates.append((f"triton[bn={bn},bk={bk},nw={nw}]", fn, False))
            for name, fn, eager in candidates:
                self.measure(
                    "remap_locs", name, params, fn, nbytes, check=lambda fn=fn: torch.equal(fn(), expected), eager=eager
                )

    def bench_build_inverse(self):
        from sglang_cpkv.ops.reference import PageInverse, inverse_bytes
        from sglang_cpkv.testing.batches import inverse_table

        gen = torch.Generator().manual_seed(4)
        capacity, ppr = self.args.pool_pages, self.args.pages_per_request
        for rows in range(1, BATCH + 1):
            table = self._inverse(rows, ppr, gen)
            params = {"bs": rows, "capacity": capacity, "pages_per_req": ppr}
            # The entries read (page id, request, slot) and the table written (its fill and the inserted cells).
            nbytes = table.numel() * (4 + 8 + 4) + inverse_bytes(table.numel())
            errors = self.new_errors(self.device)
            entry_pages, entry_req = _slots(table)
            entry_slots = torch.arange(entry_pages.numel(), dtype=torch.int32, device=self.device)
            expected = self.reference.build_page_inverse(entry_pages, entry_req, rows, capacity, errors, entry_slots)
            flat = table.view(-1).to(torch.int64)
            target = torch.where(
                flat >= 0,
                torch.arange(rows, device=self.device).repeat_interleave(ppr) * capacity + flat,
                rows * capacity,
            )

            def best():
                # The R x C table (what the batch-sized inverse replaced): a fill and one scatter.
                inv = torch.full((rows * capacity + 1,), -1, dtype=torch.int32, device=self.device)
                inv.index_put_((target,), entry_slots)
                return inv[:-1]

            expected_table = inverse_table(expected)

            def same(out, expected=expected, expected_table=expected_table):
                # Cells depend on the insertion order: compare what every lookup finds.
                return torch.equal(inverse_table(out) if isinstance(out, PageInverse) else out, expected_table)

            candidates = [
                (
                    "torch_ref",
                    lambda: self.reference.build_page_inverse(
                        entry_pages, entry_req, rows, capacity, errors, entry_slots
                    ),
                    True,
                ),
                ("torch R x C table full+index_put_", best, False),
            ]
            candidates += [
                (
                    name,
                    lambda impl=impl: impl.build_page_inverse(
                        entry_pages, entry_req, rows, capacity, errors, entry_slots
                    ),
                    False,
                )
                for name, impl in self.providers("build_page_inverse")
            ]
            if rows == BATCH:
                for block in (1024, 4096):
                    candidates.append(
                        (
                            f"triton[block={block}]",
                            lambda block=block: self.triton.build_page_inverse(
                                entry_pages, entry_req, rows, capacity, errors, entry_slots, block=block
                            ),
                            False,
                        )
                    )
            for name, fn, eager in candidates:
                self.measure(
                    "build_page_inverse",
                    name,
                    params,
                    fn,
                    nbytes,
                    check=lambda fn=fn: same(fn()),
                    eager=eager,
                )

    def bench_fused(self):
        """CUDA's fused materialize + fill against its two launches (when the CUDA ops are built)."""
        if self.cuda is None or not hasattr(self.cuda, "materialize_and_fill"):
            return
        gen = torch.Generator().manual_seed(5)
        layout, tokens = "fp8_packed", max(self.args.tokens)
        pool = self._rows(self.args.pool_pages * PAGE_SIZE, layout).view(self.args.pool_pages, -1)
        hist_pages = BATCH * tokens // PAGE_SIZE // 2
        src_page = torch.randperm(self.args.pool_pages, generator=gen)[:hist_pages].to(torch.int32).to(self.device)
        dense = torch.empty(2 * hist_pages, pool.shape[1], dtype=pool.dtype, device=self.device)
        dst_page = torch.arange(hist_pages, dtype=torch.int32, device=self.device)
        current = self._rows(hist_pages * PAGE_SIZE, layout)
        dst_loc = torch.arange(
            hist_pages * PAGE_SIZE, 2 * hist_pages * PAGE_SIZE, dtype=torch.int32, device=self.device
        )
        errors = self.new_errors(self.device)
        params = {"layout": layout, "hist_pages": hist_pages, "cur_rows": current.shape[0]}
        nbytes = 2 * (hist_pages * pool.shape[1] + current.numel())

        def two(impl):
            impl.copy_pages(pool, src_page, dense, dst_page, errors)
            impl.scatter_rows(current, dst_loc, dense.view(-1, ROW_BYTES[layout]), errors)

        self.measure("materialize+fill", "cuda two launches", params, lambda: two(self.cuda), nbytes)
        self.measure(
            "materialize+fill",
            "cuda materialize_and_fill",
            params,
            lambda: self.cuda.materialize_and_fill(pool, src_page, dense, dst_page, current, dst_loc, errors),
            nbytes,
        )
        self.measure("materialize+fill", "triton two launches", params, lambda: two(self.triton), nbytes)

    # -- plan build ---------------------------------------------------------------------------

    def bench_plan(self):
        try:
            from sglang_cpkv.runtime import build_cp_split, build_plan
        except ImportError as exc:
            print(f"# plan build skipped: {exc}")
            return
        gen = torch.Generator().manual_seed(6)
        prefix, extend = self.args.plan_prefix, self.args.plan_extend
        pages = -(-(prefix + extend) // PAGE_SIZE)
        for rows in range(1, BATCH + 1):
            table = torch.stack([torch.randperm(self.args.pool_pages, generator=gen)[:pages] for _ in range(rows)]).to(
                torch.int32
            )
            pos = torch.arange(prefix, prefix + extend)
            out_cache_loc = torch.cat(
                [table[r, pos // PAGE_SIZE].to(torch.int64) * PAGE_SIZE + pos % PAGE_SIZE for r in range(rows)]
            ).to(self.device)
            params = {"bs": rows, "prefix": prefix, "extend": extend}

            def build():
                return build_plan(
                    table,
                    [prefix] * rows,
                    [extend] * rows,
                    out_cache_loc,
                    capacity=self.args.pool_pages,
                    page_size=PAGE_SIZE,
                    split=build_cp_split("interleave", [extend] * rows, 1, 0),
                )

            try:
                build()
                times = []
                for _ in range(self.args.reps):
                    self.timer._sync()
                    t0 = time.perf_counter()
                    build()
                    self.timer._sync()
                    times.append((time.perf_counter() - t0) * 1e6)
                self.record("build_plan", "host wall clock", params, statistics.median(times), 0)
            except Exception as exc:
                self.errors.append(f"build_plan {params}: {exc!r}")
                self.record("build_plan", "host wall clock", params, None, 0, note=f"FAILED: {exc!r}"[:200])

    # -- no host sync -------------------------------------------------------------------------

    def graph_capture(self):
        """One layer's ops through the dispatcher: eager under sync-debug "error", then captured and replayed."""
        from sglang_cpkv import ops

        gen = torch.Generator().manual_seed(7)
        layout, hist_tokens = "fp8_packed", max(PAGE_SIZE, max(self.args.tokens) // 8 // PAGE_SIZE * PAGE_SIZE)
        cur_tokens = hist_tokens // 4
        capacity, ppr = self.args.pool_pages, -(-(hist_tokens + cur_tokens) // PAGE_SIZE)
        table = self._inverse(BATCH, ppr, gen)
        pool = self._rows(capacity * PAGE_SIZE, layout).view(capacity, -1)
        hist_pages = hist_tokens // PAGE_SIZE
        src_page = table[:, :hist_pages].reshape(-1).contiguous()
        dst_page = (
            (torch.arange(BATCH, device=self.device)[:, None] * ppr + torch.arange(hist_pages, device=self.device))
            .reshape(-1)
            .to(torch.int32)
        )
        pos = torch.arange(hist_tokens, hist_tokens + cur_tokens, device=self.device)
        cur_loc = (table[:, pos // PAGE_SIZE].to(torch.int64) * PAGE_SIZE + pos % PAGE_SIZE).reshape(-1).to(torch.int32)
        cur_req = torch.arange(BATCH, device=self.device).repeat_interleave(cur_tokens)
        current = self._rows(BATCH * cur_tokens, layout)
        n, k = self.args.topk
        topk_req = torch.randint(0, BATCH, (n,), generator=gen).to(self.device)
        topk_page = table[topk_req[:, None], torch.randint(0, hist_pages, (n, k), generator=gen).to(self.device)]
        topk = (
            topk_page.to(torch.int64) * PAGE_SIZE + torch.randint(0, PAGE_SIZE, (n, k), generator=gen).to(self.device)
        ).to(torch.int32)
        dense = torch.zeros(BATCH * ppr, pool.shape[1], dtype=pool.dtype, device=self.device)
        errors = self.new_errors(self.device)
        inverse = self.reference.build_page_inverse(*_slots(table), BATCH, capacity, errors)
        outputs = {}

        def layer():
            ops.copy_pages(pool, src_page, dense, dst_page, errors)
            dense_loc = ops.remap_locs(cur_loc, cur_req, inverse, PAGE_SIZE, errors)
            ops.scatter_rows(current, dense_loc, dense.view(-1, ROW_BYTES[layout]), errors)
            outputs["topk"] = ops.remap_locs(topk, topk_req, inverse, PAGE_SIZE, errors)

        results = []
        backends = ["triton"] + (["cuda"] if self.cuda is not None else [])
        previous = os.environ.get(ops.BACKEND_ENV)
        try:
            for backend in backends:
                os.environ[ops.BACKEND_ENV] = backend
                results.append(self._capture_layer(layer, dense, outputs, errors, backend))
        finally:
            if previous is None:
                os.environ.pop(ops.BACKEND_ENV, None)
            else:
                os.environ[ops.BACKEND_ENV] = previous
        return results

    def _capture_layer(self, layer, dense, outputs, errors, backend):
        from sglang_cpkv import ops

        result = {"backend": ops.select_backend(self.device)}
        try:
            layer()  # compile outside the sync check
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    layer()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                result["eager_sync_debug_error_mode"] = "passed"
                eager_dense, eager_topk = dense.clone(), outputs["topk"].clone()
                dense.zero_()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layer()
                graph.replay()
                torch.cuda.synchronize()
                result["captured"] = True
                result["replay_matches_eager"] = bool(
                    torch.equal(dense.view(torch.uint8), eager_dense.view(torch.uint8))
                    and torch.equal(outputs["topk"], eager_topk)
                )
                result["errors"] = errors.tolist()
                times = []
                for _ in range(self.args.reps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) * 1e3)
                result["replay_us"] = statistics.median(times)
        except Exception as exc:
            self.errors.append(f"graph capture: {exc!r}")
            result["failed"] = repr(exc)
            traceback.print_exc()
        print(f"# per-layer graph capture ({backend}): {result}", flush=True)
        return result


def _slots(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entry_pages, entry_req)`` of a ``[R, P]`` table of full requests; ``build_page_inverse``'s default slots
    put ``table[r, j]`` at slot ``r * P + j``."""
    rows, width = table.shape
    entry_req = torch.arange(rows, device=table.device).repeat_interleave(width)
    return table.reshape(-1), entry_req


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (after warm-up); median reported")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="roofline copy size (>= 1 GiB)")
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[8192, 32768, 65536, 131072], help="tokens per request (8 requests)"
    )
    parser.add_argument("--pool-pages", type=int, default=POOL_PAGES)
    parser.add_argument("--pages-per-request", type=int, default=2048, help="inverse build and remap tables")
    parser.add_argument("--topk", type=int, nargs=2, default=[4096, 2048], metavar=("ROWS", "K"))
    parser.add_argument("--plan-prefix", type=int, default=32768)
    parser.add_argument("--plan-extend", type=int, default=4096)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["copy", "fill", "remap", "inverse", "fused", "plan", "graph"],
        help="run these parts only (the roofline always runs)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check of the script, not a measurement")
    args = parser.parse_args(argv)
    if args.smoke:
        args.copy_gib, args.tokens, args.pool_pages, args.pages_per_request = 1 / 1024, [128, 256], 64, 8
        args.topk, args.plan_prefix, args.plan_extend, args.reps = [16, 32], 256, 64, 2
    elif args.copy_gib < 1:
        parser.error("--copy-gib must be >= 1 (the contract's roofline), use --smoke for a check of the script")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before sglang_cpkv.ops.triton defines its kernels
    bench = Bench(args)
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"# {env}; cuda provider: {'yes' if bench.cuda else 'no'}; reps={args.reps}", flush=True)
    print(f"{'op':20s} {'provider':28s} {'shape':44s} {'time':>13s} {'GB/s':>14s} {'frac':>6s}")
    bench.copy_bandwidth()
    parts = args.only or ["copy", "fill", "remap", "inverse", "fused", "plan", "graph"]
    graph = None
    for part, fn in (
        ("copy", bench.bench_copy_pages),
        ("fill", bench.bench_scatter_rows),
        ("remap", bench.bench_remap),
        ("inverse", bench.bench_build_inverse),
        ("fused", bench.bench_fused),
        ("plan", bench.bench_plan),
        ("graph", bench.graph_capture),
    ):
        if part not in parts:
            continue
        try:
            out = fn()
        except Exception as exc:  # one broken part must not lose the others' figures
            bench.errors.append(f"part {part}: {exc!r}")
            traceback.print_exc()
            continue
        if part == "graph":
            graph = out
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "env": env,
                    "args": vars(args),
                    "copy_gbps": bench.copy_gbps,
                    "targets": TARGETS,
                    "records": bench.records,
                    "graph_capture": graph,
                    "errors": bench.errors,
                },
                f,
                indent=1,
            )
    if bench.errors:
        print(f"# {len(bench.errors)} measurement(s) failed:", *bench.errors, sep="\n#   ")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())

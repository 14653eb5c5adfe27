"""The precursor of benchmark/plan_host_phases.py (the same timers, phases named by their functions at 55a50be), kept with the figures it measured on the H200 (plan_phases_flashmla_kv_h200_55a50be.json: PHASE_SYNC=1 python3 phases_precursor_55a50be.py out.json)."""

import functools
import json
import os
import statistics
import sys
import time

import torch

import sglang_cpkv.hooks.dsa_batch as B
import sglang_cpkv.hooks.dsa_metadata as M
import sglang_cpkv.runtime.plan as P
from sglang_cpkv.runtime.reservation import Reservation
from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import PAGE, KitRoute, KitWorld, distinct_page_tables, kit_capacity
from sglang_cpkv.testing.upstream_env import set_cp_shared_kv_flag

T = {}


def wrap(mod, name, label=None, sync_first=False):
    f = getattr(mod, name)
    label = label or name

    @functools.wraps(f)
    def g(*a, **k):
        if sync_first:
            s = time.perf_counter()
            torch.cuda.synchronize()
            T.setdefault("wait upstream queued device work", []).append(time.perf_counter() - s)
        s = time.perf_counter()
        r = f(*a, **k)
        T.setdefault(label, []).append(time.perf_counter() - s)
        return r

    setattr(mod, name, g)


DEV = os.environ.get("PHASE_DEV", "cuda")
if DEV == "cpu":
    torch.cuda.synchronize = lambda *a: None

    class _E:
        def __init__(self, **k):
            pass

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, o):
            return (o.t - self.t) * 1e3

    torch.cuda.Event = _E
SYNC = os.environ.get("PHASE_SYNC") == "1"
wrap(M, "on_extend_metadata", "hook total", sync_first=SYNC)
for n in ("pool_page_table", "build_plan", "remap_page_table", "build_cp_split", "upstream_interleave_split"):
    wrap(M, n, "hook." + n)
wrap(B.BackendState, "begin", "hook.begin")
wrap(B.BackendState, "surface_errors", "begin.surface_errors")
wrap(B, "_ErrorsInTransit", "begin.errors_in_transit")
wrap(B, "owned_pool_write_locs", "begin.owned_pool_write_locs")
wrap(B, "LayerPipeline", "begin.LayerPipeline")
wrap(B.BackendState, "_latent_kind", "begin._latent_kind")
wrap(B.BackendState, "_index_k_kind", "begin._index_k_kind")
wrap(B, "reads_dense_latent", "begin.reads_dense_latent")
wrap(Reservation, "check_batch", "hook.check_batch")
for n in (
    "_host_page_table",
    "_entries",
    "_check_current_locations",
    "_dense_layout",
    "_current_token_offsets",
    "_current_tokens",
    "_history_copies",
    "_stage",
    "_count_location_mismatches",
    "_owned_cache_write_locs",
    "_validate_lengths",
    "_in_range_or_capacity",
):
    wrap(P, n, "plan." + n)
wrap(P.ops, "build_page_inverse", "plan.build_page_inverse")
wrap(P.CpSharedKvPlan, "__init__", "plan.dataclass init")
_cpu = torch.Tensor.cpu


def cpu(self, *a, **k):
    s = time.perf_counter()
    r = _cpu(self, *a, **k)
    T.setdefault("plan.table.cpu()", []).append(time.perf_counter() - s)
    return r


torch.Tensor.cpu = cpu


def main():
    out = {}
    for R in [int(x) for x in os.environ.get("PHASE_REQ", "1,8,64").split(",")]:
        longest = 8192 + 1024
        cap = kit_capacity(R, longest)
        tables = distinct_page_tables([longest] * R, cap, seed=0)
        case = BatchCase(PAGE, cap, tables, (8192,) * R, (1024,) * R)
        for label, on in (("off", False), ("on sync", True)):
            os.environ["SGLANG_CPKV_LAYER_AHEAD"] = "0"
            w = KitWorld(
                KitRoute(os.environ.get("PHASE_BACKEND", "flashmla_kv"), fp8=True),
                max_requests=R,
                longest=longest,
                mode_on=on,
                device=DEV,
            )
            fb = w._extend_batch(case)[0]
            set_cp_shared_kv_flag(on)
            w.make_current()
            host, dev = [], []
            with torch.no_grad():
                for i in range(33):
                    if i == 3:
                        T.clear()
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    s = time.perf_counter()
                    with w.up["context"](w.backend):
                        w.backend.init_forward_metadata(fb)
                    host.append(time.perf_counter() - s)
                    e1.record()
                    torch.cuda.synchronize()
                    dev.append(e0.elapsed_time(e1))
                if on and R in (1, 64) and DEV == "cuda":
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        for _ in range(5):
                            with w.up["context"](w.backend):
                                w.backend.init_forward_metadata(fb)
                        torch.cuda.synchronize()
                    print(f"--- {R} req {label}: device kernels (us per call)")
                    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]:
                        if ev.device_time_total > 0:
                            print(f"   {ev.device_time_total / 5:9.1f}  {ev.key[:100]}")
            med = {k: statistics.median(v) * 1e3 for k, v in T.items()}
            print(
                f"=== {R} req, {label}: host {statistics.median(host[3:]) * 1e3:.3f} ms, device window {statistics.median(dev[3:]):.3f} ms"
            )
            for k in sorted(med, key=lambda k: (k.split(".")[0], -med[k])):
                print(f"   {med[k]:8.3f} ms  x{len(T[k]) // 30}  {k}")
            out[f"{R} {label}"] = {
                "host": statistics.median(host[3:]) * 1e3,
                "dev": statistics.median(dev[3:]),
                "phases": med,
            }
            T.clear()
            del w, fb
            torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


main()

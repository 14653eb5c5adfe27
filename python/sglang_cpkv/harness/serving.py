"""The serving-path harness: upstream's DSA attention kit through the patched backend on real CP ranks (TEST-ONLY).

Each rank is a process with upstream's distributed init and model-parallel groups (gloo on CPU, NCCL one process per
GPU, or gloo on one GPU) that builds :class:`~sglang_cpkv.testing.dsa_kit.KitWorld` and runs every scenario's forwards
through the patched backend, comparing with the mode off, with each request alone and across ranks. Callers:
``python -m sglang_cpkv.harness``, ``harness/test_serving_harness_*.py``. Scenarios and checks:
``docs/design/cp-shared-kv-testing.md`` ("The serving-path harness").
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from sglang_cpkv.testing.batches import BatchCase, same_bytes
from sglang_cpkv.testing.dsa_kit import INDEX_HEAD_DIM, PAGE, KitRoute, KitRun, kit_capacity, write_dsa_model_dir

ROUTES = {
    "triton_sparse_mla-bf16-paged": KitRoute("triton_sparse_mla"),
    "triton_sparse_mla-fp8-ragged": KitRoute("triton_sparse_mla", fp8=True),
    "flashmla_kv-fp8-paged": KitRoute("flashmla_kv", fp8=True),
    "flashmla_sparse-bf16-paged-indexshare": KitRoute("flashmla_sparse", skip_topk_layers=(False, True, False)),
    "flashmla_sparse-fp8-ragged": KitRoute("flashmla_sparse", fp8=True),
    "flashmla_auto-fp8": KitRoute("flashmla_auto", fp8=True),
}
SCENARIO_NAMES = ("shared-prefix", "chunked", "sharing")
UPSTREAM_CANNOT_SERVE = ("sharing",)  # collision-class states: no mode_off check
SPLIT_KV_KERNEL = "_forward_flashmla_kv"  # the backend method of FlashMLA's split-KV decode kernel (docs/design/cp-shared-kv-testing.md)
SHARED_PREFIX = 2 * PAGE  # the cached prompt every request hits
LONGEST = 400  # tokens of the longest request of any scenario (the kit runner's context)


@dataclass(frozen=True)
class Scenario:
    """The forwards of one batch (a chunked prefill is several), laid out on the kit's pool."""

    name: str
    forwards: tuple[BatchCase, ...]

    def alone(self, r: int) -> Scenario:
        """Request ``r``'s forwards at bs = 1 (the same pages, lengths and history)."""

        def one(case: BatchCase) -> BatchCase:
            return BatchCase(
                PAGE,
                case.capacity,
                (case.page_tables[r],),
                (case.prefix_lens[r],),
                (case.extend_lens[r],),
                case.cp_size,
            )

        return Scenario(f"{self.name}/request {r}", tuple(one(c) for c in self.forwards))


def scenarios(bs: int, cp: int, max_bs: int) -> dict[str, Scenario]:
    """The scenarios for a batch of ``bs`` requests on a pool sized for ``max_bs``."""
    capacity = kit_capacity(max_bs, LONGEST, cp)
    # Page ids [0, cp) are the page-interleave allocator's reserved ids (page 0 of every rank's pool).
    pages = torch.randperm(capacity - cp, generator=torch.Generator().manual_seed(bs)).add(cp).tolist()
    shared, pages = tuple(pages[:2]), pages[2:]

    def tables(totals: list[int]) -> tuple[tuple[int, ...], ...]:
        nonlocal pages
        out = []
        for n in totals:
            own = -(-n // PAGE) - len(shared)
            out.append(shared + tuple(pages[:own]))
            pages = pages[own:]
        return tuple(out)

    own_history = [(r % 3) * 30 for r in range(bs)]  # 0, 30 or 60 tokens: a history ending mid-page
    prefix = [SHARED_PREFIX + h for h in own_history]
    extend = [20 + 7 * r for r in range(bs)]
    shared_case = BatchCase(PAGE, capacity, tables([p + e for p, e in zip(prefix, extend)]), prefix, extend, cp)
    first = [90 + 5 * r for r in range(bs)]
    second = [40 + 3 * r for r in range(bs)]
    chunk_tables = tables([SHARED_PREFIX + a + b for a, b in zip(first, second)])
    chunk1 = BatchCase(PAGE, capacity, chunk_tables, [SHARED_PREFIX] * bs, first, cp)
    chunk2 = BatchCase(PAGE, capacity, chunk_tables, [SHARED_PREFIX + a for a in first], second, cp)
    # sharing (docs/design/cp-shared-kv-testing.md): A's history ends 30 tokens into page x, its chunk fills x and y and starts z;
    # B reads x and y whole as history, ends 10 tokens into its own page; the rest as in shared-prefix.
    (x, y, z, w), pages = pages[:4], pages[4:]
    sharing_tables = [shared + (x, y, z), shared + (x, y, w)] + list(tables([p + e for p, e in zip(prefix, extend)]))[
        2:
    ]
    sharing_prefix = [SHARED_PREFIX + 30, SHARED_PREFIX + 2 * PAGE + 10] + prefix[2:]
    sharing_extend = [PAGE - 30 + PAGE + 20, 25] + extend[2:]
    sharing_case = BatchCase(PAGE, capacity, tuple(sharing_tables), sharing_prefix, sharing_extend, cp)
    return {
        "shared-prefix": Scenario("shared-prefix", (shared_case,)),
        "chunked": Scenario("chunked", (chunk1, chunk2)),
        "sharing": Scenario("sharing", (sharing_case,)),
    }


@dataclass
class RankRun:
    """One run of a scenario on one rank, reduced to what each real query row read."""

    reads: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = field(
        default_factory=dict
    )  # (request, token offset in its chunk, forward) -> per layer (KV bytes read, valid, kernel output row)
    index_k: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)  # per forward
    dense_views: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per forward, mode on: last layer's
    kernels: set[str] = field(default_factory=set)  # the backend kernel methods the forwards ran


def _reduce(run: KitRun, case: BatchCase, forward: int, out: RankRun, dense: dict[str, torch.Tensor]) -> None:
    starts = [sum(case.extend_lens[:r]) for r in range(case.num_requests)]
    for i, t in enumerate(run.local_tokens.tolist()):
        r = max(k for k in range(case.num_requests) if starts[k] <= t)
        out.reads[(r, t - starts[r], forward)] = [
            (k.rows[i], k.valid[i], None if k.output is None else k.output[i]) for k in run.kernel
        ]
    out.index_k.append(run.index_k)
    out.dense_views.append(dense)
    out.kernels.update(k.kernel for k in run.kernel)


def _dense_views(world: Any) -> dict[str, torch.Tensor]:
    """The last layer's dense views the mode left on the backend: the bytes of every token position of every
    request's slots (history and current; a last page's positions past the request's end are never written or
    read, and are left out)."""
    from sglang_cpkv.hooks.dsa_batch import INDEX_K, LATENT, STATE_ATTR

    state = getattr(world.backend, STATE_ATTR, None)
    if state is None or state.batch is None:
        return {}
    batch = state.batch
    plan = batch.plan
    locations = torch.cat([plan.request_locations(r) for r in range(plan.num_requests)])
    slot, offset = locations // PAGE, locations % PAGE
    views = {}
    layers = range(world.route.num_layers)
    index_k_layers = [i for i in layers if not world.route.skip_topk_layers[i]]
    if batch.latent_scratch is not None:
        pages = batch.pipeline.dense_pages(LATENT, layers[-1]).cpu().contiguous().view(torch.uint8)
        views[LATENT] = pages.view(pages.shape[0], PAGE, -1)[slot, offset]
    if index_k_layers:
        # An index-K page is its tokens' keys, then their scales (upstream's paged index-K layout).
        pages = batch.pipeline.dense_pages(INDEX_K, index_k_layers[-1]).cpu().contiguous().view(torch.uint8)
        keys = pages[:, : PAGE * INDEX_HEAD_DIM].reshape(pages.shape[0], PAGE, INDEX_HEAD_DIM)
        scales = pages[:, PAGE * INDEX_HEAD_DIM :].reshape(pages.shape[0], PAGE, -1)
        views[INDEX_K] = torch.cat([keys[slot, offset], scales[slot, offset]], dim=1)
    return views


def run_scenario(route: KitRoute, scenario: Scenario, mode_on: bool, max_bs: int, device: str, cp: int, rank: int):
    """One fresh rank world (the kit's objects) running the scenario's forwards; its history written first."""
    from sglang_cpkv.testing.dsa_kit import KitWorld

    world = KitWorld(
        route,
        max_requests=max_bs,
        longest=LONGEST,
        mode_on=mode_on,
        device=device,
        cp_size=cp,
        cp_rank=rank,
        run_kernels=torch.device(device).type == "cuda",
    )
    out = RankRun()
    world.write_history(scenario.forwards[0])
    for forward, case in enumerate(scenario.forwards):
        run = world.forward(case)
        _reduce(run, case, forward, out, _dense_views(world) if mode_on else {})
    return out


@dataclass(frozen=True)
class HarnessJob:
    """What every rank runs: each (route, scenario, bs) with the mode off, on, and each request alone."""

    routes: tuple[str, ...]
    scenarios: tuple[str, ...]
    bs_list: tuple[int, ...]


def run_job(job: HarnessJob, device: str, cp: int, rank: int, model_dir: str, log=None) -> dict:
    """Every run of ``job`` on this rank: ``{(route, scenario, bs, "off" | "on" | request): RankRun}``."""
    from sglang_cpkv.testing.dsa_kit import publish_prefill_cp_server_args

    max_bs = max(job.bs_list)
    results = {}
    for route_name in job.routes:
        route = ROUTES[route_name]
        for bs in job.bs_list:
            for name, scenario in scenarios(bs, cp, max_bs).items():
                if name not in job.scenarios:
                    continue
                start = time.perf_counter()
                runs = [] if name in UPSTREAM_CANNOT_SERVE else [("off", scenario, False)]
                runs += [("on", scenario, True)] + [(r, scenario.alone(r), True) for r in range(bs)]
                for key, sc, mode_on in runs:
                    if cp > 1:
                        publish_prefill_cp_server_args(model_dir, cp, mode_on=mode_on)
                    results[(route_name, name, bs, key)] = run_scenario(route, sc, mode_on, max_bs, device, cp, rank)
                if SPLIT_KV_KERNEL in results[(route_name, name, bs, "on")].kernels:
                    if cp > 1:
                        publish_prefill_cp_server_args(model_dir, cp, mode_on=False)
                    for r in range(bs):
                        alone = run_scenario(route, scenario.alone(r), False, max_bs, device, cp, rank)
                        results[(route_name, name, bs, ("off", r))] = alone
                if log is not None:
                    log(f"rank {rank}: {route_name} {name} bs={bs}: {time.perf_counter() - start:.1f} s")
    return results


def _rank_process(
    rank: int, cp: int, device: str, init_method: str, model_dir: str, job: HarnessJob, dist_backend: str | None
) -> None:
    """One CP rank: upstream's distributed init, the patched model-parallel groups, then the job."""
    from sglang_cpkv.testing.dsa_kit import init_cp_rank

    torch.set_num_threads(1)
    device = init_cp_rank(rank, cp, device, init_method, model_dir, dist_backend)
    results = run_job(job, device, cp, rank, model_dir, log=lambda m: print(m, flush=True))
    torch.save(results, os.path.join(model_dir, f"rank{rank}.pt"))


def run_ranks(job: HarnessJob, cp: int, device: str, log, dist_backend: str | None = None) -> list[dict]:
    """Every rank's results of ``job`` (cp 1 in this process, else ``cp`` spawned ranks over ``dist_backend``,
    :func:`~sglang_cpkv.testing.dsa_kit.init_cp_rank`)."""
    if cp == 1:
        dev = "cuda:0" if device == "cuda" else "cpu"
        return [run_job(job, dev, 1, 0, "", log=log)]
    with tempfile.TemporaryDirectory() as tmp:
        write_dsa_model_dir(tmp)
        init = Path(tmp, "dist_init").as_uri()
        mp.spawn(_rank_process, args=(cp, device, init, tmp, job, dist_backend), nprocs=cp, join=True)
        return [torch.load(Path(tmp, f"rank{rank}.pt"), weights_only=False) for rank in range(cp)]


def _merged(ranks: list[dict], key: tuple) -> RankRun:
    """Every rank's rows of one run (each real query row is on exactly one rank)."""
    merged = RankRun()
    for results in ranks:
        run = results[key]
        overlap = merged.reads.keys() & run.reads.keys()
        if overlap:
            raise AssertionError(f"{key}: rows {sorted(overlap)[:4]} on two ranks")
        merged.reads.update(run.reads)
        merged.kernels |= run.kernels
    first = ranks[0][key]
    merged.index_k, merged.dense_views = first.index_k, first.dense_views
    return merged


def _row_problems(a, b, what: str, output: bool = True) -> list[str]:
    """What differs between two runs of one query row (per layer: KV bytes read, and the output unless not
    ``output``)."""
    problems = []
    for layer, ((rows_a, valid_a, out_a), (rows_b, valid_b, out_b)) in enumerate(zip(a, b)):
        if not torch.equal(valid_a, valid_b) or not same_bytes(rows_a, rows_b):
            problems.append(f"{what} layer {layer}: other KV bytes read")
        elif int(valid_a.sum()) == 0:
            problems.append(f"{what} layer {layer}: reads nothing")
        if not output:
            continue
        if (out_a is None) != (out_b is None) or (out_a is not None and not same_bytes(out_a, out_b)):
            problems.append(f"{what} layer {layer}: other kernel output")
    return problems


def _check_mode_off(off: RankRun, on: RankRun) -> list[str]:
    problems = []
    if off.reads.keys() != on.reads.keys():
        return ["the query rows differ with the mode on"]
    for key in sorted(off.reads):
        problems += _row_problems(off.reads[key], on.reads[key], f"row {key}")
    for forward, (a, b) in enumerate(zip(off.index_k, on.index_k)):
        if a.keys() != b.keys() or not all(same_bytes(x, y) for layer in a for x, y in zip(a[layer], b[layer])):
            problems.append(f"forward {forward}: the indexer reads other index K")
    return problems


def _check_bs1(batch: RankRun, alone: list[RankRun], output: bool = True) -> list[str]:
    problems = []
    for (r, offset, forward), rows in sorted(batch.reads.items()):
        solo = alone[r].reads.get((0, offset, forward))
        if solo is None:
            problems.append(f"request {r} offset {offset}: no such row alone")
            continue
        problems += _row_problems(rows, solo, f"request {r} offset {offset} forward {forward} vs alone", output)
    return problems


def _check_alone_off(alone: list[RankRun], alone_off: list[RankRun]) -> list[str]:
    problems = []
    for r, (on, off) in enumerate(zip(alone, alone_off)):
        if on.reads.keys() != off.reads.keys():
            problems.append(f"request {r} alone: the query rows differ with the mode on")
            continue
        for key in sorted(on.reads):
            problems += _row_problems(off.reads[key], on.reads[key], f"request {r} alone, row {key}, vs mode off")
    return problems


def _check_ranks(ranks: list[dict], key: tuple) -> list[str]:
    problems = []
    reference = ranks[0][key].dense_views
    if not any(reference):
        return ["no dense view captured"]
    for rank, results in enumerate(ranks[1:], start=1):
        for forward, (a, b) in enumerate(zip(reference, results[key].dense_views)):
            for kind in a.keys() | b.keys():
                if kind not in a or kind not in b or not same_bytes(a[kind], b[kind]):
                    problems.append(f"forward {forward}: rank {rank}'s dense {kind} view differs from rank 0's")
    return problems


def judge(job: HarnessJob, cp: int, ranks: list[dict]) -> list[dict]:
    """The report rows (docs/design/cp-shared-kv-testing.md: ``mode_off``, ``bs1``, ``ranks``) of every rank's results at ``cp``."""
    checks = []
    for route_name in job.routes:
        for bs in job.bs_list:
            for name in job.scenarios:
                base = {"route": route_name, "scenario": name, "cp": cp, "bs": bs}
                on = _merged(ranks, (route_name, name, bs, "on"))
                alone = [_merged(ranks, (route_name, name, bs, r)) for r in range(bs)]
                split_kv = SPLIT_KV_KERNEL in on.kernels
                found = {"bs1": _check_bs1(on, alone, output=not split_kv)}
                if split_kv:
                    alone_off = [_merged(ranks, (route_name, name, bs, ("off", r))) for r in range(bs)]
                    found["alone_off"] = _check_alone_off(alone, alone_off)
                if name not in UPSTREAM_CANNOT_SERVE:
                    found["mode_off"] = _check_mode_off(_merged(ranks, (route_name, name, bs, "off")), on)
                if cp > 1:
                    found["ranks"] = _check_ranks(ranks, (route_name, name, bs, "on"))
                outputs = sum(rows[0][2] is not None for rows in on.reads.values())
                for kind, problems in found.items():
                    checks.append(
                        base
                        | {
                            "check": kind,
                            "rows": len(on.reads),
                            "rows_with_kernel_output": outputs,
                            "problems": problems[:6],
                            "passed": not problems,
                        }
                    )
    return checks


def summarize(checks: list[dict]) -> dict:
    """Counts of the check rows, overall and per kind of check."""
    failed = sum(not c["passed"] for c in checks)
    kinds = sorted({c["check"] for c in checks})
    return {
        "checks": len(checks),
        "passed": len(checks) - failed,
        "failed": failed,
        "by_kind": {
            k: {
                "passed": sum(c["passed"] for c in checks if c["check"] == k),
                "total": sum(c["check"] == k for c in checks),
            }
            for k in kinds
        },
    }


def device_line(device: str) -> str:
    return device if device == "cpu" else f"cuda ({torch.cuda.get_device_name(0)} x{torch.cuda.device_count()})"


def run_serving_harness(
    cp_list: list[int],
    bs_list: list[int],
    scenario_names: list[str],
    route_names: list[str],
    device: str,
    log=print,
    dist_backend: str | None = None,
) -> dict:
    """Run the serving-path harness; returns the report (``report["summary"]["failed"] == 0`` when all passed).

    ``dist_backend``: the ranks' collectives (:func:`~sglang_cpkv.testing.dsa_kit.init_cp_rank`; default NCCL on a
    GPU, one GPU per rank; ``"gloo"`` on a GPU puts every rank on GPU 0)."""
    unknown = sorted(set(scenario_names) - set(SCENARIO_NAMES)) + sorted(set(route_names) - set(ROUTES))
    if unknown:
        raise ValueError(f"unknown scenarios or routes {unknown}; scenarios {SCENARIO_NAMES}, routes {tuple(ROUTES)}")
    if not bs_list or min(bs_list) < 1 or not cp_list or min(cp_list) < 1:
        raise ValueError(f"bs_list {bs_list} and cp_list {cp_list} must be non-empty and >= 1")
    if device == "cuda" and dist_backend != "gloo" and max(cp_list) > torch.cuda.device_count():
        raise ValueError(f"cp={max(cp_list)} needs {max(cp_list)} GPUs, {torch.cuda.device_count()} visible")
    job = HarnessJob(tuple(route_names), tuple(scenario_names), tuple(bs_list))
    checks, timings = [], {}
    for cp in cp_list:
        start = time.perf_counter()
        ranks = run_ranks(job, cp, device, log, dist_backend)
        timings[f"cp{cp}_seconds"] = round(time.perf_counter() - start, 2)
        cp_checks = judge(job, cp, ranks)
        checks += cp_checks
        log(f"cp={cp}: {timings[f'cp{cp}_seconds']} s, {sum(c['passed'] for c in cp_checks)}/{len(cp_checks)} passed")
    failed = [c for c in checks if not c["passed"]]
    return {
        "device": device_line(device),
        "dist_backend": dist_backend or ("nccl" if device == "cuda" else "gloo"),
        "cp_list": cp_list,
        "bs_list": bs_list,
        "scenarios": scenario_names,
        "routes": route_names,
        "timings": timings,
        "summary": summarize(checks),
        "failures": failed,
        "checks": checks,
    }

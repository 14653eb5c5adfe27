"""The soak's report: each scenario's processes judged together, and the totals.

A scenario passes when no process crashed, no read anywhere mismatched, no page leaked on any server (upstream's
memory check at idle, and the allocator's free pages equal to its total once the radix cache is emptied), every CP
rank ended every request the same way, every request the client did not abort was served by the prefill and received
and checked by the decode, and every aborted request ended on both sides. Used by :mod:`.cli`; pure Python.
"""

from __future__ import annotations

from typing import Any

from sglang_cpkv.soak.workload import describe, make_workload


def label(server: Any, workload: Any) -> str:
    return (
        f"cp {server.cp}, {'fp8' if server.fp8 else 'bf16'} {server.prefill_backend}, chunk {server.chunked_prefill_size}, "
        f"radix {'on' if server.radix_cache else 'off'}, hicache {'on' if server.hicache else 'off'}, "
        f"{workload.requests} requests, seed {workload.seed}"
    )


def scenario(server: Any, workload: Any, reports: list[dict], seconds: float) -> dict:
    specs = make_workload(workload)
    prefill = sorted((r for r in reports if r.get("role") == "prefill"), key=lambda r: r.get("rank", 0))
    decode = next((r for r in reports if r.get("role") == "decode"), {})
    problems: list[str] = []
    crashes = [f"{r.get('role')} {r.get('rank', '')}: {r['crash']}" for r in reports if "crash" in r]
    problems += crashes
    with_decode = server.transfer_backend == "mooncake"  # else no decode (the GPU soak)
    if len(prefill) != server.cp or bool(decode) != with_decode:
        problems.append(f"reports from {len(prefill)} of {server.cp} prefill ranks and {1 if decode else 0} decode")
    checks = [r["checks"] for r in [*prefill, decode] if "checks" in r]
    mismatches = sum(c["mismatches"] for c in checks)
    if mismatches:
        problems.append(f"{mismatches} mismatched reads: {[e for c in checks for e in c['examples']][:5]}")
    leaks = []
    for r in [*prefill, decode]:
        if "allocator_total" not in r:
            continue
        who = f"{r['role']} {r['rank']}"
        if r.get("memory_check_at_idle") != "ok":
            leaks.append(f"{who}: {r.get('memory_check_at_idle')}")
        if r["allocator_free_after_drain"] != r["allocator_total"]:
            leaks.append(
                f"{who}: {r['allocator_free_after_drain']} of {r['allocator_total']} tokens free after draining"
            )
        if r.get("request_rows_free", 0) != r.get("request_rows_total", 0):
            leaks.append(f"{who}: {r['request_rows_free']} of {r['request_rows_total']} request rows free")
    problems += leaks
    endings = [(frozenset(r.get("served", ())), frozenset(r.get("aborted", ()))) for r in prefill]
    if len(set(endings)) > 1:
        problems.append("the CP ranks ended requests differently")
    served_p, aborted_p = endings[0] if endings else (frozenset(), frozenset())
    abort_sent = prefill[0].get("abort_sent", {}) if prefill else {}
    served_d, aborted_d = set(decode.get("served", ())), set(decode.get("aborted", ()))
    syncs = max((c["mode_host_syncs_max"] for c in checks), default=0)
    if syncs > 1:
        where = next(c.get("mode_host_syncs_where", {}) for c in checks if c["mode_host_syncs_max"] == syncs)
        problems.append(f"the mode read device data on the host {syncs} times in one batch (the design: once): {where}")
    unexpected = [u for r in [*prefill, decode] for u in r.get("unexpected", ())]
    if unexpected:
        problems.append(f"{len(unexpected)} requests ended unexpectedly: {unexpected[:5]}")
    not_ended = []
    if not with_decode:
        served_d, aborted_d = served_p, aborted_p
    for spec in specs:
        if spec.rid in abort_sent:
            if spec.rid not in (served_p | aborted_p) or spec.rid not in (served_d | aborted_d):
                not_ended.append(spec.rid)
        elif spec.rid not in served_p or spec.rid not in served_d:
            not_ended.append(spec.rid)
    if not_ended and not crashes:
        problems.append(f"{len(not_ended)} requests did not end as the workload says: {not_ended[:5]}")
    unchecked = decode.get("received_without_decode_step", [])
    if unchecked:
        problems.append(f"{len(unchecked)} served requests never reached a decode step (KV unchecked): {unchecked[:5]}")
    return {
        "label": label(server, workload),
        "server": server.describe(),
        "workload": describe(workload, specs),
        "seconds": round(seconds, 1),
        "passed": not problems,
        "problems": problems,
        "figures": {
            "requests": len(specs),
            "served": len(served_p & served_d),
            "aborted": len(abort_sent),
            "aborts_by_queue": {
                where: sum(1 for w in abort_sent.values() if w == where) for where in sorted(set(abort_sent.values()))
            },
            "batches": sum(c["batches"] for c in checks if c["rank"] == 0),
            "prefill_tokens": sum(c["tokens"] for c in checks if c["rank"] == 0),
            "reads_checked": sum(c["reads_checked"] for c in checks),
            "kernel_outputs_checked": sum(c.get("kernel_outputs_checked", 0) for c in checks),
            "index_k_rows_checked": sum(c["index_k_rows_checked"] for c in checks),
            "pool_rows_checked": sum(c["pool_rows_checked"] for c in checks),
            "transferred_bytes": decode.get("transferred_bytes", 0),
            "host_hit_tokens": sum(c["host_hit_tokens"] for c in checks if c["rank"] == 0),
            "dense_slots_max": max((c["dense_slots_max"] for c in checks), default=0),
            "dense_slots_reserved": max((c["dense_slots_reserved"] for c in checks), default=0),
            "mode_host_syncs_max_per_batch": syncs,
            "mismatches": mismatches,
            "leaks": len(leaks),
            "crashes": len(crashes),
        },
        "processes": [{k: v for k, v in r.items() if k not in ("served", "aborted")} for r in reports],
    }


def summary_line(figures_or_result: dict) -> str:
    f = figures_or_result.get("figures", figures_or_result)
    verdict = ""
    if "passed" in figures_or_result:
        verdict = "PASS: " if figures_or_result["passed"] else "FAIL: "
    return (
        f"{verdict}{f['requests']} requests ({f['served']} served, {f['aborted']} aborted), {f['batches']} batches, "
        f"{f['reads_checked']} reads checked, {f['transferred_bytes']} bytes transferred, {f['mismatches']} mismatches, "
        f"{f['leaks']} leaks, {f['crashes']} crashes"
    )


def whole(results: list[dict]) -> dict:
    keys = ("requests", "served", "aborted", "batches", "prefill_tokens", "reads_checked", "index_k_rows_checked")
    keys += ("pool_rows_checked", "transferred_bytes", "host_hit_tokens", "mismatches", "leaks", "crashes")
    totals = {k: sum(r["figures"][k] for r in results) for k in keys}
    by_cp: dict[str, int] = {}
    for r in results:
        by_cp[str(r["server"]["cp"])] = by_cp.get(str(r["server"]["cp"]), 0) + r["figures"]["requests"]
    totals["requests_by_cp"] = by_cp
    return {
        "passed": bool(results) and all(r["passed"] for r in results),
        "totals": totals,
        "scenarios": results,
    }

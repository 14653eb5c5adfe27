"""``make demo``: the seed's bs>1 scenario, per request, with the per-request and the 1-D inverse.

Two embedded batches (page size 4, three requests, 656-byte packed FP8 rows): **reachable** (upstream 0.5.23:
page-aligned prefix sharing, CURRENT_REUSE) and **collision** (the seed's fork: two requests continue one partially
filled page differently). Each request's dense KV view from the per-request runtime (cp=1, then cp=2 over gloo, or
NCCL on two GPUs) is compared with its bs=1 run; then the seed's 1-D value-keyed inverse runs the same batches and
the demo reports whose rows each request read. Exit status 1 if the per-request path mismatches anywhere (the 1-D
inverse's failure on the collision batch is expected). The two classes: the contract's "Which states matter".

    python -m sglang_cpkv.testing.demo [--no-cp2]
"""

from __future__ import annotations

import argparse
import sys

import torch

from sglang_cpkv.testing.batches import (
    COLLISION,
    REACHABLE,
    BatchCase,
    host_plan,
    make_pool_and_current,
    run_case_on_rank,
    same_bytes,
    truth_rows,
)
from sglang_cpkv.testing.lockstep import run_lockstep
from sglang_cpkv.testing.value_keyed_inverse import value_keyed_pipeline

NAMES = "ABC"
ROW_BYTES = 656  # the packed FP8 DSA row

BATCHES = {
    # A: history 6 = full page 3 + 2 tokens of page 5, current 5 continues page 5 then page 8.
    # B: history 4 = page 3 (shared with A, full), current 3 in page 9. C: no history.
    REACHABLE: BatchCase(4, 16, ((3, 5, 8), (3, 9), (11, 12)), (6, 4, 0), (5, 3, 6)),
    # A and B share page 3 (full) and page 5 (2 tokens), and both continue page 5 with their own
    # current tokens; C shares page 3 only.
    COLLISION: BatchCase(4, 16, ((3, 5, 8), (3, 5), (3, 9)), (6, 6, 4), (5, 2, 3)),
}


def _positions_locs(case: BatchCase) -> torch.Tensor:
    """int64 ``[R, max_len]``: pool location of every position of each request (-1 padding)."""
    width = max(p + e for p, e in zip(case.prefix_lens, case.extend_lens))
    locs = torch.full((case.num_requests, width), -1, dtype=torch.int64)
    for r in range(case.num_requests):
        for p in range(case.prefix_lens[r] + case.extend_lens[r]):
            locs[r, p] = case.pool_loc(r, p)
    return locs


def _request_views(case: BatchCase, cp_rank: int, dense: torch.Tensor) -> list[torch.Tensor]:
    """Each request's dense view rows, position order, as CP rank ``cp_rank`` laid them out."""
    plan = host_plan(case, cp_rank)
    return [
        dense[[plan.dense_location(r, p) for p in range(case.prefix_lens[r] + case.extend_lens[r])]]
        for r in range(case.num_requests)
    ]


def _per_request_reads(
    case: BatchCase, pool: torch.Tensor, current: torch.Tensor, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """cp=1 runtime (the layer pipeline): (dense view rows of each request, what its last current token reads
    at each of its positions when its top-k is every position of its request)."""
    locs = _positions_locs(case)
    token_req = [r for r in range(case.num_requests) for _ in range(case.extend_lens[r])]
    topk = locs[token_req]  # every current token reads every position of its own request
    (result,) = run_lockstep(1, lambda group: run_case_on_rank((case, pool, current, topk), group, device))
    views = _request_views(case, 0, result.dense)
    last_token = torch.tensor(case.extend_lens).cumsum(0) - 1
    reads = []
    for r in range(case.num_requests):
        n = case.prefix_lens[r] + case.extend_lens[r]
        reads.append(result.dense[result.remapped[last_token[r], :n].to(torch.int64)])
    return views, reads


def _solo(case: BatchCase, r: int, current: torch.Tensor) -> tuple[BatchCase, torch.Tensor]:
    start = sum(case.extend_lens[:r])
    alone = BatchCase(
        case.page_size, case.capacity, (case.page_tables[r],), (case.prefix_lens[r],), (case.extend_lens[r],)
    )
    return alone, current[start : start + case.extend_lens[r]]


def _describe(row: torch.Tensor, case: BatchCase, pool: torch.Tensor, current: torch.Tensor) -> str:
    """Whose KV a row is: a request's current token, or a pool row."""
    token = 0
    for q in range(case.num_requests):
        for i in range(case.extend_lens[q]):
            if same_bytes(row, current[token]):
                return f"{NAMES[q]}'s current token {i} (position {case.prefix_lens[q] + i})"
            token += 1
    for loc in range(pool.shape[0]):
        if same_bytes(row, pool[loc]):
            return f"pool row {loc} (page {loc // case.page_size})"
    return "a row nobody wrote"


def _describe_batch(name: str, case: BatchCase) -> None:
    title = {
        REACHABLE: "reachable in upstream 0.5.23: page-aligned prefix sharing",
        COLLISION: "collision class: a shared partially filled page (the seed's fork)",
    }[name]
    print(f"\n=== batch '{name}' ({title}); state class computed from the tables: {case.state_class}")
    for r in range(case.num_requests):
        print(
            f"  request {NAMES[r]}: pages {list(case.page_tables[r])}, history {case.prefix_lens[r]} tokens, current {case.extend_lens[r]} tokens"
        )


def run(cp2: bool) -> int:
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"CP shared-KV demo: per-request page inverse vs the seed's 1-D value-keyed inverse (device {device}, page size 4, {ROW_BYTES}-byte rows)"
    )
    failures = 0
    for seed, (name, case) in enumerate(BATCHES.items()):
        _describe_batch(name, case)
        pool, current = make_pool_and_current(case, torch.uint8, ROW_BYTES, seed=seed)
        truth = truth_rows(case, pool, current)
        solo_views = []
        for r in range(case.num_requests):
            alone, cur = _solo(case, r, current)
            solo_views.append(_per_request_reads(alone, pool, cur, device)[0][0])
            if not same_bytes(solo_views[r], truth[r]):
                print(f"  bs=1 run of {NAMES[r]} differs from the contract's truth")
                failures += 1

        views, reads = _per_request_reads(case, pool, current, device)
        verdicts = []
        for r in range(case.num_requests):
            ok = same_bytes(views[r], solo_views[r]) and same_bytes(reads[r], solo_views[r])
            failures += not ok
            verdicts.append(f"{NAMES[r]} {'== bs=1' if ok else 'MISMATCH vs bs=1'}")
        print(f"  per-request inverse, cp=1 ({device}): " + ", ".join(verdicts))

        if cp2:
            failures += _run_cp2(case, pool, current, solo_views, device)

        dense_1d, remapped_1d = value_keyed_pipeline(case, pool, current, _positions_locs(case))
        print("  1-D value-keyed inverse (negative control), cp=1:")
        for r in range(case.num_requests):
            n = case.prefix_lens[r] + case.extend_lens[r]
            wrong = []
            for p in range(n):
                d = int(remapped_1d[r, p])
                got = dense_1d[d] if d >= 0 else None
                if got is None or not same_bytes(got, solo_views[r][p]):
                    wrong.append((p, "nothing (dropped)" if got is None else _describe(got, case, pool, current)))
            if not wrong:
                print(
                    f"    {NAMES[r]}: == bs=1 ({'identical copies of shared pages' if name == REACHABLE else 'unaffected'})"
                )
            for p, what in wrong:
                print(f"    {NAMES[r]}: CONTAMINATED at position {p}: read {what}")
    print()
    if failures:
        print(f"FAIL: the per-request path mismatched in {failures} place(s)")
        return 1
    print(
        "OK: every request's dense KV view equals its bs=1 run with the per-request inverse (cp=1"
        + (" and cp=2)" if cp2 else ")")
        + "; the 1-D inverse contaminates only the collision batch, as expected."
    )
    return 0


def _run_cp2(
    case: BatchCase, pool: torch.Tensor, current: torch.Tensor, solo_views: list[torch.Tensor], device: torch.device
) -> int:
    from sglang_cpkv.testing.cp_dist import spawn_cp_ranks

    cp_case = BatchCase(
        case.page_size, case.capacity, case.page_tables, case.prefix_lens, case.extend_lens, 2, "interleave"
    )
    use_nccl = device.type == "cuda" and torch.cuda.device_count() >= 2
    topk = torch.full((case.num_tokens, 1), -1, dtype=torch.int64)
    results = spawn_cp_ranks(2, [(cp_case, pool, current, topk)], device="cuda" if use_nccl else "cpu")
    failures = 0
    parts = []
    for rank in range(2):
        views = _request_views(cp_case, rank, results[rank][0].dense)
        verdicts = []
        for r in range(case.num_requests):
            ok = same_bytes(views[r], solo_views[r])
            failures += not ok
            verdicts.append(f"{NAMES[r]} {'== bs=1' if ok else 'MISMATCH'}")
        parts.append(f"rank {rank}: " + ", ".join(verdicts))
    transport = "NCCL" if use_nccl else "gloo, 2 processes"
    print(f"  per-request inverse, cp=2 ({transport}, owner-sharded pools): " + "; ".join(parts))
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-cp2", action="store_true", help="skip the cp=2 run in two processes")
    args = parser.parse_args(argv)
    return run(cp2=not args.no_cp2)


if __name__ == "__main__":
    sys.exit(main())

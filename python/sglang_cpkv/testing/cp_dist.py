"""Run the CP shared-KV runtime on real CP ranks (separate processes, torch.distributed).

:func:`run_case_on_rank` is one rank's whole per-layer flow for a :class:`BatchCase` with a real
:class:`~sglang_cpkv.runtime.TorchDistCpGroup`: owner-sharded pool (pages not owned by the rank
poisoned), plan, history materialize through the page all-gather, current KV all-gathered from
the rank's split rows, fill, top-k remap of its local rows, persist of owned rows.
:func:`spawn_cp_ranks` runs it for a list of cases on ``cp`` spawned processes (gloo on CPU,
NCCL when ``device="cuda"``) and returns every rank's results; ``rank_fn`` swaps in another per-rank
flow (the multi-GPU harness runs its layer stack through it). Used by the gloo tests, the demo, and
the multi-GPU harness.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_cpkv.testing.batches import POISON_BYTE, BatchCase

# One case for the ranks: (case, full pool, current KV [N, row], top-k pool locs [N, K]).
CasePayload = tuple[BatchCase, torch.Tensor, torch.Tensor, torch.Tensor]
# What a rank runs per payload: (payload, CP group, device) -> picklable result. Module-level (spawn pickles it).
RankFn = Callable[[Any, Any, torch.device], Any]


def run_case_on_rank(payload: CasePayload, group, device: torch.device | str) -> dict[str, torch.Tensor]:
    """One rank's flow for one case (a collective: every rank of ``group`` must call it).

    Returns host tensors: ``dense`` (the rank's dense view), ``remapped`` (its local top-k rows),
    ``local_req_id``, ``pool_after`` (its pool after persisting owned rows), ``current_full``
    (the all-gathered current KV).
    """
    from sglang_cpkv.runtime import build_plan, layer

    case, pool_full, current_kv, topk_locs = payload
    device = torch.device(device)
    cp, rank = group.cp_size, group.cp_rank
    plan = build_plan(
        [list(t) for t in case.page_tables],
        case.prefix_lens,
        case.extend_lens,
        torch.tensor(case.out_cache_loc(), dtype=torch.int64, device=device),
        capacity=case.capacity,
        page_size=case.page_size,
        cp_size=cp,
        cp_rank=rank,
        strategy=case.effective_strategy,  # type: ignore[arg-type]
    )
    owner = torch.arange(case.capacity).repeat_interleave(case.page_size) % cp
    pool = pool_full.clone()
    pool.view(torch.uint8)[owner != rank] = POISON_BYTE
    pool = pool.to(device)
    dense = layer.new_dense_buffer(plan, tuple(pool.shape[1:]), pool.dtype)
    dense.view(torch.uint8).fill_(POISON_BYTE)
    layer.materialize_history(plan, pool, dense, group)
    local_kv = plan.split.shard(current_kv.to(device), 0)
    current_full = layer.gather_current(plan, local_kv, group)
    layer.fill_current(plan, current_full, dense)
    local_topk = plan.split.shard(topk_locs.to(device), -1, plan.local_token_index)
    remapped = layer.remap_topk(plan, local_topk, plan.local_req_id)
    layer.persist_owned_current(plan, current_full, pool)
    plan.raise_if_errors(f"rank {rank}")
    return {
        "dense": dense.cpu(),
        "remapped": remapped.cpu(),
        "local_req_id": plan.local_req_id.cpu(),
        "pool_after": pool.cpu(),
        "current_full": current_full.cpu(),
    }


def _worker(
    rank: int, cp: int, init_method: str, backend: str, device: str, payload_file: str, out_dir: str, rank_fn: RankFn
) -> None:
    from sglang_cpkv.runtime import TorchDistCpGroup

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=cp)
    try:
        group = TorchDistCpGroup()
        with open(payload_file, "rb") as f:
            payloads = pickle.load(f)
        results = [rank_fn(p, group, torch.device(device)) for p in payloads]
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


def spawn_cp_ranks(cp: int, payloads: list, device: str = "cpu", rank_fn: RankFn | None = None) -> list[list]:
    """Run every payload on ``cp`` spawned ranks; returns ``results[rank][payload]``.

    ``device="cpu"`` uses gloo; ``"cuda"`` uses NCCL with rank ``k`` on GPU ``k``. ``rank_fn``
    (default :func:`run_case_on_rank`, whose payloads are :data:`CasePayload` with ``cp_size``
    equal to ``cp``) is called on every rank as ``rank_fn(payload, group, device)``.
    """
    if rank_fn is None:
        rank_fn = run_case_on_rank
        bad = [c.cp_size for c, *_ in payloads if c.cp_size != cp]
        if bad:
            raise ValueError(f"cases with cp_size {bad} given to spawn_cp_ranks(cp={cp})")
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        payload_file = os.path.join(tmp, "payloads.pkl")
        with open(payload_file, "wb") as f:
            pickle.dump(payloads, f)
        init_method = Path(tmp, "rendezvous").as_uri()
        mp.spawn(_worker, args=(cp, init_method, backend, device, payload_file, tmp, rank_fn), nprocs=cp, join=True)
        out = []
        for rank in range(cp):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out

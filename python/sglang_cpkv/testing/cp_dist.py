"""Run CP ranks as separate processes (torch.distributed: gloo on CPU, NCCL on GPUs).

:func:`spawn_cp_ranks` runs a per-rank function for a list of payloads on ``cp`` spawned processes and
returns every rank's results; by default the function is
:func:`sglang_cpkv.testing.batches.run_case_on_rank` (one layer of a :class:`BatchCase` through the
runtime's pipeline). The multi-GPU harness passes its own per-rank job. Used by the gloo tests, the
demo and the harness; :mod:`sglang_cpkv.testing.lockstep` runs the same functions as threads.
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

from sglang_cpkv.testing.batches import run_case_on_rank

# What a rank runs per payload: (payload, CP group, device) -> picklable result. Module-level (spawn pickles it).
RankFn = Callable[[Any, Any, torch.device], Any]


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
    (default :func:`~sglang_cpkv.testing.batches.run_case_on_rank`, whose payloads are
    :data:`~sglang_cpkv.testing.batches.CasePayload` with ``cp_size`` equal to ``cp``) is called on every rank as ``rank_fn(payload, group, device)``.
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

"""Run CP ranks as separate processes (torch.distributed: gloo on CPU, NCCL on GPUs).

:func:`spawn_cp_ranks` runs :func:`sglang_cpkv.testing.batches.run_case_on_rank` (one layer of a
:class:`BatchCase` through the runtime's pipeline) for a list of payloads on ``cp`` spawned processes and returns
every rank's results. Used by the gloo tests and the demo; :mod:`sglang_cpkv.testing.lockstep` runs the same
function as threads.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_cpkv.testing.batches import run_case_on_rank


def _worker(rank: int, cp: int, init_method: str, backend: str, device: str, payload_file: str, out_dir: str) -> None:
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
        results = [run_case_on_rank(p, group, torch.device(device)) for p in payloads]
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(results, f)
    finally:
        dist.destroy_process_group()


def spawn_cp_ranks(cp: int, payloads: list, device: str = "cpu") -> list[list]:
    """Run every payload (a :data:`~sglang_cpkv.testing.batches.CasePayload` with ``cp_size`` equal to ``cp``) on
    ``cp`` spawned ranks; returns ``results[rank][payload]``. ``device="cpu"`` uses gloo; ``"cuda"`` uses NCCL with
    rank ``k`` on GPU ``k``."""
    bad = [c.cp_size for c, *_ in payloads if c.cp_size != cp]
    if bad:
        raise ValueError(f"cases with cp_size {bad} given to spawn_cp_ranks(cp={cp})")
    backend = "nccl" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory() as tmp:
        payload_file = os.path.join(tmp, "payloads.pkl")
        with open(payload_file, "wb") as f:
            pickle.dump(payloads, f)
        init_method = Path(tmp, "rendezvous").as_uri()
        mp.spawn(_worker, args=(cp, init_method, backend, device, payload_file, tmp), nprocs=cp, join=True)
        out = []
        for rank in range(cp):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out

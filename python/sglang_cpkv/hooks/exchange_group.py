"""Start-up of ``--enable-cp-shared-kv`` in a model-parallel process: the history exchange's group.

Called from ``patches/core/create-cp-shared-kv-exchange-group.patch`` right after ``initialize_model_parallel``
builds upstream's attention-CP ``GroupCoordinator``: :func:`on_attn_cp_group_created` (every rank, same point) makes
a ``torch.distributed`` group of its own over the same ranks (the layer-ahead all-gathers run on a side stream, and
one communicator's NCCL operations must not run from two streams). The group is process state (:mod:`.state`),
shared by the target's and the draft's backends. Design: ``docs/design/cp-shared-kv.md`` section 2, "Exchange
group".
"""

from __future__ import annotations

from typing import Any

from sglang_cpkv.hooks import state
from sglang_cpkv.hooks.settings import enabled
from sglang_cpkv.ops.errors import CpSharedKvError
from sglang_cpkv.runtime.group import TorchDistCpGroup


def create_exchange_group(ranks: list[int], backend: str) -> TorchDistCpGroup:
    """A process group over ``ranks`` (this rank's attention-CP group) for the history exchange.

    Only the members call it (``use_local_synchronization``), each at the same point of its start-up,
    so no other rank has to take part; every member of every CP group makes its own.
    """
    import torch.distributed as dist

    process = state.current()
    if process.exchange_group is not None:
        raise CpSharedKvError("the CP shared-KV exchange group was already created in this process")
    group = dist.new_group(ranks=sorted(ranks), backend=backend, use_local_synchronization=True)
    process.exchange_group = TorchDistCpGroup(group)
    return process.exchange_group


def exchange_group() -> TorchDistCpGroup:
    """The group :func:`create_exchange_group` made at start-up."""
    group = state.current().exchange_group
    if group is None:
        raise CpSharedKvError(
            "--enable-cp-shared-kv: no CP shared-KV exchange group in this process; it is made right after "
            "upstream's attention-CP group (initialize_model_parallel hook of "
            "patches/core/create-cp-shared-kv-exchange-group.patch)"
        )
    return group


def on_attn_cp_group_created(attn_cp_group: Any) -> None:
    """Mode on and ``attn_cp_size > 1``: make the exchange group (see the module docstring)."""
    if not enabled() or attn_cp_group.world_size <= 1:
        return
    import torch.distributed as dist

    create_exchange_group(list(attn_cp_group.ranks), dist.get_backend(attn_cp_group.device_group))

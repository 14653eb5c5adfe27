"""Start row of each local query's request in the dense KV buffer the RAGGED top-k addresses.

Called from ``patches/upstream-fixes/fix-ragged-topk-offsets-under-interleave-cp.patch`` (the DSA backend's
``init_forward_metadata``). A top-k position ``p`` of request ``i`` becomes ``p + offset``, a row of one dense KV
buffer of the batch: with a cached prefix in the batch, ``page_table_1_flattened`` over the requests this rank keeps
(offset: ``cu_seqlens_k`` over the kept requests, as upstream computes); without one, the all-gathered current chunk
of **every** request (offset: the extend lengths of all earlier requests, dropped ones included). Upstream 0.5.23
counts only the kept requests in both cases: ``docs/upstream-findings.md`` item 1.
"""

from __future__ import annotations

import torch


def ragged_topk_indices_offset(
    kept_cu_seqlens_k: torch.Tensor,
    local_extend_lens: torch.Tensor,
    num_local_tokens: int,
    *,
    kv_is_current_chunk: bool,
    batch_extend_lens: torch.Tensor,
    kept_batch_idx: torch.Tensor | None,
) -> torch.Tensor:
    """Per local query row, the first row of its request's keys in the RAGGED KV buffer.

    Args:
        kept_cu_seqlens_k: ``[kept + 1]`` cumulative full sequence lengths of the kept requests
            (upstream's ``cu_seqlens_k`` after the CP cut), int32.
        local_extend_lens: ``[kept]`` local query count of each kept request, on the device.
        num_local_tokens: ``sum(local_extend_lens)``, known on the host; passed so the expansion
            does not read it back from the device.
        kv_is_current_chunk: True when the kernel's KV is the (gathered) current chunk of every
            request, i.e. no request of the batch has a cached prefix.
        batch_extend_lens: ``[bs]`` extend length of every request of the batch, in batch order.
        kept_batch_idx: ``[kept]`` batch index of each kept request (``bs_idx``), or None when the
            rank keeps every request.

    Returns:
        ``[num_local_tokens]`` offsets, dtype of ``kept_cu_seqlens_k``.
    """
    if kv_is_current_chunk and kept_batch_idx is not None:
        if batch_extend_lens.dim() != 1 or kept_batch_idx.dim() != 1:
            raise ValueError(
                f"batch_extend_lens and kept_batch_idx must be 1-D, got shapes "
                f"{tuple(batch_extend_lens.shape)} and {tuple(kept_batch_idx.shape)}"
            )
        chunk_starts = torch.cumsum(batch_extend_lens, dim=0, dtype=kept_cu_seqlens_k.dtype) - batch_extend_lens.to(
            kept_cu_seqlens_k.dtype
        )
        request_starts = chunk_starts[kept_batch_idx.long()]
    else:
        request_starts = kept_cu_seqlens_k[:-1]
    if request_starts.shape[0] != local_extend_lens.shape[0]:
        raise ValueError(
            f"one start per kept request expected: {request_starts.shape[0]} starts for "
            f"{local_extend_lens.shape[0]} local extend lengths"
        )
    return torch.repeat_interleave(request_starts, local_extend_lens, output_size=num_local_tokens)

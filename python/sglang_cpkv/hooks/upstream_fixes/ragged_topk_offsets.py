"""Start row of each local query's request in the dense KV buffer the RAGGED top-k addresses.

Upstream's DSA prefill with the RAGGED top-k transform (FP8 KV + ``flashmla_sparse``,
``flashmla_sparse_q8`` or ``triton_sparse_mla``) turns a top-k position ``p`` of a query of
request ``i`` (``p`` counted from the start of request ``i``'s keys) into ``p + offset``, a row of
one dense KV buffer shared by the batch. The offset must be where request ``i``'s keys start in
*that buffer*, and the buffer depends on the batch:

* a cached prefix somewhere in the batch: ``page_table_1_flattened``, the full sequences of the
  requests this rank keeps, request-major; the start of kept request ``j`` is
  ``cu_seqlens_k[j]`` over the kept requests (what upstream computes);
* no cached prefix: ``cat(k, k_rope)``, the current chunk of **every** request of the batch (under
  interleave CP, the all-gathered chunk in global token order); the start of request ``i`` is the
  sum of the extend lengths of requests ``0..i-1``, dropped requests included.

Under interleave CP a rank keeps only the requests with at least one local query
(``shard_per_request``'s ``bs_idx``). Upstream 0.5.23 computes the offsets over the kept requests
in both cases, so in the second case every request after a dropped one reads keys shifted into the
requests before it (see ``docs/upstream-findings.md``).
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

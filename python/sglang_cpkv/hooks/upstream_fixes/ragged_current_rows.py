"""Keys of a request without history on the RAGGED top-k route: its chunk's bf16 rows in any batch.

Called by ``patches/upstream-fixes/read-history-less-requests-alike-on-ragged.patch`` (``dsa_backend.py``). On the
RAGGED route (an FP8 656-byte KV cache with ``flashmla_sparse`` or ``triton_sparse_mla`` prefill) upstream picks
the kernel's keys for the whole batch: with a cached prefix anywhere in it, every kept request's keys are its rows of
the paged FP8 cache (``page_table_1_flattened``, dequantized); without, ``cat(k, k_rope)``, the chunk's bf16 rows. A
request without history so reads bf16 keys alone and FP8-rounded keys beside a request with history, and its
output depends on its batch (``docs/upstream-findings.md`` item 3). The fix keeps upstream's buffer and writes each
history-less request's bf16 chunk rows over its dequantized rows, the cheaper of the two forms (the other reads every
chunk through the FP8 cache): one gather and one scatter of those requests' rows per layer, nothing for the others.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def history_less_rows(
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    kept_batch_idx: Sequence[int] | None,
    kept_kv_lens: Sequence[int],
    device: torch.device | str,
) -> torch.Tensor | None:
    """Where each history-less kept request's keys sit in the two RAGGED KV buffers: int64 ``[2, n]`` on
    ``device`` (row 0: rows of the dequantized ``page_table_1_flattened`` buffer; row 1: the same keys' rows of the
    chunk ``cat(k, k_rope)``), or None when every kept request has history. Host arithmetic once per batch.

    Args:
        prefix_lens, extend_lens: every request of the batch, batch order (``extend_prefix_lens_cpu``,
            ``extend_seq_lens_cpu`` before the CP cut): the chunk holds every request's current tokens, in order
            (under interleave CP, the all-gathered chunk).
        kept_batch_idx: the batch row of each request this rank keeps (upstream's ``bs_idx``), None: every row.
        kept_kv_lens: the keys of each kept request in the flattened buffer (upstream's ``indexer_seq_lens_cpu``:
            its keys up to its last local query), request-major.

    Raises:
        ValueError: lengths that disagree (a history-less request with more keys than current tokens).
    """
    prefix, extend = [int(n) for n in prefix_lens], [int(n) for n in extend_lens]
    kept = list(range(len(prefix))) if kept_batch_idx is None else [int(b) for b in kept_batch_idx]
    kv_lens = [int(n) for n in kept_kv_lens]
    if len(prefix) != len(extend) or len(kept) != len(kv_lens):
        raise ValueError(
            f"{len(prefix)} prefix and {len(extend)} extend lengths; {len(kept)} kept rows and {len(kv_lens)} key counts"
        )
    chunk_start = [0]
    for n in extend:
        chunk_start.append(chunk_start[-1] + n)
    flat_starts, chunk_starts, counts = [], [], []
    flat = 0
    for b, keys in zip(kept, kv_lens):
        if prefix[b] == 0 and keys:
            if keys > extend[b]:
                raise ValueError(f"request {b} has no history and {extend[b]} current tokens but {keys} keys")
            flat_starts.append(flat)
            chunk_starts.append(chunk_start[b])
            counts.append(keys)
        flat += keys
    if not counts:
        return None
    starts = torch.tensor([flat_starts, chunk_starts], dtype=torch.int64)
    lengths = torch.tensor(counts, dtype=torch.int64)
    within = torch.arange(sum(counts)) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    rows = torch.repeat_interleave(starts, lengths, dim=1) + within
    device = torch.device(device)
    if device.type == "cuda":  # staged through pinned memory: no host sync
        rows = rows.pin_memory()
    return rows.to(device, non_blocking=True)


def write_history_less_rows(
    kv: torch.Tensor, k: torch.Tensor, k_rope: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """``kv`` (the dequantized ``[keys, 1, dim]`` buffer) with the rows ``rows`` names (:func:`history_less_rows`)
    replaced by the chunk's ``cat(k, k_rope)`` rows, in place; ``kv`` unchanged when ``rows`` is None."""
    if rows is None:
        return kv
    width = kv.shape[-1]
    if k.shape[-1] + k_rope.shape[-1] != width:
        raise ValueError(f"k ({k.shape[-1]}) and k_rope ({k_rope.shape[-1]}) widths do not add up to the keys' {width}")
    src = rows[1]
    chunk_rows = torch.cat(
        [k.reshape(-1, k.shape[-1]).index_select(0, src), k_rope.reshape(-1, k_rope.shape[-1]).index_select(0, src)],
        dim=-1,
    )
    kv.view(-1, width).index_copy_(0, rows[0], chunk_rows.to(kv.dtype))
    return kv

"""Random inputs for the CP shared-KV ops, shared by the parity tests and the benchmark.

Every builder draws from an explicit ``torch.Generator`` on the CPU and returns tensors on the
requested device, so two backends are always fed the same bytes. Row payloads are random bit
patterns (never zeros: they would hide unwritten rows), compared byte for byte.

Row layouts (``ROW_LAYOUTS``): ``bf16`` rows of 1152 bytes (576 bf16: the DSA latent 512 + rope
64) and ``fp8_packed`` rows of 656 bytes viewed as uint8 (the packed FP8 DSA layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_LAYOUTS: dict[str, tuple[torch.dtype, int]] = {
    "bf16": (torch.bfloat16, 576),
    "fp8_packed": (torch.uint8, 656),
}


def random_rows(rows: int, layout: str, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[rows, width]`` of ``layout``, every byte random."""
    dtype, width = ROW_LAYOUTS[layout]
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact equality (NaN bit patterns included), shapes and dtypes equal."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@dataclass(frozen=True)
class PagedBatch:
    """Page tables of one batch: ``page_table[r]`` = request ``r``'s distinct page ids, then -1."""

    page_table: torch.Tensor  # int32 [R, P], on the CPU
    pages: tuple[int, ...]  # pages held by each request
    capacity: int
    page_size: int


def random_batch(
    batch_rows: int,
    page_size: int,
    capacity: int,
    max_pages: int,
    gen: torch.Generator,
    *,
    shared_pages: tuple[int, ...] = (),
    pages_per_request: int = 0,
) -> PagedBatch:
    """Random page tables: sparse page sets drawn from the whole pool, distinct within a request.

    Pages are shared across requests (every request holding ``shared_pages`` first, then
    collisions of the independent draws), as the contract allows. ``pages_per_request`` pads the
    table width (0: the largest request).
    """
    tables = []
    for _ in range(batch_rows):
        count = int(torch.randint(max(1, len(shared_pages)), max_pages + 1, (), generator=gen))
        own = [p for p in torch.randperm(capacity, generator=gen).tolist() if p not in shared_pages]
        tables.append(list(shared_pages) + own[: count - len(shared_pages)])
    width = max(pages_per_request, max(len(t) for t in tables))
    table = torch.full((batch_rows, width), -1, dtype=torch.int32)
    for r, pages in enumerate(tables):
        table[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return PagedBatch(table, tuple(len(t) for t in tables), capacity, page_size)


def current_locs(batch: PagedBatch, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Current-token locations ``[N]`` (int64) and request ids ``[N]``: each request's last
    tokens, starting mid-page, on its own pages."""
    locs, req = [], []
    for r, n_pages in enumerate(batch.pages):
        total = n_pages * batch.page_size
        start = int(torch.randint(0, total, (), generator=gen))
        pos = torch.arange(start, total)
        locs.append(batch.page_table[r, pos // batch.page_size].to(torch.int64) * batch.page_size + pos % batch.page_size)
        req.append(torch.full_like(pos, r))
    return torch.cat(locs), torch.cat(req)


def topk_locs(batch: PagedBatch, rows: int, topk: int, gen: torch.Generator, *, padding: float = 0.1, absent: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k locations ``[rows, topk]`` (int64) with request ids ``[rows]``.

    Mostly locations on the row's request's pages; a fraction ``padding`` is -1 (and one row in
    eight is a padding row, request id -1), a fraction ``absent`` is on any pool page (usually one
    the request does not hold: it maps to -1).
    """
    req = torch.randint(0, len(batch.pages), (rows,), generator=gen)
    req[torch.rand(rows, generator=gen) < 0.125] = -1
    held = torch.tensor(batch.pages)[req.clamp(min=0)]
    j = (torch.rand(rows, topk, generator=gen) * held[:, None]).long()
    page = batch.page_table[req.clamp(min=0)[:, None], j].to(torch.int64)
    loc = page * batch.page_size + torch.randint(0, batch.page_size, (rows, topk), generator=gen)
    draw = torch.rand(rows, topk, generator=gen)
    anywhere = torch.randint(0, batch.capacity * batch.page_size, (rows, topk), generator=gen)
    loc = torch.where(draw < absent, anywhere, loc)
    loc = torch.where(draw > 1 - padding, torch.full_like(loc, -1), loc)
    return loc, req


def interleave_split(values: torch.Tensor, cp_size: int, rank: int, pad_value: int = -1) -> torch.Tensor:
    """Rank ``rank``'s share of a token-major tensor under upstream 0.5.23's interleave split:
    tokens ``rank, rank + cp, ...``, padded with ``pad_value`` to ``roundup(ceil(N / cp), cp)``
    rows (a padded row has no location and request id -1)."""
    n = values.shape[0]
    local = values[rank::cp_size]
    longest = -(-n // cp_size)
    padded = -(-longest // cp_size) * cp_size
    out = torch.full((padded, *values.shape[1:]), pad_value, dtype=values.dtype, device=values.device)
    out[: local.shape[0]] = local
    return out


def unique_targets(count: int, targets: int, gen: torch.Generator, *, skip: float = 0.0) -> torch.Tensor:
    """``count`` distinct indices in ``[0, targets)`` (int64), a fraction ``skip`` set to -1."""
    if count > targets:
        raise ValueError(f"cannot draw {count} distinct targets out of {targets}")
    idx = torch.randperm(targets, generator=gen)[:count]
    idx[torch.rand(count, generator=gen) < skip] = -1
    return idx

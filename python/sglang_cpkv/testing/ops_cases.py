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
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


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
        locs.append(
            batch.page_table[r, pos // batch.page_size].to(torch.int64) * batch.page_size + pos % batch.page_size
        )
        req.append(torch.full_like(pos, r))
    return torch.cat(locs), torch.cat(req)


def topk_locs(
    batch: PagedBatch, rows: int, topk: int, gen: torch.Generator, *, padding: float = 0.1, absent: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
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


def run_layer_sequence(
    impl,
    batch: PagedBatch,
    layout: str,
    *,
    cp_size: int = 1,
    topk_shape: tuple[int, int] = (6, 16),
    skip: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """One batch's and one layer's op sequence through ``impl`` (a module with the four ops).

    Inverse build; history materialize, one pass per CP rank over the pages it owns (the others
    masked with -1); current fill, each rank remapping and scattering its interleave share with
    -1 padding (a fraction ``skip`` of current tokens has no location); a top-k remap (int32
    locations). Inputs depend only on ``seed`` and the batch, so two backends see the same bytes.

    Returns the outputs and the inputs the truth needs: ``inverse``, ``dense`` ([R*P, page]),
    ``topk_dense``, ``errors``, and ``pool``, ``current``, ``locs``, ``req``, ``dense_before``.
    """
    page_size, capacity = batch.page_size, batch.capacity
    rows, width = batch.page_table.shape
    slots = rows * width
    gen = torch.Generator().manual_seed(seed)
    pool = random_rows(capacity * page_size, layout, gen, device).view(capacity, -1)
    dense = random_rows(slots * page_size, layout, gen, device).view(slots, -1)
    dense_before = dense.clone()
    locs, req = current_locs(batch, gen)
    locs[torch.rand(locs.numel(), generator=gen) < skip] = -1
    current = random_rows(locs.numel(), layout, gen, device)
    tk_locs, tk_req = topk_locs(batch, *topk_shape, gen)
    locs, req = locs.to(device), req.to(device)

    errors = torch.zeros(3, dtype=torch.int32, device=device)
    table = batch.page_table.to(device)
    inverse = impl.build_page_inverse(table, capacity, errors)
    flat = table.view(-1).to(torch.int64)
    slot_ids = torch.arange(slots, dtype=torch.int32, device=device)
    for rank in range(cp_size):
        owned = torch.where((flat >= 0) & (flat % cp_size == rank), flat, -1).to(torch.int32)
        impl.copy_pages(pool, owned, dense, slot_ids, errors)
    dense_rows = dense.view(slots * page_size, -1)
    for rank in range(cp_size):
        rank_locs = interleave_split(locs, cp_size, rank)
        rank_req = interleave_split(req, cp_size, rank)
        rank_rows = interleave_split(current, cp_size, rank, pad_value=0)
        dense_locs = impl.remap_locs(rank_locs, rank_req, inverse, capacity, page_size, errors)
        impl.scatter_rows(rank_rows, dense_locs, dense_rows, errors)
    topk_dense = impl.remap_locs(
        tk_locs.to(torch.int32).to(device), tk_req.to(device), inverse, capacity, page_size, errors
    )
    return {
        "inverse": inverse,
        "dense": dense,
        "topk_dense": topk_dense,
        "errors": errors,
        "pool": pool,
        "current": current,
        "locs": locs,
        "req": req,
        "dense_before": dense_before,
    }


def truth_dense(batch: PagedBatch, run: dict[str, torch.Tensor]) -> torch.Tensor:
    """The contract's dense views after :func:`run_layer_sequence`, by brute force (no inverse):
    slot ``r*P + j`` holds pool page ``page_table[r, j]``, then each current token of request
    ``r`` overwrites its own slot's row. Slots past a request's pages keep their bytes."""
    ps = batch.page_size
    table = batch.page_table.tolist()
    width = batch.page_table.shape[1]
    dense = run["dense_before"].cpu().clone()
    pool = run["pool"].cpu()
    for r, pages in enumerate(table):
        for j, page in enumerate(pages):
            if page >= 0:
                dense[r * width + j] = pool[page]
    rows = dense.view(dense.shape[0] * ps, -1)
    current = run["current"].cpu()
    for i, (loc, r) in enumerate(zip(run["locs"].tolist(), run["req"].tolist())):
        if loc >= 0:
            j = table[r].index(loc // ps)
            rows[(r * width + j) * ps + loc % ps] = current[i]
    return dense

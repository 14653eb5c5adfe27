"""Batches for CP shared-KV tests: a generator, hypothesis strategies, and the brute-force truth (TEST-ONLY).

:class:`BatchCase` describes one extend batch on the host; :func:`generate_case` draws one from any integer source
(:func:`random_case`, :func:`batch_cases`); :func:`truth_rows` is the contract's truth by brute force;
:func:`run_case_on_rank` runs one CP rank's layer through the runtime's pipeline and :func:`check_against_truth`
reports every mismatch. Callers: the runtime and kernel tests, the demo, the harness. The truth and the state classes
(REACHABLE, COLLISION): ``docs/design/cp-shared-kv-testing.md`` ("Batches and the truth").
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_cpkv import ops
from sglang_cpkv.ops import reference
from sglang_cpkv.ops.errors import (
    ERR_CURRENT_LOC_MISMATCH,
    ERR_LOC_OUT_OF_RANGE,
    ERR_PAGE_OUT_OF_RANGE,
    ERR_REQ_OUT_OF_RANGE,
    NUM_ERROR_KINDS,
)
from sglang_cpkv.runtime import (
    CpGroup,
    CpSharedKvPlan,
    LayerPipeline,
    as_bytes,
    build_cp_split,
    build_plan,
    page_owner,
    rows_kind,
    split_applies,
)
from sglang_cpkv.runtime.plan import PlanStaging
from sglang_cpkv.runtime.reservation import Reservation
from sglang_cpkv.testing.lockstep import run_lockstep

REACHABLE = "reachable-0.5.23"
COLLISION = "collision"

Draw = Callable[[int, int], int]  # an integer in [lo, hi], both inclusive


@dataclass(frozen=True)
class BatchCase:
    """One extend batch. ``page_tables[r]`` lists exactly ``ceil((prefix+extend)/page_size)`` pages."""

    page_size: int
    capacity: int
    page_tables: tuple[tuple[int, ...], ...]
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    cp_size: int = 1
    strategy: str = "interleave"

    def __post_init__(self) -> None:
        if self.capacity % self.cp_size:
            raise ValueError(
                f"capacity {self.capacity} is not a multiple of cp_size {self.cp_size}: under CP the page ids number "
                "cp x one rank's pool pages"
            )

    def on_cp(self, cp_size: int, strategy: str = "interleave") -> BatchCase:
        """This batch on ``cp_size`` CP ranks: the same pages, its capacity rounded up to a multiple of ``cp_size``."""
        capacity = cp_size * -(-self.capacity // cp_size)
        return dataclasses.replace(self, capacity=capacity, cp_size=cp_size, strategy=strategy)

    @property
    def pool_pages_per_rank(self) -> int:
        """Pages of each CP rank's pool (``capacity / cp_size``; page ``p`` at ``p // cp_size`` of its owner)."""
        return self.capacity // self.cp_size

    @property
    def num_requests(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def effective_strategy(self) -> str:
        """The strategy upstream would use: the requested one if it applies, else ``"none"``."""
        return self.strategy if split_applies(self.strategy, self.extend_lens, self.cp_size) else "none"  # type: ignore[arg-type]

    def pool_loc(self, r: int, p: int) -> int:
        """Pool location of logical position ``p`` of request ``r``."""
        return self.page_tables[r][p // self.page_size] * self.page_size + p % self.page_size

    def out_cache_loc(self) -> list[int]:
        """Pool locations of the current tokens, token order (request-major)."""
        return [
            self.pool_loc(r, p)
            for r in range(self.num_requests)
            for p in range(self.prefix_lens[r], self.prefix_lens[r] + self.extend_lens[r])
        ]

    @property
    def state_class(self) -> str:
        """:data:`REACHABLE` or :data:`COLLISION` (docs/design/cp-shared-kv-testing.md)."""
        holders: dict[int, list[tuple[int, int]]] = {}
        for r, table in enumerate(self.page_tables):
            for j, page in enumerate(table):
                holders.setdefault(page, []).append((r, j))
        for pairs in holders.values():
            if len({r for r, _ in pairs}) < 2:
                continue
            if any((j + 1) * self.page_size > self.prefix_lens[r] for r, j in pairs):
                return COLLISION
        return REACHABLE


SHARED_HISTORY = "shared-history"  # a page two requests read only as history (one shared history slot)
HISTORY_WRITTEN = "history-written"  # a page one request reads as history and another writes as current
SHARED_REUSE = "shared-current-reuse"  # a page two requests read as history, one of them continuing it (CURRENT_REUSE)


def sharing_patterns(case: BatchCase) -> set[str]:
    """Which of the dense layout's sharing patterns ``case`` holds (:data:`SHARED_HISTORY`, :data:`HISTORY_WRITTEN`,
    :data:`SHARED_REUSE`): the states the shared history slots must keep apart."""
    ps = case.page_size
    readers: dict[int, set[int]] = {}
    full_readers: dict[int, set[int]] = {}
    writers: dict[int, set[int]] = {}
    for r, table in enumerate(case.page_tables):
        for j, page in enumerate(table):
            history = min(max(case.prefix_lens[r] - j * ps, 0), ps)
            if history:
                readers.setdefault(page, set()).add(r)
            if history == ps:
                full_readers.setdefault(page, set()).add(r)
            else:
                writers.setdefault(page, set()).add(r)
    patterns = set()
    for page, rs in full_readers.items():
        if len(rs) > 1 and page not in writers:
            patterns.add(SHARED_HISTORY)
    for page, rs in readers.items():
        if any(w != r for w in writers.get(page, ()) for r in rs):
            patterns.add(HISTORY_WRITTEN)
        if len(rs) > 1 and writers.get(page, set()) & rs:
            patterns.add(SHARED_REUSE)
    return patterns


def generate_case(
    draw: Draw, max_requests: int = 8, max_cp: int = 8, page_sizes: tuple[int, ...] = (1, 2, 4)
) -> BatchCase:
    """Draw a batch: page sharing (aligned and partial), colliding page ids, partial pages,
    chunked continuation (history ending mid-page), ``cp`` in ``[1, max_cp]``, bs in ``[1, max_requests]``."""
    page_size = page_sizes[draw(0, len(page_sizes) - 1)]
    bs = draw(1, max_requests)
    cp = draw(1, max_cp)
    strategy = ("interleave", "zigzag")[draw(0, 1)] if cp > 1 else "interleave"
    max_pages = 6  # prefix <= 3 pages, extend <= 3 pages
    capacity = cp * -(-(bs * max_pages + 1 + draw(0, 7)) // cp)  # cp x each rank's pool pages
    fresh = list(range(capacity))
    random.Random(draw(0, 2**16)).shuffle(fresh)
    tables: list[tuple[int, ...]] = []
    prefix_lens: list[int] = []
    extend_lens: list[int] = []
    for _ in range(bs):
        prefix = draw(0, 3 * page_size)
        extend = draw(1, 3 * page_size)
        history_pages = -(-prefix // page_size)
        total_pages = -(-(prefix + extend) // page_size)
        table: list[int] = []
        for j in range(total_pages):
            mode = draw(0, 9)
            candidates: list[int] = []
            if j < history_pages and 5 <= mode <= 8:
                candidates = [t[j] for t in tables if len(t) > j]  # prefix sharing at the same position
            if (j < history_pages and mode == 9) or (j >= history_pages and mode >= 8):
                candidates = [page for t in tables for page in t]  # page id reused anywhere (collision)
            candidates = [page for page in candidates if page not in table]
            if candidates:
                table.append(candidates[draw(0, len(candidates) - 1)])
            else:
                table.append(fresh.pop())  # never handed out before: new to every table
        tables.append(tuple(table))
        prefix_lens.append(prefix)
        extend_lens.append(extend)
    return BatchCase(page_size, capacity, tuple(tables), tuple(prefix_lens), tuple(extend_lens), cp, strategy)


def random_case(rng: random.Random, **kwargs) -> BatchCase:
    """:func:`generate_case` from a ``random.Random``."""
    return generate_case(lambda lo, hi: rng.randint(lo, hi), **kwargs)


def batch_cases(**kwargs):
    """A hypothesis strategy of :class:`BatchCase` (imports hypothesis lazily)."""
    from hypothesis import strategies as st

    @st.composite
    def _cases(draw_fn):
        return generate_case(lambda lo, hi: draw_fn(st.integers(lo, hi)), **kwargs)

    return _cases()


def sparse_case(
    num_requests: int,
    page_size: int,
    capacity: int,
    max_pages: int,
    gen: torch.Generator,
    *,
    shared_pages: tuple[int, ...] = (),
) -> BatchCase:
    """A batch on sparse page sets drawn from the whole pool (distinct within a request), each request
    holding ``shared_pages`` first, its history ending anywhere (mid-page too) and its current tokens after
    it: the op-level tests' and benchmarks' inputs (collisions between independent draws included)."""
    tables, prefix_lens, extend_lens = [], [], []
    for _ in range(num_requests):
        count = int(torch.randint(max(1, len(shared_pages)), max_pages + 1, (), generator=gen))
        own = [p for p in torch.randperm(capacity, generator=gen).tolist() if p not in shared_pages]
        tables.append(tuple(shared_pages) + tuple(own[: count - len(shared_pages)]))
        total = int(torch.randint((count - 1) * page_size + 1, count * page_size + 1, (), generator=gen))
        prefix = int(torch.randint(0, total, (), generator=gen))
        prefix_lens.append(prefix)
        extend_lens.append(total - prefix)
    return BatchCase(page_size, capacity, tuple(tables), tuple(prefix_lens), tuple(extend_lens))


def flat_slots(page_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entry_pages, entry_req)`` of a ``[R, P]`` page table (entries -1 pad): the op-level input of
    ``build_page_inverse`` for a hand-made table, whose default slots put entry ``(r, j)`` at slot ``r * P + j``
    (plans pass their own slots: the dense layout of :mod:`sglang_cpkv.runtime.plan`, shared history slots included)."""
    rows, width = page_table.shape
    entry_req = torch.arange(rows, dtype=torch.int64, device=page_table.device).repeat_interleave(width)
    return page_table.reshape(-1), entry_req


def inverse_table(inverse: ops.PageInverse) -> torch.Tensor:
    """int32 ``[R * C]`` on the inverse's device: the slot each ``(request, page id)`` finds (index ``r * C + page``),
    -1 elsewhere; how a test reads an inverse whole (tables of a few thousand entries)."""
    rows, capacity = inverse.num_requests, inverse.capacity
    device = inverse.device
    req = torch.arange(rows, dtype=torch.int64, device=device).repeat_interleave(capacity)
    page = torch.arange(capacity, dtype=torch.int64, device=device).repeat(rows)
    return reference.lookup_slots(inverse, req, page).to(torch.int32)


def assert_same_inverse(want: ops.PageInverse, have: ops.PageInverse) -> None:
    """Two builds of one inverse are the same canonical table: sizes, every cell's key and slot."""
    assert (have.capacity, have.num_requests) == (want.capacity, want.num_requests)
    assert torch.equal(have.keys.cpu(), want.keys.cpu()), (have.keys, want.keys)
    assert torch.equal(have.slots.cpu(), want.slots.cpu()), (have.slots, want.slots)


# Issue 33's B300 batch: the reservation and the widened page ids upstream's sizing gives GLM-5.1-FP8 at TP 8 / CP 8,
# chunk 65,536, flashmla_kv (budget 0.85 x HBM - the weights; a rank's pool of 38,438 pages, so C = 8 x 38,438).
# capacity/test_capacity_planner.py derives both through upstream and checks them against these; the GPU peak test
# (runtime/test_runtime_cuda.py) uses them where upstream's sizing does not run.
B300_GLM51_RESERVATION = Reservation(
    max_batch_tokens=332800,
    chunk_tokens=65536,
    page_size=64,
    cp_size=8,
    layer_ahead=True,
    latent_token_bytes=656,
    index_k_token_bytes=132,
)
B300_GLM51_CAPACITY = 8 * 38438


def shared_prompt_batch(
    requests: int, prompt_pages: int, new_tokens: int, cp_size: int, page_size: int
) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """Issue 33's admission-sized batch: ``requests`` requests on one cached ``prompt_pages``-page prompt, each with
    ``new_tokens`` current tokens on a page of its own. Returns ``build_plan``'s page table, prefix and extend lengths
    and ``out_cache_loc`` (host lists); page ids ``[0, cp_size)`` are left out (reserved)."""
    shared = list(range(cp_size, cp_size + prompt_pages))
    own = [cp_size + prompt_pages + r for r in range(requests)]
    table = [shared + [own[r]] for r in range(requests)]
    locs = [own[r] * page_size + t for r in range(requests) for t in range(new_tokens)]
    return table, [prompt_pages * page_size] * requests, [new_tokens] * requests, locs


def current_locs(case: BatchCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The current tokens' pool locations ``[N]`` (int64, token order) and request ids ``[N]``."""
    req = [r for r in range(case.num_requests) for _ in range(case.extend_lens[r])]
    return torch.tensor(case.out_cache_loc(), dtype=torch.int64), torch.tensor(req, dtype=torch.int64)


@dataclass(frozen=True)
class CurrentLocsCase:
    """Operands of ``ops.current_dense_locs`` with the answers worked out apart from any op: every request's current
    tokens in consecutive own slots (from a random offset in its first), after ``history`` slots, each slot holding a
    distinct random page id and the last one none (a rounding slot); ``disagreeing`` tokens carry another location."""

    token_ends: torch.Tensor
    dense_offsets: torch.Tensor
    out_cache_loc: torch.Tensor
    slot_pages: torch.Tensor
    page_size: int
    dense_locs: list[int]  # each token's dense location
    disagreeing: int  # the tokens whose out_cache_loc is not their slot's location

    def operands(self, device: torch.device | str = "cpu", loc_dtype: torch.dtype = torch.int64) -> tuple:
        return (
            self.token_ends.to(device),
            self.dense_offsets.to(device),
            self.out_cache_loc.to(loc_dtype).to(device),
            self.slot_pages.to(device),
            self.page_size,
        )


def current_locs_case(
    extend_lens: tuple[int, ...], page_size: int, capacity: int, gen: torch.Generator, history: int = 3
) -> CurrentLocsCase:
    offsets, dense, slot, token = [], [], history, 0
    for n in extend_lens:
        start = int(torch.randint(0, page_size, (1,), generator=gen)) if n else 0
        first = slot * page_size + start
        offsets.append(first - token if n else 0)
        dense += range(first, first + n)
        slot += -(-(start + n) // page_size)
        token += n
    if slot + 1 > capacity:
        raise ValueError(f"{slot + 1} slots need more than capacity {capacity} page ids")
    slot_pages = torch.randperm(capacity, generator=gen)[: slot + 1].to(torch.int32)
    slot_pages[slot] = -1
    where = torch.tensor(dense, dtype=torch.int64)
    locs = slot_pages[where // page_size].to(torch.int64) * page_size + where % page_size
    moved = torch.rand(locs.shape, generator=gen) < 0.1
    locs[moved] = (locs[moved] + page_size) % (capacity * page_size)  # another page's row
    return CurrentLocsCase(
        token_ends=torch.tensor(extend_lens, dtype=torch.int64).cumsum(0),
        dense_offsets=torch.tensor(offsets, dtype=torch.int64),
        out_cache_loc=locs,
        slot_pages=slot_pages,
        page_size=page_size,
        dense_locs=dense,
        disagreeing=int(moved.sum()),
    )


def topk_locs(
    case: BatchCase, rows: int, topk: int, gen: torch.Generator, *, padding: float = 0.1, absent: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k locations ``[rows, topk]`` (int64) with request ids ``[rows]``.

    Mostly locations on the row's request's pages; a fraction ``padding`` is -1 (and one row in eight is a
    padding row, request id -1), a fraction ``absent`` is on any pool page (usually one the request does not
    hold: it maps to -1).
    """
    held = torch.tensor([len(t) for t in case.page_tables])
    table = padded_page_table(case, int(held.max())).to(torch.int64)
    req = torch.randint(0, case.num_requests, (rows,), generator=gen)
    req[torch.rand(rows, generator=gen) < 0.125] = -1
    j = (torch.rand(rows, topk, generator=gen) * held[req.clamp(min=0)][:, None]).long()
    page = table[req.clamp(min=0)[:, None], j]
    loc = page * case.page_size + torch.randint(0, case.page_size, (rows, topk), generator=gen)
    draw = torch.rand(rows, topk, generator=gen)
    anywhere = torch.randint(0, case.capacity * case.page_size, (rows, topk), generator=gen)
    loc = torch.where(draw < absent, anywhere, loc)
    loc = torch.where(draw > 1 - padding, torch.full_like(loc, -1), loc)
    return loc, req


def make_pool_and_current(
    case: BatchCase, dtype: torch.dtype, row_elems: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pool ``[C * ps, row_elems]`` and current KV ``[N, row_elems]`` (``uint8`` or float)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((case.capacity * case.page_size, row_elems), (case.num_tokens, row_elems))
    if dtype == torch.uint8:
        return tuple(torch.randint(0, 256, s, generator=gen, dtype=torch.uint8) for s in shapes)  # type: ignore[return-value]
    return tuple(torch.randn(s, generator=gen).to(dtype) for s in shapes)  # type: ignore[return-value]


def truth_rows(case: BatchCase, pool: torch.Tensor, current_kv: torch.Tensor) -> list[torch.Tensor]:
    """Per request ``[prefix + extend, row...]``: what its dense view must hold, position by position."""
    out = []
    token = 0
    for r in range(case.num_requests):
        rows = [pool[case.pool_loc(r, p)] for p in range(case.prefix_lens[r])]
        rows += [current_kv[token + i] for i in range(case.extend_lens[r])]
        token += case.extend_lens[r]
        out.append(torch.stack(rows) if rows else pool.new_empty((0, *pool.shape[1:])))
    return out


def random_topk(case: BatchCase, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k reads for every current token: (pool locs int64 ``[N, k]``, logical positions ``[N, k]``).

    Token ``i`` of request ``r`` reads ``k`` positions of ``[0, prefix_r + i]`` (causal), some
    repeated, and some entries are -1 padding (positions -1).
    """
    rng = random.Random(seed)
    locs, positions = [], []
    for r in range(case.num_requests):
        for i in range(case.extend_lens[r]):
            visible = case.prefix_lens[r] + i + 1
            pos = [rng.randrange(visible) if rng.random() < 0.85 else -1 for _ in range(k)]
            positions.append(pos)
            locs.append([case.pool_loc(r, p) if p >= 0 else -1 for p in pos])
    return torch.tensor(locs, dtype=torch.int64).reshape(-1, k), torch.tensor(positions, dtype=torch.int64).reshape(
        -1, k
    )


def error_counts(page: int = 0, req: int = 0, loc: int = 0, mismatch: int = 0) -> list[int]:
    """An error counter's values by kind, in its layout (what ``errors.tolist()`` reads after these drops)."""
    counts = [0] * NUM_ERROR_KINDS
    kinds = (ERR_PAGE_OUT_OF_RANGE, ERR_REQ_OUT_OF_RANGE, ERR_LOC_OUT_OF_RANGE, ERR_CURRENT_LOC_MISMATCH)
    for kind, count in zip(kinds, (page, req, loc, mismatch)):
        counts[kind] = count
    return counts


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN bit patterns included); shapes and dtypes equal."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


# Row layouts of the DSA latent KV: bf16 rows of 576 elements (1152 bytes: latent 512 + rope 64), and the
# 656-byte packed FP8 rows viewed as uint8.
ROW_LAYOUTS: dict[str, tuple[torch.dtype, int]] = {"bf16": (torch.bfloat16, 576), "fp8_packed": (torch.uint8, 656)}


def random_rows(rows: int, layout: str, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[rows, width]`` of ``layout`` (:data:`ROW_LAYOUTS`), every byte random (never zeros, which would hide
    unwritten rows); drawn on the CPU from ``gen`` so two backends see the same bytes."""
    dtype, width = ROW_LAYOUTS[layout]
    nbytes = width * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


POISON_BYTE = 0xA5  # fills unwritten dense rows (and pool rows a test leaves unwritten), so a stray read is visible


def owned_pool_rows(case: BatchCase, cp_rank: int) -> torch.Tensor:
    """int64 ``[capacity / cp * page_size]``: the token location of every row of rank ``cp_rank``'s pool (its
    pool page ``q`` is page id ``q * cp + cp_rank``, :mod:`sglang_cpkv.runtime.ownership`)."""
    ps, cp = case.page_size, case.cp_size
    pages = torch.arange(case.pool_pages_per_rank, dtype=torch.int64) * cp + cp_rank
    return (pages.unsqueeze(1) * ps + torch.arange(ps)).flatten()


def owner_sharded_pool(case: BatchCase, pool: torch.Tensor, cp_rank: int) -> torch.Tensor:
    """Rank ``cp_rank``'s pool ``[capacity / cp * page_size, row...]``: the rows of the pages it owns, taken from a
    ``[capacity * page_size, row...]`` pool of every page (at cp 1 a copy of it)."""
    return pool[owned_pool_rows(case, cp_rank)].clone()


@dataclass
class RankResult:
    """What one CP rank produced for a case (host tensors)."""

    dense: torch.Tensor  # the dense view after the layer's history and current rows
    remapped: torch.Tensor  # the rank's local top-k rows, remapped
    local_req_id: torch.Tensor
    current_full: torch.Tensor  # the all-gathered current rows
    pool_after: torch.Tensor  # the rank's pool after persisting its owned rows


CasePayload = tuple  # (BatchCase, full pool [C*ps, row], current KV [N, row], top-k pool locations [N, K])


def run_case_on_rank(
    payload: CasePayload,
    group: CpGroup,
    device: torch.device | str,
    *,
    layer_ahead: bool = False,
    checked: bool = False,
) -> RankResult:
    """One CP rank's layer for one case, through the runtime's :class:`~sglang_cpkv.runtime.LayerPipeline`
    (a collective: every rank of ``group`` calls it with the same payload).

    The rank's pool keeps only its owned pages (:func:`owner_sharded_pool`); it builds its plan, takes the
    layer's dense view (history, then the current rows all-gathered from every rank's split rows), remaps its
    local top-k rows and persists its owned rows.
    """
    case, pool_full, current_kv, topk_locs = payload
    device = torch.device(device)
    plan = build_plan(
        [list(t) for t in case.page_tables],
        case.prefix_lens,
        case.extend_lens,
        torch.tensor(case.out_cache_loc(), dtype=torch.int64, device=device),
        capacity=case.capacity,
        page_size=case.page_size,
        split=build_cp_split(case.effective_strategy, case.extend_lens, group.cp_size, group.cp_rank),
        checked=checked,
    )
    pool = owner_sharded_pool(case, pool_full, group.cp_rank).to(device)
    pipe = LayerPipeline(
        plan,
        group,
        [rows_kind("kv", [pool], plan, layer_ahead=layer_ahead, fill_byte=POISON_BYTE)],
        layer_ahead=layer_ahead,
    )
    current_full = pipe.gather_current(plan.split.shard(current_kv.to(device), 0))
    dense = pipe.dense_view("kv", 0, current_full)
    remapped = pipe.remap(plan.split.shard(topk_locs.to(device), -1, plan.local_token_index), plan.local_req_id)
    pipe.persist_owned("kv", 0, current_full)
    plan.raise_if_errors(f"CP rank {group.cp_rank}")
    return RankResult(dense.cpu(), remapped.cpu(), plan.local_req_id.cpu(), current_full.cpu(), pool.cpu())


def run_case_on_ranks(
    case: BatchCase,
    pool: torch.Tensor,
    current_kv: torch.Tensor,
    topk_locs: torch.Tensor,
    device: torch.device | str = "cpu",
    **kwargs,
) -> list[RankResult]:
    """:func:`run_case_on_rank` on every CP rank of ``case`` in this process (threads in lockstep)."""
    return run_lockstep(
        case.cp_size, lambda group: run_case_on_rank((case, pool, current_kv, topk_locs), group, device, **kwargs)
    )


def host_plan(
    case: BatchCase, cp_rank: int, table: torch.Tensor | None = None, staging: PlanStaging | None = None
) -> CpSharedKvPlan:
    """The plan rank ``cp_rank`` builds for ``case``, on the CPU (the layout a rank's results are read with);
    ``table``: its page tables as a tensor (default: host lists), ``staging``: :func:`build_plan`'s."""
    return build_plan(
        [list(t) for t in case.page_tables] if table is None else table,
        case.prefix_lens,
        case.extend_lens,
        torch.tensor(case.out_cache_loc(), dtype=torch.int64),
        capacity=case.capacity,
        page_size=case.page_size,
        split=build_cp_split(case.effective_strategy, case.extend_lens, case.cp_size, cp_rank),
        staging=staging,
    )


def check_against_truth(
    case: BatchCase,
    pool: torch.Tensor,
    current_kv: torch.Tensor,
    topk_positions: torch.Tensor,
    results: list[RankResult],
) -> list[str]:
    """Every mismatch of every rank's dense view, top-k reads and pool writes with the truth.

    Checks, per rank: each request's dense view at each of its positions (byte-equal to
    :func:`truth_rows`); each local query row's request id and every top-k read through the
    remap (the row of the right position of the right request; padding entries -1, padding rows
    all -1); the rank's pool (its owned pages, :func:`owner_sharded_pool`): rows written by current tokens
    hold one of those tokens' rows, the other rows are unchanged.
    """
    ps = case.page_size
    truth = truth_rows(case, pool, current_kv)
    truth_all = as_bytes(torch.cat(truth))
    req_of_row = torch.cat([torch.full((t.shape[0],), r, dtype=torch.int64) for r, t in enumerate(truth)])
    pos_of_row = torch.cat([torch.arange(t.shape[0], dtype=torch.int64) for t in truth])
    row_base = torch.tensor([0] + [t.shape[0] for t in truth]).cumsum(0)
    token_req = torch.tensor(
        [r for r in range(case.num_requests) for _ in range(case.extend_lens[r])], dtype=torch.int64
    )
    out_cache_loc = torch.tensor(case.out_cache_loc(), dtype=torch.int64)
    cp = case.cp_size
    problems: list[str] = []
    for k, res in enumerate(results):
        plan = host_plan(case, k)
        dense_idx = torch.tensor(
            [plan.dense_location(int(r), int(p)) for r, p in zip(req_of_row, pos_of_row)], dtype=torch.int64
        )
        bad = (as_bytes(res.dense[dense_idx]) != truth_all).any(dim=1).nonzero().flatten().tolist()
        problems += [
            f"rank {k}: request {int(req_of_row[i])} dense position {int(pos_of_row[i])} differs from the truth"
            for i in bad
        ]

        local_tokens = plan.local_token_index
        local_req = res.local_req_id
        remapped = res.remapped.cpu().to(torch.int64)
        logical = local_tokens.numel()
        if bool((local_req[logical:] != -1).any()) or bool((remapped[logical:] != -1).any()):
            problems.append(f"rank {k}: padding rows carry request ids or remapped reads")
        expected_req = token_req[local_tokens]
        wrong_req = (local_req[:logical] != expected_req).nonzero().flatten().tolist()
        problems += [
            f"rank {k}: local row {i} (token {int(local_tokens[i])}) has request id {int(local_req[i])}, expected {int(expected_req[i])}"
            for i in wrong_req
        ]
        positions = topk_positions[local_tokens]  # [logical, K]
        got = remapped[:logical]
        pad = positions < 0
        if bool((got[pad] != -1).any()):
            problems.append(f"rank {k}: padding top-k entries remapped to a dense location")
        valid = ~pad
        if bool((got[valid] < 0).any()):
            problems.append(f"rank {k}: {int((got[valid] < 0).sum())} valid top-k reads were dropped (-1)")
        sel = valid & (got >= 0)
        read = as_bytes(res.dense[got[sel]])
        want = truth_all[row_base[expected_req.unsqueeze(1).expand_as(positions)[sel]] + positions[sel]]
        for i in (read != want).any(dim=1).nonzero().flatten().tolist()[:8]:
            problems.append(
                f"rank {k}: a top-k read of request {int(expected_req.unsqueeze(1).expand_as(positions)[sel][i])} position {int(positions[sel][i])} returned another row"
            )

        rows = owned_pool_rows(case, k)  # token location of each row of this rank's pool
        if res.pool_after.shape[0] != rows.numel():
            problems.append(f"rank {k}: its pool has {res.pool_after.shape[0]} rows, {rows.numel()} expected")
            continue
        after, before = as_bytes(res.pool_after), as_bytes(pool[rows])
        row_of_loc = torch.full((pool.shape[0],), -1, dtype=torch.int64)
        row_of_loc[rows] = torch.arange(rows.numel())
        mine = (page_owner(out_cache_loc // ps, cp) == k).nonzero().flatten()
        cur_bytes = as_bytes(current_kv)
        is_written = torch.zeros(rows.numel(), dtype=torch.bool)
        ok_write = torch.zeros(rows.numel(), dtype=torch.bool)
        for loc in out_cache_loc[mine].unique().tolist():
            # A location written by several tokens (collision class only) is a scatter with duplicate
            # indices: the contract leaves the winner unspecified, and a parallel scatter may even
            # interleave the writers' bytes, so each byte must come from one of the writers.
            row = int(row_of_loc[loc])
            writers = cur_bytes[mine[out_cache_loc[mine] == loc]]
            is_written[row] = True
            ok_write[row] = bool((writers == after[row]).any(dim=0).all())
        if bool((is_written & ~ok_write).any()):
            problems.append(
                f"rank {k}: pool rows (token locations) {rows[is_written & ~ok_write].tolist()} do not hold their "
                "current token"
            )
        if bool((after[~is_written] != before[~is_written]).any()):
            problems.append(f"rank {k}: pool rows changed though no current token writes them")
    return problems


def padded_page_table(case: BatchCase, pages_per_request: int) -> torch.Tensor:
    """int32 ``[R, P]`` page table of ``case``, -1 past each request's pages."""
    table = torch.full((case.num_requests, pages_per_request), -1, dtype=torch.int32)
    for r, row in enumerate(case.page_tables):
        table[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return table

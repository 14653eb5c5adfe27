"""One CP rank's side of the harness: chunked prefill of scenario requests through the real runtime.

Each forward (one chunk of every active request) builds the per-batch plan
(:func:`~sglang_cpkv.runtime.build_plan`), splits the current tokens the way upstream 0.5.23 does
(interleave, or un-split when it does not apply), and runs the toy layer stack
(:mod:`.model`) on this rank's local rows. Every layer's KV work is the runtime's
:class:`~sglang_cpkv.runtime.LayerPipeline` (layer-ahead, the path serving takes): the rank's local
KV rows all-gathered to token order; the layer's dense view (history of every request, owner pages
all-gathered under CP and prefetched during the layer before, then the current rows in each request's
own slots, CURRENT_REUSE included); the indexer and the sparse attention read it through the
pipeline's remap (the per-request inverse); the rows of pages this rank owns (``page_id % cp``) are
persisted into layer ``l``'s pool, which layer ``l`` of the next chunk reads.

Pools are owner-sharded: a rank's pool rows of pages it does not own are poison and never read.

The **negative control** (``access="value_keyed"``, cp=1) replaces the dense view, the remap and
the persist with the seed's 1-D value-keyed inverse and global current-page mask
(:mod:`sglang_cpkv.testing.value_keyed_inverse`); everything else is identical.

:func:`run_job_on_rank` is the ``rank_fn`` handed to :func:`sglang_cpkv.testing.cp_dist.spawn_cp_ranks`
(and called directly for cp=1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from sglang_cpkv import ops
from sglang_cpkv.harness.allocator import PrefixCachingAllocator
from sglang_cpkv.harness.model import MAX_POSITION, ToyDsa, ToyDsaConfig
from sglang_cpkv.harness.scenarios import Scenario
from sglang_cpkv.runtime import CpGroup, CpSharedKvPlan, LayerPipeline, build_plan, rows_kind, split_applies
from sglang_cpkv.testing.batches import COLLISION, POISON_BYTE, REACHABLE, BatchCase, padded_page_table
from sglang_cpkv.testing.value_keyed_inverse import build_value_keyed_inverse, remap_value_keyed, value_keyed_pipeline

Access = Literal["per_request", "value_keyed"]


@dataclass
class RequestTrace:
    """What one request produced in one run (host tensors).

    Attributes:
        request: its index in the scenario's prompts. length: prompt tokens.
        out: fp32 ``[L, length, kv_dim]`` attention output per layer and position (zeros where
            ``computed`` is False: positions served from the prefix cache).
        computed: bool ``[length]``.
        reads: bf16 ``[L, length, topk, kv_dim]``, the value rows the attention summed;
            ``read_mask`` bool ``[L, length, topk]`` marks the real ones.
        dense_views: one bf16 ``[L, end, kv_dim]`` per forward that computed the request: its
            dense view at logical positions ``[0, end)`` after the fill, per layer.
    """

    request: int
    length: int
    out: torch.Tensor
    computed: torch.Tensor
    reads: torch.Tensor
    read_mask: torch.Tensor
    dense_views: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RunTrace:
    """One run: a batch of requests (``bs``), or the bs=1 goldens (``bs=1``, each request alone).

    ``forward_classes``: the contract's state class of each batch forward, computed from its page
    tables (:attr:`BatchCase.state_class`).
    """

    scenario: str
    bs: int
    access: str
    forward_classes: list[str]
    requests: list[RequestTrace]

    @property
    def state_class(self) -> str:
        return COLLISION if COLLISION in self.forward_classes else REACHABLE


@dataclass(frozen=True)
class HarnessJob:
    """Everything a rank runs: goldens and batch runs of every scenario (negative control when cp=1)."""

    model: ToyDsaConfig
    scenarios: tuple[Scenario, ...]
    bs_list: tuple[int, ...]
    negative_control: bool
    checked: bool


@dataclass
class _Active:
    trace: RequestTrace
    tokens: tuple[int, ...]
    pages: tuple[int, ...]
    done: int


class _ValueKeyedAccess:
    """The negative control: the seed's 1-D value-keyed inverse in place of steps 2-3 (cp=1 only)."""

    def __init__(
        self, plan: CpSharedKvPlan, case: BatchCase, pools: list[torch.Tensor], out_cache_loc: torch.Tensor
    ) -> None:
        if plan.cp_size != 1:
            raise ValueError("the value-keyed negative control runs at cp=1 only")
        self.plan, self.pools, self.out_cache_loc = plan, pools, out_cache_loc
        # The seed's dense layout: request r's slots at r * P + j, P its longest request's pages.
        self.pages_per_request = max(len(t) for t in case.page_tables)
        self.page_table = padded_page_table(case, self.pages_per_request).to(out_cache_loc.device)
        self.inverse_1d = build_value_keyed_inverse(self.page_table, plan.capacity)

    def dense_start(self, r: int) -> int:
        """The first dense row of request ``r`` in the seed's layout."""
        return r * self.pages_per_request * self.plan.page_size

    def dense_view(self, layer: int, current_full: torch.Tensor) -> torch.Tensor:
        no_topk = torch.empty(0, dtype=torch.int64, device=current_full.device)
        dense, _ = value_keyed_pipeline(
            self.page_table,
            self.plan.prefix_lens,
            self.plan.extend_lens,
            self.out_cache_loc,
            self.pools[layer],
            current_full,
            no_topk,
            self.plan.capacity,
            self.plan.page_size,
        )
        return dense

    def remap(self, locs: torch.Tensor, req_id: torch.Tensor) -> torch.Tensor:
        return remap_value_keyed(locs, self.inverse_1d, self.plan.page_size)

    def persist(self, layer: int, current_full: torch.Tensor) -> None:
        """The seed at cp=1: every current row to its pool location."""
        self.pools[layer].index_copy_(0, self.out_cache_loc.to(torch.int64), current_full)


def _capacity(scenario: Scenario, cp_size: int) -> int:
    """The page ids of the scenario's pool on ``cp_size`` ranks: its capacity rounded up to ``cp_size`` x each
    rank's pool pages (:mod:`sglang_cpkv.runtime.ownership`)."""
    return cp_size * -(-scenario.capacity // cp_size)


def _new_pools(scenario: Scenario, config: ToyDsaConfig, group: CpGroup, device: torch.device) -> list[torch.Tensor]:
    """This rank's pool of each layer: the pages it owns (``capacity / cp`` pages), poisoned until written."""
    rows = _capacity(scenario, group.cp_size) // group.cp_size * scenario.page_size
    pools = [torch.empty((rows, config.kv_dim), dtype=torch.bfloat16, device=device) for _ in range(config.num_layers)]
    for pool in pools:
        pool.view(torch.uint8).fill_(POISON_BYTE)
    return pools


def _new_trace(request: int, length: int, config: ToyDsaConfig) -> RequestTrace:
    L, K, D = config.num_layers, config.topk, config.kv_dim
    return RequestTrace(
        request,
        length,
        out=torch.zeros((L, length, D), dtype=torch.float32),
        computed=torch.zeros(length, dtype=torch.bool),
        reads=torch.zeros((L, length, K, D), dtype=torch.bfloat16),
        read_mask=torch.zeros((L, length, K), dtype=torch.bool),
    )


def run_forward(
    model: ToyDsa,
    scenario: Scenario,
    batch: list[_Active],
    extend_lens: list[int],
    pools: list[torch.Tensor],
    group: CpGroup,
    device: torch.device,
    access: Access,
    checked: bool,
) -> str:
    """One forward: chunk ``extend_lens[i]`` of every request of ``batch``; records into their traces.

    Returns the forward's state class (computed from its page tables).
    """
    ps = scenario.page_size
    prefix_lens = [a.done for a in batch]
    tables = tuple(a.pages[: -(-(a.done + e) // ps)] for a, e in zip(batch, extend_lens))
    case = BatchCase(ps, _capacity(scenario, group.cp_size), tables, tuple(prefix_lens), tuple(extend_lens))
    out_cache_loc = torch.tensor(case.out_cache_loc(), dtype=torch.int64)
    strategy = "interleave" if split_applies("interleave", extend_lens, group.cp_size) else "none"
    plan = build_plan(
        [list(t) for t in tables],
        prefix_lens,
        extend_lens,
        out_cache_loc.to(device),
        capacity=case.capacity,
        page_size=ps,
        cp_size=group.cp_size,
        cp_rank=group.cp_rank,
        strategy=strategy,
        checked=checked,
    )

    # Token-order host inputs: token ids, positions, and every causal candidate's pool location.
    lmax = max(p + e for p, e in zip(prefix_lens, extend_lens))
    if lmax > MAX_POSITION:
        raise ValueError(
            f"scenario {scenario.name}: a prompt of {lmax} tokens exceeds the toy model's exact range ({MAX_POSITION})"
        )
    tokens, positions, candidates = [], [], []
    for r, (a, e) in enumerate(zip(batch, extend_lens)):
        for pos in range(a.done, a.done + e):
            tokens.append(a.tokens[pos])
            positions.append(pos)
            candidates.append([case.pool_loc(r, p) for p in range(pos + 1)] + [-1] * (lmax - pos - 1))
    local = plan.local_token_index
    hidden = plan.split.shard(
        model.embed_tokens(torch.tensor(tokens, device=device), torch.tensor(positions, device=device)), 0, local
    )
    local_pos = plan.split.shard(torch.tensor(positions, dtype=torch.int64, device=device), -1, local)
    local_cand = plan.split.shard(torch.tensor(candidates, dtype=torch.int64, device=device), -1, local)

    pipe = LayerPipeline(
        plan, group, [rows_kind("kv", pools, plan, layer_ahead=True, fill_byte=POISON_BYTE)], layer_ahead=True
    )
    control = _ValueKeyedAccess(plan, case, pools, out_cache_loc.to(device)) if access == "value_keyed" else None
    outs, reads, masks, denses = [], [], [], []
    for layer in range(model.config.num_layers):
        current_full = pipe.gather_current(model.kv_rows(layer, hidden))
        if control is None:
            dense, remap = pipe.dense_view("kv", layer, current_full), pipe.remap
        else:
            dense, remap = control.dense_view(layer, current_full), control.remap
        out, read, mask = model.attend(layer, hidden, local_pos, local_cand, plan.local_req_id, dense, remap)
        if control is None:
            pipe.persist_owned("kv", layer, current_full)
        else:
            control.persist(layer, current_full)
        outs.append(pipe.gather_current(out).cpu())
        reads.append(pipe.gather_current(read).cpu())
        masks.append(pipe.gather_current(mask.to(torch.uint8)).cpu().bool())
        denses.append(dense.to("cpu", copy=True))  # the buffer is reused two layers later
        hidden = model.next_hidden(layer, hidden, out)
    plan.raise_if_errors(f"harness forward of scenario {scenario.name}")

    token = 0
    for r, (a, e) in enumerate(zip(batch, extend_lens)):
        end = a.done + e
        tr = a.trace
        tr.out[:, a.done : end] = torch.stack([o[token : token + e] for o in outs])
        tr.reads[:, a.done : end] = torch.stack([x[token : token + e] for x in reads])
        tr.read_mask[:, a.done : end] = torch.stack([m[token : token + e] for m in masks])
        tr.computed[a.done : end] = True
        # The request's view in position order (the control's layout keeps it contiguous from its start).
        if control is None:
            rows = plan.request_locations(r, end)
        else:
            rows = control.dense_start(r) + torch.arange(end)
        tr.dense_views.append(torch.stack([d[rows] for d in denses]))
        token += e
        a.done = end
    return case.state_class


def _run_to_completion(
    model: ToyDsa,
    scenario: Scenario,
    active: list[_Active],
    chunk: int | None,
    pools,
    group,
    device,
    access: Access,
    checked: bool,
) -> list[str]:
    """Forwards until every request of ``active`` is done; the state class of each forward."""
    classes = []
    while True:
        batch = [a for a in active if a.done < len(a.tokens)]
        if not batch:
            return classes
        extend = [len(a.tokens) - a.done if chunk is None else min(chunk, len(a.tokens) - a.done) for a in batch]
        classes.append(run_forward(model, scenario, batch, extend, pools, group, device, access, checked))


def run_goldens(
    model: ToyDsa, scenario: Scenario, num_requests: int, group: CpGroup, device: torch.device, checked: bool
) -> RunTrace:
    """bs=1: every request alone in a fresh pool (no prefix cache), chunked at ``golden_chunk_size``."""
    traces = []
    for r in range(num_requests):
        alloc = PrefixCachingAllocator(scenario.capacity, scenario.page_size, share_partial_pages=False, seed=r)
        tokens = scenario.prompts[r]
        admitted = alloc.admit(tokens)
        active = _Active(_new_trace(r, len(tokens), model.config), tokens, admitted.pages, admitted.cached_len)
        _run_to_completion(
            model,
            scenario,
            [active],
            scenario.golden_chunk_size,
            _new_pools(scenario, model.config, group, device),
            group,
            device,
            "per_request",
            checked,
        )
        traces.append(active.trace)
    return RunTrace(scenario.name, 1, "per_request", [], traces)


def run_batch(
    model: ToyDsa, scenario: Scenario, bs: int, group: CpGroup, device: torch.device, access: Access, checked: bool
) -> RunTrace:
    """Warm the prefix cache with the scenario's warmups (one at a time), then prefill its first ``bs`` prompts together."""
    alloc = PrefixCachingAllocator(
        scenario.capacity, scenario.page_size, share_partial_pages=scenario.share_partial_pages, seed=1000 + bs
    )
    pools = _new_pools(scenario, model.config, group, device)
    warm_pages = []
    for w, tokens in enumerate(scenario.warmups):
        admitted = alloc.admit(tokens)
        warm = _Active(_new_trace(-1 - w, len(tokens), model.config), tokens, admitted.pages, admitted.cached_len)
        _run_to_completion(model, scenario, [warm], scenario.golden_chunk_size, pools, group, device, access, checked)
        alloc.insert(tokens, admitted.pages)
        warm_pages.append(admitted.pages)
    active = []
    for r in range(bs):
        tokens = scenario.prompts[r]
        reuse = warm_pages[0][1] if scenario.reuse_history_page[r] else None
        admitted = alloc.admit(tokens, reuse_page=reuse)
        active.append(_Active(_new_trace(r, len(tokens), model.config), tokens, admitted.pages, admitted.cached_len))
    classes = _run_to_completion(model, scenario, active, scenario.chunk_size, pools, group, device, access, checked)
    return RunTrace(scenario.name, bs, access, classes, [a.trace for a in active])


def run_job_on_rank(job: HarnessJob, group: CpGroup, device: torch.device) -> dict:
    """A rank's whole job (a collective sequence: every rank runs the same forwards in the same order).

    Returns ``{"backend", "goldens": {scenario: RunTrace}, "batches": {(scenario, bs): RunTrace},
    "negative_control": {(scenario, bs): RunTrace}}`` (the last only at cp=1).
    """
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest")  # the model is exact either way; keep fp32 plain
    model = ToyDsa(job.model, device)
    result = {"backend": ops.select_backend(device), "goldens": {}, "batches": {}, "negative_control": {}}
    num_requests = max(job.bs_list)
    for scenario in job.scenarios:
        result["goldens"][scenario.name] = run_goldens(model, scenario, num_requests, group, device, job.checked)
        for bs in job.bs_list:
            result["batches"][(scenario.name, bs)] = run_batch(
                model, scenario, bs, group, device, "per_request", job.checked
            )
            if job.negative_control and group.cp_size == 1:
                result["negative_control"][(scenario.name, bs)] = run_batch(
                    model, scenario, bs, group, device, "value_keyed", job.checked
                )
    return result

"""One prefill CP rank of the soak: upstream's disaggregation prefill loop over the workload, checked every iteration.

:func:`run_prefill_rank` builds the rank's server (:mod:`.server`), its stand-in model (:mod:`.model`), and runs
upstream's own event loop (``event_loop_normal_disagg_prefill``, or the overlap one) until the workload is served.
The loop's one seam is its request receiver (``Scheduler.request_receiver``, what ``ingest_requests`` polls once per
iteration): :class:`WorkloadReceiver` hands it the requests that arrive at this iteration (as the tokenizer would:
``TokenizedGenerateReqInput`` with the decode's bootstrap address and room) and the aborts the workload triggers on
the scheduler's own queues, tells the decode (rank 0, the router's part), and checks the invariants of the iteration
that just ended (:mod:`.invariants`). Every rank draws the same workload and sees the same poll results (upstream
all-reduces them over the CP group), so the ranks run in lockstep. Called by :mod:`.cli` in one process per rank.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_cpkv.soak import invariants
from sglang_cpkv.soak.model import StandInWorker, make_runner
from sglang_cpkv.soak.server import ServerConfig, build_pools, build_scheduler, start_process, stop_kv_manager
from sglang_cpkv.soak.workload import Abort, RequestSpec, WorkloadConfig, make_workload

logger = logging.getLogger(__name__)
IDLE_SLEEP_S = 0.002
STALL_S = 180.0  # no batch for this long while requests are pending: a stall, reported with what the server holds


@dataclass(frozen=True)
class RankJob:
    """What a prefill rank process is given."""

    server: ServerConfig
    workload: WorkloadConfig
    rank: int
    model_dir: str
    bootstrap_port: int
    init_method: str
    device: str = "cpu"
    max_seconds: float = 1800.0


def bootstrap_room(rid: str) -> int:
    """The room the router gives a request (its decode and prefill meet there): stable across processes."""
    return zlib.crc32(rid.encode()) | 1 << 40


@dataclass
class Ledger:
    """How each request ended on this rank, from what the scheduler sent its tokenizer."""

    served: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    abort_sent: dict[str, str] = field(default_factory=dict)  # rid -> the queue it was in when the client aborted
    unexpected: list[dict] = field(default_factory=list)

    def take(self, outputs: list[Any], specs_by_rid: dict[str, RequestSpec]) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        for out in outputs:
            if isinstance(out, AbortReq):
                self._end(out.rid, None, specs_by_rid)
                continue
            for rid, reason in zip(out.rids or [], getattr(out, "finished_reasons", None) or []):
                if reason is not None:
                    self._end(rid, reason, specs_by_rid)
        outputs.clear()

    def _end(self, rid: str, reason: Any, specs_by_rid: dict[str, RequestSpec]) -> None:
        kind = (reason or {}).get("type") if isinstance(reason, dict) else None
        if kind == "length":
            self.served.add(rid)
        elif rid in self.abort_sent:
            self.aborted.add(rid)
        else:
            self.unexpected.append({"request": rid, "finished": reason})


class WorkloadReceiver:
    """The scheduler's request receiver in the soak (see the module docstring)."""

    def __init__(self, scheduler: Any, worker: StandInWorker, job: RankJob, to_decode: Any) -> None:
        self.s, self.worker, self.job, self.to_decode = scheduler, worker, job, to_decode
        self.specs = make_workload(job.workload)
        self.by_rid = {spec.rid: spec for spec in self.specs}
        self.by_arrival: dict[int, list[RequestSpec]] = {}
        for spec in self.specs:
            self.by_arrival.setdefault(spec.arrival, []).append(spec)
        self.iteration = -1
        self.ledger = Ledger()
        self.checker = invariants.IterationChecker(scheduler, worker, job.rank)
        self.started = self.last_progress = time.monotonic()
        self.vocab = scheduler.model_config.vocab_size
        if job.server.transfer_backend == "fake":
            from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

            self._bootstrap_host = FAKE_BOOTSTRAP_HOST
        else:
            self._bootstrap_host = "127.0.0.1"

    def recv_requests(self, local_reqs=()) -> list[Any]:
        self.iteration += 1
        s = self.s
        unexpected = len(self.ledger.unexpected)
        self.ledger.take(s.recorder.outputs, self.by_rid)
        if self.to_decode is not None:  # the client's connection closes: the decode's copy of the request is aborted
            for ended in self.ledger.unexpected[unexpected:]:
                self.to_decode.put(("abort", ended["request"]))
        self.checker.after_iteration(self.ledger)
        self._same_on_every_rank()
        out = list(local_reqs)
        for spec in self.by_arrival.get(self.iteration, ()):
            out.append(self._request(spec))
            if self.to_decode is not None:
                self.to_decode.put(("request", spec.rid))
        out += self._aborts()
        if s.last_batch is not None:
            self.last_progress = time.monotonic()
        elif time.monotonic() - self.last_progress > STALL_S and not s.is_fully_idle():
            raise RuntimeError(
                f"rank {self.job.rank}: no batch ran for {STALL_S:.0f} s with work pending: {self._stall()}"
            )
        if not out and s.last_batch is None:
            time.sleep(IDLE_SLEEP_S)  # an idle server leaves the CPU to the other ranks and the decode
        if self.iteration > self.specs[-1].arrival and self._all_ended() and s.is_fully_idle():
            s.gracefully_exit = True
        elif time.monotonic() - self.started > self.job.max_seconds:
            raise TimeoutError(
                f"rank {self.job.rank}: the workload is not served after {self.job.max_seconds:.0f} s "
                f"(iteration {self.iteration}; {len(self.ledger.served)} served, {len(self.ledger.aborted)} aborted of "
                f"{len(self.specs)})"
            )
        return out

    def _same_on_every_rank(self) -> None:
        """Every CP rank is at the same iteration with the same queues and pool (upstream's ranks agree on every
        decision through their all-reduces; a rank that drifts would hang in the next collective instead)."""
        group = self.s.attn_cp_cpu_group
        if group is None or torch.distributed.get_world_size(group) == 1:
            return
        state = self._state()
        digest = torch.tensor([zlib.crc32(repr(state).encode())], dtype=torch.int64)
        digests = [torch.zeros_like(digest) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(digests, digest, group=group)
        if len({int(d) for d in digests}) > 1:
            states = [None] * len(digests)
            torch.distributed.all_gather_object(states, state, group=group)
            raise RuntimeError(f"the CP ranks diverged at iteration {self.iteration}: {states}")

    def _state(self) -> tuple:
        s = self.s
        return (
            self.iteration,
            tuple(r.rid for r in s.waiting_queue),
            tuple(r.rid for r in s.disagg_prefill_bootstrap_queue.queue),
            tuple(r.rid for r in s.disagg_prefill_inflight_queue),
            None if s.chunked_req is None else (s.chunked_req.rid, s.chunked_req.prefix_len),
            s.token_to_kv_pool_allocator.available_size(),
            None if getattr(s.tree_cache, "disable", False) else s.tree_cache.evictable_size(),
        )

    def _stall(self) -> dict:
        """What the server holds when it stopped making progress."""
        s = self.s
        allocator = s.token_to_kv_pool_allocator
        return {
            "waiting": [(r.rid, len(r.origin_input_ids)) for r in s.waiting_queue][:20],
            "bootstrap": [(r.rid, int(r.disagg_kv_sender.poll())) for r in s.disagg_prefill_bootstrap_queue.queue][:20],
            "inflight": [(r.rid, int(r.disagg_kv_sender.poll())) for r in s.disagg_prefill_inflight_queue],
            "chunked": None if s.chunked_req is None else s.chunked_req.rid,
            "available": allocator.available_size(),
            "evictable": None if getattr(s.tree_cache, "disable", False) else s.tree_cache.evictable_size(),
            "protected": None if getattr(s.tree_cache, "disable", False) else s.tree_cache.protected_size(),
            "request_rows_free": len(s.req_to_token_pool.free_slots),
            "class_free_pages": getattr(allocator, "class_free_page_counts", lambda: None)(),
            "memory_check": s.invariant_checker._check_all_pools(s.pool_stats_observer.get_pool_stats()),
        }

    def _all_ended(self) -> bool:
        return len(self.ledger.served) + len(self.ledger.aborted) + len(self.ledger.unexpected) >= len(self.specs)

    def _request(self, spec: RequestSpec) -> Any:
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=spec.ignore_eos)
        params.normalize(None)
        params.verify(self.vocab)
        return TokenizedGenerateReqInput(
            rid=spec.rid,
            input_text=None,
            input_ids=array("q", spec.input_ids),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            bootstrap_host=self._bootstrap_host,
            bootstrap_port=self.job.bootstrap_port,
            bootstrap_room=bootstrap_room(spec.rid),
        )

    def _aborts(self) -> list[Any]:
        """An ``AbortReq`` for each request whose abort the workload places in the queue it is in now."""
        from sglang.srt.managers.io_struct import AbortReq

        s, out = self.s, []
        waiting = {r.rid for r in s.waiting_queue} | {r.rid for r in s.disagg_prefill_bootstrap_queue.queue}
        inflight = {r.rid for r in s.disagg_prefill_inflight_queue}
        chunked = s.chunked_req.rid if s.chunked_req is not None else None
        for rid, where in (
            *((rid, Abort.WAITING) for rid in waiting),
            *((rid, Abort.MID_TRANSFER) for rid in inflight),
            *(((chunked, Abort.MID_CHUNK),) if chunked else ()),
        ):
            spec = self.by_rid[rid]
            if spec.abort is where and rid not in self.ledger.abort_sent:
                self.ledger.abort_sent[rid] = where.value
                out.append(AbortReq(rid=rid))
                if self.to_decode is not None:
                    self.to_decode.put(("abort", rid))
        return out


def host_transfers(job: RankJob):
    """HiCache's host transfers where there is no GPU: upstream's host pinning and ``sgl_kernel`` MLA transfer ops
    stood in by byte copies (:func:`sglang_cpkv.testing.hicache_cpu.cpu_host_transfers`); nothing otherwise."""
    if not job.server.hicache or job.device != "cpu":
        return contextlib.nullcontext()
    from sglang_cpkv.testing.hicache_cpu import cpu_host_transfers

    return cpu_host_transfers()


def run_prefill_rank(job: RankJob, to_decode: Any, results: Any) -> None:
    """A prefill rank process: build, serve the workload with upstream's loop, check the end state, report."""
    report: dict[str, Any] = {"role": "prefill", "rank": job.rank}
    stack = contextlib.ExitStack()
    scheduler = None
    try:
        args = start_process(job.server, "prefill", job.rank, job.model_dir, job.bootstrap_port, job.init_method)
        pointers = stack.enter_context(host_transfers(job))
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.scheduler import Scheduler

        pools = build_pools(args, job.server.kv_budget_mib, job.device)
        model_config = ModelConfig.from_server_args(args)
        runner, backend, modules = make_runner(job.server, pools, model_config, job.device)
        worker = StandInWorker(job.server, runner, backend, modules, job.rank, job.workload.seed)
        scheduler = build_scheduler(args, worker, model_config, device=job.device)
        if pointers is not None:
            from sglang_cpkv.testing.hicache_cpu import register_pools

            register_pools(pointers, [pools.token_to_kv_pool], scheduler.tree_cache.host_pool_group)
        receiver = WorkloadReceiver(scheduler, worker, job, to_decode if job.rank == 0 else None)
        scheduler.request_receiver = receiver
        start = time.monotonic()
        loop = (
            Scheduler.event_loop_overlap_disagg_prefill
            if job.server.overlap
            else Scheduler.event_loop_normal_disagg_prefill
        )
        with torch.no_grad():
            loop(scheduler)
        report["seconds"] = time.monotonic() - start
        receiver.ledger.take(scheduler.recorder.outputs, receiver.by_rid)
        report.update(receiver.checker.final(receiver.ledger))
        report["iterations"] = receiver.iteration
        report["pool_tokens"] = pools.max_total_num_tokens
        report["node_tokens"] = scheduler.max_total_num_tokens * scheduler.kv_shard_widening
        report["served"] = sorted(receiver.ledger.served)
        report["aborted"] = sorted(receiver.ledger.aborted)
        report["abort_sent"] = receiver.ledger.abort_sent
        report["unexpected"] = receiver.ledger.unexpected
        report["checks"] = worker.checks.as_dict()
    except BaseException as exc:  # a crash is a finding: reported, never swallowed
        report["crash"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-6000:]
    finally:
        if to_decode is not None and job.rank == 0:
            to_decode.put(("done", None))
        results.put(report)
        stop_kv_manager(getattr(scheduler, "disagg_prefill_bootstrap_queue", None))
        stack.close()

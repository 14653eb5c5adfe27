"""The soak's decode server: upstream's disaggregation decode loop receiving every request's KV from the prefill ranks.

:func:`run_decode` builds a decode server of upstream's objects (:mod:`.server`: its pools from upstream's
configurator, a scheduler whose ``init_disaggregation`` makes the prealloc and transfer queues and the real Mooncake
KV manager) and runs ``event_loop_normal_disagg_decode``. Requests and aborts come as the router sends them
(:class:`RouterReceiver`, fed by prefill rank 0); each request asks for two tokens, so the decode runs one decode step
for it, where the stand-in worker (:class:`DecodeWorker`) reads, through the decode's own page table, the latent row
and index key of every prompt position its pool received and checks them against the function (any page sent by the
wrong rank, from the wrong owner pool page, or not sent shows here). Aborted requests free their pages through
upstream's abort paths (deferred until the prefill ranks acknowledge). Called by :mod:`.cli` in a process of its own.
"""

from __future__ import annotations

import queue
import time
import traceback
import types
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cpkv.soak import kv_function
from sglang_cpkv.soak.invariants import drained_allocator
from sglang_cpkv.soak.model import Checks
from sglang_cpkv.soak.prefill import bootstrap_room
from sglang_cpkv.soak.server import (
    ServerConfig,
    SoakWorker,
    build_pools,
    build_scheduler,
    standin_runner,
    start_process,
    stop_kv_manager,
)
from sglang_cpkv.soak.workload import WorkloadConfig, make_workload

IDLE_SLEEP_S = 0.002


@dataclass(frozen=True)
class DecodeJob:
    server: ServerConfig
    workload: WorkloadConfig
    model_dir: str
    bootstrap_port: int
    init_method: str
    device: str = "cpu"
    max_seconds: float = 1800.0


class DecodeWorker(SoakWorker):
    """The decode's model worker: one decode step per batch; the first step of a request checks its received KV."""

    def __init__(self, config: ServerConfig, pools: Any, model_config: Any, device: str) -> None:
        super().__init__(
            standin_runner(
                pools,
                model_config,
                device,
                attn_backend=types.SimpleNamespace(),
                kv_cache_dtype_str=config.kv_cache_dtype,
            )
        )
        self.pools = pools
        self.expected = kv_function.ExpectedRows(config.fp8)
        self.checks = Checks(rank=-1)  # the decode
        self.checked: set[str] = set()
        self.transferred_bytes = 0

    def forward_batch_generation(self, batch: Any, **kwargs: Any) -> Any:
        from sglang.srt.managers.utils import GenerationBatchResult

        for req in batch.reqs:
            if req.rid not in self.checked:
                self.checked.add(req.rid)
                self.check_received(req)
        return GenerationBatchResult(
            logits_output=None,
            next_token_ids=torch.full((batch.batch_size(),), 7, dtype=torch.int64),
            can_run_cuda_graph=False,
        )

    def check_received(self, req: Any) -> None:
        """The request's prompt KV as the decode's pool holds it (its own page table) against the function."""
        pool = self.pools.token_to_kv_pool
        n = len(req.origin_input_ids)
        hashes = torch.tensor(kv_function.prefix_hashes(req.origin_input_ids), dtype=torch.int64)
        locs = self.pools.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
        page = pool.page_size
        pages = locs[::page] // page
        for layer in range(len(pool.kv_buffer)):
            buffer = pool.kv_buffer[layer]
            got = buffer.reshape(buffer.shape[0], -1).view(torch.uint8)[locs].cpu()
            bad = (got != self.expected.pool_rows(hashes, layer)).any(dim=1)
            self.checks.reads_checked += n
            self.transferred_bytes += got.numel()
            for p in bad.nonzero().flatten().tolist()[:3]:
                self.checks.mismatch(kind="decode latent row", request=req.rid, position=p, layer=layer)
            self.checks.mismatches += max(0, int(bad.sum()) - 3)
            k, s = pool.get_index_k_scale_buffer(
                layer,
                torch.tensor([n], dtype=torch.int32, device=locs.device),
                pages.to(torch.int32).unsqueeze(0),
                n,
                n,
            )
            want_k, want_s = self.expected.index_k(hashes, layer)
            k, s = kv_function.as_index_k(k, s, n)
            bad = (k != want_k).any(dim=1) | (s != want_s)
            self.checks.index_k_rows_checked += n
            self.transferred_bytes += n * (want_k.shape[1] + 4)
            for p in bad.nonzero().flatten().tolist()[:3]:
                self.checks.mismatch(kind="decode index K", request=req.rid, position=p, layer=layer)
            self.checks.mismatches += max(0, int(bad.sum()) - 3)


class RouterReceiver:
    """The decode scheduler's request receiver: the router's requests and aborts, as prefill rank 0 relays them."""

    def __init__(self, scheduler: Any, job: DecodeJob, from_prefill: Any) -> None:
        self.s, self.job, self.inbox = scheduler, job, from_prefill
        self.specs = {spec.rid: spec for spec in make_workload(job.workload)}
        self.prefill_done = False
        self.sent: set[str] = set()
        self.abort_sent: set[str] = set()
        self.served: set[str] = set()
        # rid -> finish reason of every other ending. Classified (aborted or unexpected) only when the report is
        # written: a prefill-side abort reaches this decode as a failed transfer, sometimes an iteration before the
        # router's own abort of the same request is read from the inbox.
        self.ended_otherwise: dict[str, Any] = {}
        self.started = time.monotonic()
        self.iterations = 0

    def recv_requests(self, local_reqs=()) -> list[Any]:
        from sglang.srt.managers.io_struct import AbortReq

        self.iterations += 1
        self._take_outputs()
        out = list(local_reqs)
        while True:
            try:
                kind, rid = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "request":
                self.sent.add(rid)
                out.append(self._request(rid))
            elif kind == "abort":
                self.abort_sent.add(rid)
                out.append(AbortReq(rid=rid))
            else:
                self.prefill_done = True
        s = self.s
        ended = len(self.served) + len(self.ended_otherwise)
        if self.prefill_done and ended >= len(self.sent) and s.is_fully_idle():
            s.gracefully_exit = True
        elif time.monotonic() - self.started > self.job.max_seconds:
            raise TimeoutError(f"the decode has {len(self.sent) - ended} requests left after {self.job.max_seconds} s")
        if not out and s.last_batch is None:
            time.sleep(IDLE_SLEEP_S)
        return out

    def _request(self, rid: str) -> Any:
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        params.normalize(None)
        return TokenizedGenerateReqInput(
            rid=rid,
            input_text=None,
            input_ids=array("q", self.specs[rid].input_ids),
            input_embeds=None,
            mm_inputs=None,
            token_type_ids=None,
            sampling_params=params,
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            token_ids_logprob=None,
            stream=False,
            bootstrap_host="127.0.0.1",
            bootstrap_port=self.job.bootstrap_port,
            bootstrap_room=bootstrap_room(rid),
        )

    def _take_outputs(self) -> None:
        from sglang.srt.managers.io_struct import AbortReq

        outputs = self.s.recorder.outputs
        for out in outputs:
            ends = [(out.rid, None)] if isinstance(out, AbortReq) else zip(out.rids or [], out.finished_reasons or [])
            for rid, reason in ends:
                if reason is None and not isinstance(out, AbortReq):
                    continue
                kind = reason.get("type") if isinstance(reason, dict) else None
                if kind == "length":
                    self.served.add(rid)
                else:
                    self.ended_otherwise[rid] = reason
        outputs.clear()

    def aborted(self) -> set[str]:
        return {rid for rid in self.ended_otherwise if rid in self.abort_sent}

    def unexpected(self) -> list[dict]:
        return [
            {"request": rid, "finished": reason}
            for rid, reason in self.ended_otherwise.items()
            if rid not in self.abort_sent
        ]


def run_decode(job: DecodeJob, from_prefill: Any, results: Any) -> None:
    """The decode process: build, serve until the prefill is done and every request ended, check, report."""
    report: dict[str, Any] = {"role": "decode", "rank": 0}
    scheduler = None
    try:
        args = start_process(job.server, "decode", 0, job.model_dir, job.bootstrap_port, job.init_method)
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.managers.scheduler import Scheduler

        pools = build_pools(args, job.server.decode_kv_budget_mib, job.device)
        model_config = ModelConfig.from_server_args(args)
        worker = DecodeWorker(job.server, pools, model_config, job.device)
        scheduler = build_scheduler(args, worker, model_config, device=job.device)
        receiver = RouterReceiver(scheduler, job, from_prefill)
        scheduler.request_receiver = receiver
        start = time.monotonic()
        with torch.no_grad():
            Scheduler.event_loop_normal_disagg_decode(scheduler)
        report["seconds"] = time.monotonic() - start
        receiver._take_outputs()
        scheduler.last_batch = None
        has_leak, messages = scheduler.invariant_checker._check_all_pools(
            scheduler.pool_stats_observer.get_pool_stats()
        )
        scheduler.invariant_checker._check_req_pool()
        free, total = drained_allocator(scheduler)
        report.update(
            memory_check_at_idle="leak: " + "; ".join(messages) if has_leak else "ok",
            allocator_free_after_drain=free,
            allocator_total=total,
            served=sorted(receiver.served),
            aborted=sorted(receiver.aborted()),
            abort_sent=sorted(receiver.abort_sent),
            unexpected=receiver.unexpected(),
            requests_received=len(receiver.sent),
            received_without_decode_step=sorted(receiver.served - worker.checked),
            transferred_bytes=worker.transferred_bytes,
            iterations=receiver.iterations,
            checks=worker.checks.as_dict(),
        )
    except BaseException as exc:  # a crash is a finding: reported, never swallowed
        report["crash"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()[-6000:]
    finally:
        results.put(report)
        stop_kv_manager(getattr(scheduler, "disagg_decode_prealloc_queue", None))

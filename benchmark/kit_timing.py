"""Timing a :class:`~sglang_cpkv.testing.dsa_kit.KitWorld`: the plan hook's window and each attention layer's.

Only the benchmarks time the kit (``bench_kit_layer.py``, ``bench_plan_host.py``, ``plan_host_phases.py``,
``bench_ragged_history_less.py``); the tests only compare what it reads, so this lives here, not in the test
support. A benchmark imports it as a sibling module (``python benchmark/NAME.py`` puts ``benchmark/`` on the path).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang_cpkv.testing.batches import BatchCase
from sglang_cpkv.testing.dsa_kit import KitWorld, fused_topk, missing_kernel_library, pad_rows


@dataclass(frozen=True)
class ForwardTime:
    """One timed forward: the plan's window and each layer's, in ms (GPU clock). The first layer's window also holds
    the time the device waits for the host to issue it after the plan (once per forward, not once per layer), so a
    model's forward is the plan, the first layer and its other layers at the later layers' mean
    (``bench_kit_layer.py``)."""

    plan_ms: float
    layer_ms: list[float]

    @property
    def mean_layer_ms(self) -> float:
        return statistics.fmean(self.layer_ms)

    @property
    def later_layer_ms(self) -> float:
        """The mean of the layers after the first (the steady state of a forward's layers)."""
        if len(self.layer_ms) < 2:
            raise ValueError("the steady layer time needs at least two timed layers")
        return statistics.fmean(self.layer_ms[1:])


@dataclass(frozen=True)
class LayerTiming:
    """A case made ready for :func:`timed_forward`: its forward batch, ``attn_cp_metadata`` (None un-split), each
    layer's ``(q_nope, q_rope, k_nope, k_rope)`` and the top-k."""

    forward_batch: Any
    metadata_cp: Any
    inputs: list
    topk: torch.Tensor


def timed_metadata(world: KitWorld, forward_batch: Any) -> tuple[float, float | None]:
    """Host ms and (on a GPU) CUDA-event ms of one ``init_forward_metadata`` of ``forward_batch`` (the plan hook
    inside it), the device synchronized before the clock starts."""
    cuda = world.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    with world.up["context"](world.backend):
        world.backend.init_forward_metadata(forward_batch)
    host = (time.perf_counter() - t) * 1e3
    if not cuda:
        return host, None
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end)


def time_layers(world: KitWorld, case: BatchCase, reps: int) -> tuple[float, float]:
    """``(plan ms, ms per layer)``: medians of ``reps`` forwards of ``case`` (:func:`timed_forward`; the layer is the
    mean over the timed layers) after a warm-up forward."""
    timing = prepare_timing(world, case)
    times = [timed_forward(world, timing) for _ in range(reps + 1)][1:]  # the first warms every kernel and buffer
    return statistics.median(t.plan_ms for t in times), statistics.median(t.mean_layer_ms for t in times)


def prepare_timing(world: KitWorld, case: BatchCase) -> LayerTiming:
    """What :func:`timed_forward` runs for ``case`` with the route's real kernel and no capture (on a GPU): the
    forward batch, each layer's inputs and the top-k, made before any clock starts (the top-k after one
    ``init_forward_metadata``: it depends on the batch's tables only)."""
    up, route, device, backend = world.up, world.route, world.device, world.backend
    if device.type != "cuda":
        raise ValueError("timed forwards run the route's real kernel on a GPU")
    missing = missing_kernel_library(route)
    if missing:
        raise ValueError(f"timed forwards: {route.prefill_backend} needs the {missing} library, not installed here")
    forward_batch, cur_locs, local_tokens, metadata_cp = world._extend_batch(case)
    inputs = []
    for module in world.modules:
        hidden = world._hidden(cur_locs, module.attn.layer_id)
        q_nope, q_rope = module.project_q(hidden[local_tokens.to(device)])
        k_nope, k_rope = _project_current_k(module, hidden, local_tokens, metadata_cp)
        inputs.append((pad_rows(q_nope, metadata_cp), pad_rows(q_rope, metadata_cp), k_nope, k_rope))
    with torch.no_grad(), up["context"](backend):
        backend.init_forward_metadata(forward_batch)
        rows = inputs[0][0].shape[0]
        topk = fused_topk(
            backend, backend.forward_metadata, case, local_tokens, rows, route, device, up["extend"], world.topk
        )
    return LayerTiming(forward_batch, metadata_cp, inputs, topk)


def timed_forward(world: KitWorld, timing: LayerTiming) -> ForwardTime:
    """One forward's times: CUDA events around ``init_forward_metadata`` and after each layer (attention only), the
    device synchronized before the clock starts. The mode's flag and reservation in force are the process's (a caller
    timing several worlds in turn sets them for each)."""
    forward_batch, metadata_cp = timing.forward_batch, timing.metadata_cp
    with torch.no_grad(), world.up["context"](world.backend):
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(world.modules) + 2)]
        events[0].record()
        world.backend.init_forward_metadata(forward_batch)
        events[1].record()
        for module, (q_nope, q_rope, k_local, k_rope_local), done in zip(world.modules, timing.inputs, events[2:]):
            # Under CP upstream's all-gather of the current KV is on the critical path (the clock runs).
            k_nope, k_rope = _gather_current_kv(module, k_local, k_rope_local, forward_batch, metadata_cp)
            module.attn(q_nope, k_nope, k_nope, forward_batch, k_rope=k_rope, q_rope=q_rope, topk_indices=timing.topk)
            done.record()
        torch.cuda.synchronize()
    return ForwardTime(
        events[0].elapsed_time(events[1]), [a.elapsed_time(b) for a, b in itertools.pairwise(events[1:])]
    )


def _project_current_k(module: Any, hidden: torch.Tensor, local_tokens: torch.Tensor, metadata: Any):
    """The current K rows this rank projects: its own under CP, every row un-split."""
    if metadata is None:
        return module.project_k(hidden)
    return module.project_k(hidden[local_tokens.to(hidden.device)])


def _gather_current_kv(module: Any, k_nope: torch.Tensor, k_rope: torch.Tensor, forward_batch: Any, metadata: Any):
    """The chunk's current KV as ``forward_extend`` receives it: under CP upstream's strategy all-gathers every
    rank's own rows on the attention-CP group (``materialize_full_mla_kv``, the collective a server runs every
    layer, beside the mode's history exchange; a CUDA-only op); un-split, the rows as projected."""
    if metadata is None:
        return k_nope, k_rope
    from sglang.srt.layers.cp.base import get_cp_strategy

    k_nope, k_rope = get_cp_strategy().materialize_full_mla_kv(forward_batch, module.attn, k_nope.unsqueeze(1), k_rope)
    return k_nope.squeeze(1), k_rope

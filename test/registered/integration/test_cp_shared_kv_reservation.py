"""The mode's buffers are reserved in the KV budget: upstream's pool sizing through the patched configurator (CPU).

Each case resolves a real ``ServerArgs`` for the local GLM-5 DSA config (78 layers, FP8 656-byte KV rows, 128-dim
index K) as a P/D prefill server with CP 8, publishes it, builds upstream's ``KVCacheConfigurator`` and
``DefaultPoolConfigurator`` (the pool sizing DSA models use; :mod:`sglang_cpkv.capacity.upstream`) and asks it
for the pool of a 100 GiB budget.
Checked: with the mode off nothing is charged; with it on the configurator's fixed overhead grows by exactly the
published reservation (the sum of its buffers, :class:`~sglang_cpkv.runtime.reservation.Reservation`), the pool
shrinks by exactly that many bytes of tokens, the start-up log states it, and the reservation holds the row sizes
upstream's pool will have; an EAGLE draft doubles it on the target and charges nothing on the draft worker; an
explicit ``--cp-shared-kv-max-batch-tokens`` sizes it; the ops' backend is warmed up there.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="cpkv-cpu")

pytest.importorskip("sglang", reason="needs upstream sglang 0.5.23 installed (make setup)")

from sglang_cpkv.upstream_import import install_torchvision_stub  # noqa: E402

install_torchvision_stub()

from sglang_cpkv.capacity.upstream import pool_configurator, prefill_cp_server  # noqa: E402
from sglang_cpkv.hooks import reservation as reservation_hooks  # noqa: E402
from sglang_cpkv.hooks import state  # noqa: E402
from sglang_cpkv.testing.pool_sizing import scoped_upstream_context  # noqa: E402, F401 (autouse: context per test)

GLM5_DIR = Path(__file__).parents[1] / "upstream" / "fixtures" / "glm5_dsa"
PAGE = 64
LAYERS = 78
CHUNK = 65536
CONTEXT = 202752  # the config's max_position_embeddings
BUDGET = 100 * 2**30
SERVER = prefill_cp_server(str(GLM5_DIR), chunked_prefill_size=CHUNK, kv_cache_dtype="fp8_e4m3")


def _pool_sizing(monkeypatch, mode_on, *, draft_worker=False, **server):
    """(configurator, its pool of BUDGET bytes) for the server; the mode's reservation published when on."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    monkeypatch.setenv("SGLANG_CP_DRAFT_SHARED_KV", "1")
    state.reset()  # inside the test's own process state (scoped_upstream_context)
    _, configurator = pool_configurator(
        {**SERVER, "enable_cp_shared_kv": mode_on, **server}, layers=LAYERS, page_size=PAGE, draft_worker=draft_worker
    )
    return configurator, configurator.calculate_pool_sizes(BUDGET, PAGE).max_total_num_tokens


def test_mode_off_charges_nothing(monkeypatch):
    configurator, _ = _pool_sizing(monkeypatch, False)
    assert configurator._fixed_overhead_bytes == 0
    assert state.current().config is None


def test_mode_on_charges_its_reservation_before_the_pool_is_sized(monkeypatch, caplog):
    off, off_tokens = _pool_sizing(monkeypatch, False)
    with caplog.at_level(logging.INFO, logger="sglang_cpkv.hooks.reservation"):
        on, on_tokens = _pool_sizing(monkeypatch, True)
    reserved = reservation_hooks.published()
    # The rows upstream's pools will have: 656-byte packed FP8 latent rows, 128 FP8 keys + one fp32 scale.
    assert (reserved.latent_token_bytes, reserved.index_k_token_bytes) == (656, 132)
    assert on._cell_size == off._cell_size == LAYERS * (656 + 132)
    assert (reserved.cp_size, reserved.page_size, reserved.views_per_kind, reserved.backends) == (8, PAGE, 2, 1)
    # the default: one full-context request and a chunk, each request's page rounding counted (issue 21)
    assert reserved.max_batch_tokens == CONTEXT + CHUNK + CHUNK // 64 * 63
    assert reserved.chunk_tokens == CHUNK
    assert on._fixed_overhead_bytes == reserved.total_bytes
    assert on_tokens == (BUDGET - reserved.total_bytes) // on._cell_size // PAGE * PAGE
    assert off_tokens - on_tokens >= reserved.total_bytes // on._cell_size // PAGE * PAGE
    assert "CP shared-KV: reserved" in caplog.text and "--cp-shared-kv-max-batch-tokens 332800" in caplog.text


def test_an_eagle_draft_is_charged_on_the_target_only(monkeypatch):
    target, _ = _pool_sizing(monkeypatch, True, speculative_algorithm="EAGLE")
    reserved = reservation_hooks.published()
    assert reserved.backends == 2 and target._fixed_overhead_bytes == reserved.total_bytes
    single = sum(reserved.parts().values())
    assert reserved.total_bytes == 2 * single
    draft, _ = _pool_sizing(monkeypatch, True, draft_worker=True, speculative_algorithm="EAGLE")
    assert draft._fixed_overhead_bytes == 0


def test_the_limit_sizes_the_reservation(monkeypatch):
    _pool_sizing(monkeypatch, True, cp_shared_kv_max_batch_tokens=2 * CONTEXT)
    reserved = reservation_hooks.published()
    assert reserved.max_batch_tokens == 2 * CONTEXT
    assert reserved.dense_slots >= -(-2 * CONTEXT // PAGE)
    # Under CP the history all-gather lands in the dense views themselves: no exchange buffer is reserved.
    page_bytes = PAGE * (reserved.latent_token_bytes + reserved.index_k_token_bytes)
    views = reserved.views_per_kind * reserved.dense_slots * page_bytes
    assert sorted(reserved.parts()) == [
        "batch plan",
        "current-row scratch",
        "index_k dense views",
        "latent dense views",
    ]
    parts = reserved.parts()
    assert parts["latent dense views"] + parts["index_k dense views"] == views
    assert parts["current-row scratch"] == (reserved.chunk_tokens + 1) * (reserved.latent_token_bytes + 8)


def test_the_ops_are_warmed_up_at_start_up_not_in_the_first_batch(monkeypatch):
    """The pool sizing hook loads and probes the ops' backend on the server's device (the CUDA probe synchronizes:
    inside a forward it would be the batch's extra host reads): a forced backend that cannot run there stops the
    start-up, naming the variable, before any batch."""
    monkeypatch.setenv("SGLANG_CPKV_OPS_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="SGLANG_CPKV_OPS_BACKEND=cuda cannot run the CP shared-KV ops"):
        _pool_sizing(monkeypatch, True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

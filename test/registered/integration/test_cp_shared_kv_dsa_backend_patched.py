"""The patched ``DeepseekSparseAttnBackend`` (``init_forward_metadata``, ``forward_extend``) on CPU.

Server args are resolved and published in this process exactly as a prefill scheduler does it (a
local DSA ``config.json``, ``--tp 2 --enable-prefill-cp --cp-strategy interleave
--disaggregation-mode prefill``, with or without ``--enable-cp-shared-kv``). The backend is
upstream's class with the attributes its ``__init__`` derives from a model runner set directly
(no model runner on CPU); pools are upstream's ``ReqToTokenPool`` / ``MLATokenToKVPool``; the CP
split is upstream's (``build_metadata`` + ``pad_logical_token_to_physical``; the metadata build
runs upstream's ``shard_per_request``). The batch has four requests: two sharing prefix pages, one
continuing a partial history page and then writing a page id the first two read as history, and a
one-token request that CP rank 0 drops (upstream's ``bs_idx``).

Checked on both CP ranks:

* flag off: no plan, and the metadata is upstream's (page table = the selected requests' pool
  locations);
* flag on: every metadata field equals the flag-off one except the page tables, which address the
  per-request dense view: ``page_table_1`` is the flag-off table remapped through the plan's
  per-request inverse (row ``i`` = request ``bs_idx[i]``), each location inside its own request's
  slots, and ``real_page_table`` its dense slot ids.

``forward_extend`` runs up to the flashmla sparse kernel (GPU-only), which is replaced by a capture
of what it is handed; the two CP ranks run in lockstep, their owned-page all-gather a
concatenation of both ranks' packs. Flag off: upstream writes every current row and hands the
kernel its pool. Flag on: each rank writes only the current rows of its owned pages, and the kernel
gets the dense view, in which every top-k location (history pages from both owners, current rows)
holds its own request's KV. The indexer's hooks then store index K (upstream's non-fused store,
``act_quant`` + ``SetKAndS``, which runs on CPU) and read it with the dense block table through
upstream's ``GetKAndS``: per request, the bytes equal upstream's read of a pool holding that request
alone.
"""

import dataclasses
import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_backend_standin import make_dsa_backend

register_cpu_ci(est_time=30, suite="cpkv-cpu")

CP = 2
PAGE = 64
CAPACITY = 12
PREFIX = [128, 128, 100, 0]
EXTEND = [40, 71, 50, 1]  # 162 tokens: the last request's only token is on rank 1
# Requests 0 and 1 share history pages 1 and 2. Request 2's history ends mid-page 7, its current
# tokens continue it (CURRENT_REUSE) and then go to page 2, which requests 0 and 1 read as history:
# a page id reused across requests of one batch (reachable only with allocators that do so, the
# contract's second class), where a value-keyed inverse would mix requests up.
PAGES = [[1, 2, 3], [1, 2, 4, 5], [6, 7, 2], [9]]
REQ_POOL_INDICES = [3, 1, 2, 4]
DSA_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "torch_dtype": "bfloat16",
    "rope_theta": 10000,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
}
TABLE_FIELDS = {"page_table_1", "real_page_table", "page_table_1_flattened"}


def _loc(r, pos):
    return PAGES[r][pos // PAGE] * PAGE + pos % PAGE


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    from sglang_cpkv.testing.upstream_env import install_torchvision_stub

    install_torchvision_stub()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # resolve as on Hopper
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.layers.cp.base import get_cp_strategy, init_cp_strategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    model = tmp_path_factory.mktemp("dsa")
    (model / "config.json").write_text(json.dumps(DSA_CONFIG))
    init_cp_strategy(enable_prefill_cp=True, cp_size=CP, cp_strategy="interleave")
    return SimpleNamespace(
        backend_cls=DeepseekSparseAttnBackend,
        strategy=get_cp_strategy(),
        pad=pad_logical_token_to_physical,
        pool_cls=DSATokenToKVPool,
        req_pool_cls=ReqToTokenPool,
        act_quant=act_quant,
        extend=ForwardMode.EXTEND,
        parallel=get_parallel,
        prepare=prepare_server_args,
        publish=set_global_server_args_for_scheduler,
        model=str(model),
    )


def _publish(up, flag_on, monkeypatch):
    from sglang_cpkv.hooks import dsa_extend

    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    argv = [
        "--model-path",
        up.model,
        "--skip-tokenizer-init",
        "--device",
        "cuda",
        "--tp",
        str(CP),
        "--enable-prefill-cp",
        "--cp-strategy",
        "interleave",
        "--disaggregation-mode",
        "prefill",
        "--random-seed",
        "1",
    ]
    server_args = up.prepare(argv + (["--enable-cp-shared-kv"] if flag_on else []))
    server_args.resolve_once()
    up.publish(server_args)
    monkeypatch.setattr(dsa_extend, "_ENABLED", None)  # read the flag of what was just published
    # The metadata build gathers nothing; forward_extend's tests set each rank's group themselves.
    monkeypatch.setattr(dsa_extend, "_exchange_group", lambda: None)


def _pool(up):
    return up.pool_cls(
        size=(CAPACITY - 1) * PAGE,
        page_size=PAGE,
        kv_lora_rank=8,
        dtype=torch.bfloat16,
        qk_rope_head_dim=4,
        layer_num=1,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=12,
    )


def _backend(up):
    """Upstream's backend class, with the attributes its __init__ derives from a model runner."""
    req_pool = up.req_pool_cls(size=5, max_context_len=4 * PAGE, device="cpu", enable_memory_saver=False)
    for r, row in enumerate(REQ_POOL_INDICES):
        seq = PREFIX[r] + EXTEND[r]
        req_pool.req_to_token[row, :seq] = torch.tensor([_loc(r, p) for p in range(seq)], dtype=torch.int32)
    return make_dsa_backend(up.backend_cls, _pool(up), req_pool, PAGE)


def _forward_batch(up):
    seq = [p + e for p, e in zip(PREFIX, EXTEND)]
    n = sum(EXTEND)
    metadata = up.strategy.build_metadata(num_tokens=n, seqs_len=seq, extend_seqs_len=EXTEND)
    up.pad(metadata)
    return SimpleNamespace(
        batch_size=len(EXTEND),
        forward_mode=up.extend,
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        seq_lens_sum=sum(seq),
        req_pool_indices=torch.tensor(REQ_POOL_INDICES),
        extend_seq_lens_cpu=EXTEND,
        extend_seq_lens=torch.tensor(EXTEND, dtype=torch.int32),
        extend_prefix_lens_cpu=PREFIX,
        extend_num_tokens=n,
        out_cache_loc=torch.tensor([_loc(r, p) for r in range(len(EXTEND)) for p in range(PREFIX[r], seq[r])]),
        attn_cp_metadata=metadata,
        input_ids=torch.zeros(n, dtype=torch.int64),
        global_num_tokens_cpu=None,
    )


def _metadata(up, rank, flag_on, monkeypatch):
    _publish(up, flag_on, monkeypatch)
    up.parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_rank=rank)
    backend, forward_batch = _backend(up), _forward_batch(up)
    backend.init_forward_metadata(forward_batch)
    return backend.forward_metadata, forward_batch


def _equal(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("rank", range(CP))
def test_flag_off_builds_upstreams_metadata_and_no_plan(up, rank, monkeypatch):
    from sglang_cpkv.hooks import dsa_extend

    metadata, forward_batch = _metadata(up, rank, False, monkeypatch)
    assert not dsa_extend.enabled()
    assert dsa_extend.batch_state(forward_batch) is None
    kept = [0, 1, 2] if rank == 0 else [0, 1, 2, 3]  # rank 0 holds no token of request 3
    assert metadata.dsa_extend_seq_lens_list == [n for n in [[20, 36, 25, 0], [20, 35, 25, 1]][rank] if n]
    for row, r in enumerate(kept):
        seq = PREFIX[r] + EXTEND[r]
        assert metadata.page_table_1[row, :seq].tolist() == [_loc(r, p) for p in range(seq)]


@pytest.mark.parametrize("rank", range(CP))
def test_flag_on_changes_only_the_page_tables_which_address_each_requests_dense_view(up, rank, monkeypatch):
    from sglang_cpkv.hooks import dsa_extend

    off, _ = _metadata(up, rank, False, monkeypatch)
    on, forward_batch = _metadata(up, rank, True, monkeypatch)
    assert dsa_extend.enabled()
    state = dsa_extend.batch_state(forward_batch)
    assert state is not None
    for field in dataclasses.fields(on):
        if field.name not in TABLE_FIELDS:
            assert _equal(getattr(on, field.name), getattr(off, field.name)), field.name

    plan = state.plan
    kept = [0, 1, 2] if rank == 0 else [0, 1, 2, 3]
    bs_idx = torch.tensor(kept)
    assert torch.equal(on.page_table_1, dsa_extend.remap_page_table(plan, off.page_table_1, bs_idx))
    slot_rows = plan.pages_per_request * PAGE
    for row, r in enumerate(kept):
        dense = on.page_table_1[row, : PREFIX[r] + EXTEND[r]]
        assert bool((dense // slot_rows == r).all()), f"request {r} reads outside its own dense slots"
        assert dense.tolist() == [r * slot_rows + p for p in range(PREFIX[r] + EXTEND[r])]
    assert torch.equal(on.real_page_table, torch.div(on.page_table_1[:, ::PAGE], PAGE, rounding_mode="floor"))


# ---- forward_extend: the patched method up to the attention kernel, which is captured ----

KV_LORA, ROPE, TOPK = 8, 4, 160


class PrecomputedAllGather:
    """Every rank's contribution to each all-gather of a layer (latent, then index K), known up front
    because the ranks run in lockstep in one process."""

    def __init__(self, rounds, rank):
        self.rounds, self.cp_rank, self.cp_size = list(rounds), rank, len(rounds[0])

    def all_gather_rows(self, local):
        contributions = self.rounds.pop(0)
        assert torch.equal(local, contributions[self.cp_rank])
        return torch.cat(contributions)


def _layer():
    # RadixAttention's fields that forward_extend reads (one head, tiny head dims).
    return SimpleNamespace(
        layer_id=0,
        is_cross_attention=False,
        tp_q_head_num=1,
        tp_k_head_num=1,
        v_head_dim=KV_LORA,
        head_dim=KV_LORA + ROPE,
        scaling=1.0,
    )


def _extend_inputs(rank, plan_pages_per_request=None):
    """This rank's query rows, the gathered current k/k_rope, and top-k rows over the visible prefix.

    Top-k rows hold, per local query token, the first TOPK positions of its own request as dense
    locations (flag on) or pool locations (flag off): what the fused top-k transform would emit.
    """
    g = torch.Generator().manual_seed(3)
    n = sum(EXTEND)
    k = torch.randn(n, 1, KV_LORA, generator=g).to(torch.bfloat16)
    k_rope = torch.randn(n, 1, ROPE, generator=g).to(torch.bfloat16)
    owner = [(r, PREFIX[r] + i) for r in range(len(EXTEND)) for i in range(EXTEND[r])]
    local = list(range(rank, n, CP))
    physical = -(-max(len(range(q, n, CP)) for q in range(CP)) // CP) * CP
    topk = torch.full((physical, TOPK), -1, dtype=torch.int32)
    for row, t in enumerate(local):
        r, pos = owner[t]
        visible = range(min(TOPK, pos + 1))
        if plan_pages_per_request is None:
            topk[row, : len(visible)] = torch.tensor([_loc(r, p) for p in visible], dtype=torch.int32)
        else:
            topk[row, : len(visible)] = torch.tensor(
                [r * plan_pages_per_request * PAGE + p for p in visible], dtype=torch.int32
            )
    q = torch.randn(physical, KV_LORA + ROPE, generator=g).to(torch.bfloat16)
    return q, k, k_rope, topk, owner


def _history_rows():
    g = torch.Generator().manual_seed(4)
    return torch.randn(CAPACITY * PAGE, 1, KV_LORA + ROPE, generator=g).to(torch.bfloat16)


def _index_keys():
    """Index keys: one per pool location for history, one per current token (token order)."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(CAPACITY * PAGE, 128, generator=g).to(torch.bfloat16), torch.randn(
        sum(EXTEND), 128, generator=g
    ).to(torch.bfloat16)


def _store_index_k(up, pool, keys, locs):
    """Upstream's non-fused index-K store (act_quant + the pool's SetKAndS), as the indexer does on CPU."""
    k_fp8, k_scale = up.act_quant(keys, 128, None)
    pool.set_index_k_scale_buffer(layer_id=0, loc=locs, index_k=k_fp8, index_k_scale=k_scale)


def _fill_history(up, pool, rows, index_keys, owned_by=None):
    buf = pool.kv_buffer[0]
    locs = [_loc(r, p) for r in range(len(EXTEND)) for p in range(PREFIX[r])]
    locs = sorted({loc for loc in locs if owned_by is None or (loc // PAGE) % CP == owned_by})
    buf[locs] = rows[locs]
    _store_index_k(up, pool, index_keys[locs], torch.tensor(locs))


def _run_forward_extend(backend, forward_batch, q, k, k_rope, topk):
    captured = {}

    def kernel(**kwargs):  # the flashmla sparse kernel needs a GPU; capture what it is handed
        captured.update(kwargs)
        return torch.zeros(kwargs["q_all"].shape[0], 1, KV_LORA)

    backend._forward_flashmla_sparse = kernel
    backend.forward_extend(q, k, k, _layer(), forward_batch, save_kv_cache=True, k_rope=k_rope, topk_indices=topk)
    return captured


def _truth(history, k, k_rope, owner, r, pos):
    if pos < PREFIX[r]:
        return history[_loc(r, pos)]
    t = owner.index((r, pos))
    return torch.cat([k[t], k_rope[t]], dim=-1)


def test_flag_off_forward_extend_writes_every_row_and_reads_the_pool(up, monkeypatch):
    rank = 1
    _publish(up, False, monkeypatch)
    up.parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_rank=rank)
    backend, forward_batch = _backend(up), _forward_batch(up)
    history = _history_rows()
    _fill_history(up, backend.token_to_kv_pool, history, _index_keys()[0])
    backend.init_forward_metadata(forward_batch)
    q, k, k_rope, topk, _owner = _extend_inputs(rank)
    captured = _run_forward_extend(backend, forward_batch, q, k, k_rope, topk)
    pool = backend.token_to_kv_pool.get_key_buffer(0)
    assert captured["kv_cache"].data_ptr() == pool.data_ptr()  # upstream reads its pool
    assert torch.equal(captured["page_table_1"], topk)
    current = torch.cat([k, k_rope], dim=-1)
    assert torch.equal(pool[forward_batch.out_cache_loc], current)  # every rank writes every row


def test_flag_on_forward_extend_reads_each_requests_dense_view_and_writes_owned_rows(up, monkeypatch):
    from sglang_cpkv.hooks import dsa_extend
    from sglang_cpkv.runtime.layer import pack_owned_history

    monkeypatch.setenv("SGLANG_CPKV_CHECKED", "1")  # the plan's and remap's invariants raise on violation
    _publish(up, True, monkeypatch)
    history = _history_rows()
    history_keys, current_keys = _index_keys()
    ranks = []
    for rank in range(CP):
        up.parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_rank=rank)
        backend, forward_batch = _backend(up), _forward_batch(up)
        _fill_history(up, backend.token_to_kv_pool, history, history_keys, owned_by=rank)  # its pages only
        backend.init_forward_metadata(forward_batch)
        ranks.append((backend, forward_batch))
    latent_packs, index_packs = [], []
    for b, fb in ranks:
        plan, pool = dsa_extend.batch_state(fb).plan, b.token_to_kv_pool
        latent_packs.append(pack_owned_history(plan, pool.kv_buffer[0]))
        index_packs.append(
            pack_owned_history(plan, dsa_extend._index_k_pages(pool.get_index_k_with_scale_buffer(0), PAGE))
        )
    for rank, (backend, forward_batch) in enumerate(ranks):
        state = dsa_extend.batch_state(forward_batch)
        assert state.plan.checked
        state.group = PrecomputedAllGather([latent_packs, index_packs], rank)
        up.parallel().override_permanently(attn_cp_rank=rank)
        q, k, k_rope, topk, owner = _extend_inputs(rank, state.plan.pages_per_request)
        captured = _run_forward_extend(backend, forward_batch, q, k, k_rope, topk)
        kv_cache = captured["kv_cache"]
        assert kv_cache.shape[0] == state.plan.dense_rows
        for row, t in enumerate(range(rank, sum(EXTEND), CP)):
            r, _pos = owner[t]
            for loc in topk[row][topk[row] >= 0].tolist():
                p = loc - r * state.plan.pages_per_request * PAGE
                assert torch.equal(kv_cache[loc], _truth(history, k, k_rope, owner, r, p)), f"rank {rank} request {r}"
        pool = backend.token_to_kv_pool.get_key_buffer(0)
        locs = forward_batch.out_cache_loc
        owned = (locs // PAGE) % CP == rank
        current = torch.cat([k, k_rope], dim=-1)
        assert torch.equal(pool[locs[owned]], current[owned])
        assert not pool[locs[~owned]].any()

        # Index K: the indexer's store hook, then its read hook with the dense block table, against
        # upstream's own store/read of each request alone (a pool holding only that request).
        pool_obj = backend.token_to_kv_pool
        assert dsa_extend.store_index_k(pool_obj, forward_batch, 0, current_keys, up.act_quant, 128, None)
        metadata = backend.forward_metadata
        seq_lens = metadata.indexer_seq_lens.to(torch.int32)
        total, longest = int(seq_lens.sum()), int(seq_lens.max())
        got_k, got_s = dsa_extend.index_k_and_scale(
            pool_obj, forward_batch, 0, seq_lens, metadata.real_page_table, total, longest
        )
        kept = [0, 1, 2] if rank == 0 else [0, 1, 2, 3]
        start = 0
        for r in kept:
            seq = PREFIX[r] + EXTEND[r]
            alone = _pool(up)
            hist = [_loc(r, p) for p in range(PREFIX[r])]
            if hist:
                _store_index_k(up, alone, history_keys[hist], torch.tensor(hist))
            first = sum(EXTEND[:r])
            _store_index_k(
                up,
                alone,
                current_keys[first : first + EXTEND[r]],
                torch.tensor([_loc(r, p) for p in range(PREFIX[r], seq)]),
            )
            pages = torch.tensor([PAGES[r]], dtype=torch.int32)
            want_k, want_s = alone.get_index_k_scale_buffer(0, torch.tensor([seq], dtype=torch.int32), pages, seq, seq)
            assert torch.equal(got_k[start : start + seq], want_k), f"rank {rank} request {r}: index K"
            assert torch.equal(got_s[start : start + seq], want_s), f"rank {rank} request {r}: index-K scales"
            start += seq
        state.plan.raise_if_errors()


# ---- MTP IndexShare seed export (prepare_mtp_seed_indices): pool locations whatever the mode ----


def _seed_backend(up, rank, flag_on, monkeypatch, **attrs):
    _publish(up, flag_on, monkeypatch)
    up.parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_rank=rank)
    backend, forward_batch = _backend(up), _forward_batch(up)
    for name, value in attrs.items():
        setattr(backend, name, value)
    backend.init_forward_metadata(forward_batch)
    return backend, forward_batch


@pytest.mark.parametrize("rank", range(CP))
def test_paged_mtp_seed_is_exported_as_pool_locations_with_the_flag_on(up, rank, monkeypatch):
    from sglang_cpkv.hooks import dsa_extend

    off, _ = _seed_backend(up, rank, False, monkeypatch)
    on, forward_batch = _seed_backend(up, rank, True, monkeypatch)
    plan = dsa_extend.batch_state(forward_batch).plan
    *_, pool_topk, _ = _extend_inputs(rank)
    *_, dense_topk, _ = _extend_inputs(rank, plan.pages_per_request)
    # Upstream exports a PAGED seed as it is (pool locations, flag off); with the flag on the same
    # rows hold dense locations and must come back as the same pool locations, padding kept.
    assert torch.equal(off.prepare_mtp_seed_indices(pool_topk, up.extend), pool_topk)
    seed = on.prepare_mtp_seed_indices(dense_topk, up.extend)
    assert seed.dtype == dense_topk.dtype
    assert torch.equal(seed, pool_topk)
    plan.raise_if_errors()


@pytest.mark.parametrize("rank", range(CP))
def test_ragged_mtp_seed_equals_upstreams_pool_locations_with_the_flag_on(up, rank, monkeypatch):
    # An FP8 pool with flashmla_sparse selects RAGGED: the seed is upstream's lookup of the top-k
    # offsets through page_table_1_flattened, which holds dense locations with the flag on.
    off, _ = _seed_backend(up, rank, False, monkeypatch, dsa_kv_cache_store_fp8=True)
    on, forward_batch = _seed_backend(up, rank, True, monkeypatch, dsa_kv_cache_store_fp8=True)
    flat = off.forward_metadata.page_table_1_flattened
    assert flat is not None and on.forward_metadata.page_table_1_flattened.shape == flat.shape
    g = torch.Generator().manual_seed(6)
    offsets = torch.randint(0, flat.shape[0], (24, TOPK), generator=g, dtype=torch.int32)
    offsets[:, -7:] = -1
    want = off.prepare_mtp_seed_indices(offsets, up.extend)
    assert not torch.equal(on.forward_metadata.page_table_1_flattened, flat)  # the flag on does change the table
    assert torch.equal(on.prepare_mtp_seed_indices(offsets, up.extend), want)
    from sglang_cpkv.hooks import dsa_extend

    dsa_extend.batch_state(forward_batch).plan.raise_if_errors()


def test_unfused_mtp_seed_stays_request_local_with_the_flag_on(up, monkeypatch):
    on, _ = _seed_backend(up, 0, True, monkeypatch, use_fused_topk=False)
    positions = torch.arange(2 * TOPK, dtype=torch.int32).view(2, TOPK)
    assert torch.equal(on.prepare_mtp_seed_indices(positions, up.extend), positions)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

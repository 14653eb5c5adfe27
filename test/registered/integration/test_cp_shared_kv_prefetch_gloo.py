"""Layer-ahead history prefetch of ``--enable-cp-shared-kv`` on two real CP ranks (gloo, CPU).

Two spawned processes publish the server args a prefill scheduler would (``--tp 2
--enable-prefill-cp --cp-strategy interleave --disaggregation-mode prefill``, with the flag) and
build upstream's process groups with upstream's own ``init_distributed_environment`` +
``initialize_model_parallel`` (gloo); the patched ``initialize_model_parallel`` makes the history
exchange's own group right after the attention-CP group. Then, on upstream's
``DeepseekSparseAttnBackend`` with a three-layer ``DSATokenToKVPool`` (each rank holding only its
owned pages; the batch of ``test_cp_shared_kv_dsa_backend_patched.py``: shared prefix pages, a
partial history page continued, a page id reused, a request rank 0 drops), each layer runs the
patched ``forward_extend`` (the flashmla kernel captured) and the indexer's index-K store and read
hooks, alternating which comes first. Checked on each rank, per layer:

* the exchange group has upstream's attention-CP ranks and is not upstream's communicator;
* the kernel's dense KV and the indexer's index-K read are byte-identical to the synchronous path
  (the runtime's ``materialize_history`` over upstream's attention-CP group on a snapshot of the
  pool, then the current rows) at every location a request can read, and equal to the truth;
* a second, smaller batch reuses the dense buffers (no new storage) with the same results;
* with the flag off the group hook makes nothing and ``forward_extend`` reads the pool.

On CPU a prefetch runs when it is started, so this shows the prefetched path's data and the order
of its collectives, not the overlap: that the side stream overlaps layer compute needs a GPU.
"""

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.multiprocessing as mp

from sglang_cpkv.testing.ci_register import register_cpu_ci
from sglang_cpkv.testing.dsa_backend_standin import make_dsa_backend

register_cpu_ci(est_time=40, suite="cpkv-cpu")

CP = 2
PAGE = 64
CAPACITY = 12
LAYERS = 3
KV_LORA, ROPE, TOPK = 8, 4, 160
# (prefix lens, extend lens, page ids per request, req_to_token rows): see the patched-backend test.
BATCH_A = ([128, 128, 100, 0], [40, 71, 50, 1], [[1, 2, 3], [1, 2, 4, 5], [6, 7, 2], [9]], [3, 1, 2, 4])
BATCH_B = ([64, 0], [30, 20], [[8, 10], [11]], [2, 1])
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


def _publish(model_dir, flag_on):
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    from sglang_cpkv.hooks import dsa_extend

    argv = [
        "--model-path",
        model_dir,
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
    server_args = prepare_server_args(argv + (["--enable-cp-shared-kv"] if flag_on else []))
    server_args.resolve_once()
    set_global_server_args_for_scheduler(server_args)
    dsa_extend._ENABLED = None  # read the flag of what was just published


def _loc(pages, pos):
    return pages[pos // PAGE] * PAGE + pos % PAGE


def _backend(batch):
    """Upstream's backend class with the attributes its __init__ derives from a model runner (as in
    the patched-backend test), over a LAYERS-layer DSA pool."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

    prefix, extend, pages, rows = batch
    req_pool = ReqToTokenPool(size=5, max_context_len=4 * PAGE, device="cpu", enable_memory_saver=False)
    for r, row in enumerate(rows):
        seq = prefix[r] + extend[r]
        req_pool.req_to_token[row, :seq] = torch.tensor([_loc(pages[r], p) for p in range(seq)], dtype=torch.int32)
    pool = DSATokenToKVPool(
        size=(CAPACITY - 1) * PAGE,
        page_size=PAGE,
        kv_lora_rank=KV_LORA,
        dtype=torch.bfloat16,
        qk_rope_head_dim=ROPE,
        layer_num=LAYERS,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=KV_LORA + ROPE,
    )
    return make_dsa_backend(DeepseekSparseAttnBackend, pool, req_pool, PAGE)


def _forward_batch(batch):
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    prefix, extend, pages, rows = batch
    seq = [p + e for p, e in zip(prefix, extend)]
    n = sum(extend)
    metadata = get_cp_strategy().build_metadata(num_tokens=n, seqs_len=seq, extend_seqs_len=extend)
    pad_logical_token_to_physical(metadata)
    return SimpleNamespace(
        batch_size=len(extend),
        forward_mode=ForwardMode.EXTEND,
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=torch.tensor(seq),
        seq_lens_sum=sum(seq),
        req_pool_indices=torch.tensor(rows),
        extend_seq_lens_cpu=extend,
        extend_seq_lens=torch.tensor(extend, dtype=torch.int32),
        extend_prefix_lens_cpu=prefix,
        extend_num_tokens=n,
        out_cache_loc=torch.tensor([_loc(pages[r], p) for r in range(len(extend)) for p in range(prefix[r], seq[r])]),
        attn_cp_metadata=metadata,
        input_ids=torch.zeros(n, dtype=torch.int64),
        global_num_tokens_cpu=None,
    )


def _layer_data(batch, layer):
    """Per layer: history rows and index-K pages of the whole pool, current k/k_rope/index keys."""
    g = torch.Generator().manual_seed(100 + layer)
    n = sum(batch[1])
    return SimpleNamespace(
        history=torch.randn(CAPACITY * PAGE, 1, KV_LORA + ROPE, generator=g).to(torch.bfloat16),
        history_index_pages=torch.randint(0, 256, (CAPACITY, PAGE * (128 + 4)), generator=g, dtype=torch.int32).to(
            torch.uint8
        ),
        k=torch.randn(n, 1, KV_LORA, generator=g).to(torch.bfloat16),
        k_rope=torch.randn(n, 1, ROPE, generator=g).to(torch.bfloat16),
        keys=torch.randn(n, 128, generator=g).to(torch.bfloat16),
    )


def _fill_owned_history(pool, batch, data, rank):
    """This rank's owned history pages: latent rows from the layer's data, index-K pages random bytes."""
    prefix, _, pages, _ = batch
    locs = sorted({_loc(pages[r], p) for r in range(len(prefix)) for p in range(prefix[r])})
    locs = [loc for loc in locs if (loc // PAGE) % CP == rank]
    owned_pages = sorted({loc // PAGE for loc in locs})
    for layer in range(LAYERS):
        pool.kv_buffer[layer][locs] = data[layer].history[locs]
        index_pages = pool.get_index_k_with_scale_buffer(layer)
        index_pages[owned_pages] = data[layer].history_index_pages[owned_pages]


def _synchronous_reference(plan, pool_snapshot, layer, data, upstream_group):
    """What the hooks did before the prefetch: materialize on the spot (upstream's attention-CP
    group), then the current latent rows (bf16 pool rows are ``cat(k, k_rope)``)."""
    from sglang_cpkv.hooks.layer_history import index_k_pages_as_rows
    from sglang_cpkv.runtime.layer import fill_current, materialize_history, new_dense_buffer

    kv_rows, index_pages = pool_snapshot
    dense = new_dense_buffer(plan, tuple(kv_rows[layer].shape[1:]), kv_rows[layer].dtype)
    materialize_history(plan, kv_rows[layer], dense, upstream_group)
    fill_current(plan, torch.cat([data.k, data.k_rope], dim=-1), dense)
    dense_index = torch.empty(
        (plan.num_requests * plan.pages_per_request, index_pages[layer].shape[1]), dtype=index_pages[layer].dtype
    )
    materialize_history(
        plan, index_k_pages_as_rows(index_pages[layer], PAGE), index_k_pages_as_rows(dense_index, PAGE), upstream_group
    )
    return dense, dense_index


def _run_batch(batch, rank, upstream_group, flag_on):
    """Run the batch's layers through the patched backend; return per-layer captures and checks."""
    from sglang.kernels.ops.kvcache import dsa_index_k_cache
    from sglang.kernels.ops.quantization.act_quant_triton import act_quant

    from sglang_cpkv.hooks import dsa_extend

    prefix, extend, pages, _ = batch
    backend, forward_batch = _backend(batch), _forward_batch(batch)
    pool = backend.token_to_kv_pool
    data = [_layer_data(batch, layer) for layer in range(LAYERS)]
    _fill_owned_history(pool, batch, data, rank)
    snapshot = (
        [t.clone() for t in pool.kv_buffer],
        [pool.get_index_k_with_scale_buffer(i).clone() for i in range(LAYERS)],
    )
    backend.init_forward_metadata(forward_batch)
    state = dsa_extend.batch_state(forward_batch)
    assert (state is not None) == flag_on
    n = sum(extend)
    owner = [(r, prefix[r] + i) for r in range(len(extend)) for i in range(extend[r])]
    local = list(range(rank, n, CP))
    physical = -(-max(len(range(q, n, CP)) for q in range(CP)) // CP) * CP
    captured = []
    for layer_id in range(LAYERS):
        d = data[layer_id]
        topk = torch.full((physical, TOPK), -1, dtype=torch.int32)
        for row, t in enumerate(local):
            r, pos = owner[t]
            visible = range(min(TOPK, pos + 1))
            locs = (
                [_loc(pages[r], p) for p in visible]
                if state is None
                else [r * state.plan.pages_per_request * PAGE + p for p in visible]
            )
            topk[row, : len(visible)] = torch.tensor(locs, dtype=torch.int32)
        q = torch.zeros(physical, KV_LORA + ROPE, dtype=torch.bfloat16)
        layer = SimpleNamespace(
            layer_id=layer_id,
            is_cross_attention=False,
            tp_q_head_num=1,
            tp_k_head_num=1,
            v_head_dim=KV_LORA,
            head_dim=KV_LORA + ROPE,
            scaling=1.0,
        )
        got = {}

        def kernel(**kwargs):  # the flashmla sparse kernel needs a GPU; capture what it is handed
            got["kv_cache"] = kwargs["kv_cache"]
            got["kv_cache_bytes"] = kwargs["kv_cache"].clone()
            return torch.zeros(kwargs["q_all"].shape[0], 1, KV_LORA)

        backend._forward_flashmla_sparse = kernel

        def attention():
            backend.forward_extend(
                q, d.k, d.k, layer, forward_batch, save_kv_cache=True, k_rope=d.k_rope, topk_indices=topk
            )

        def indexer():
            assert dsa_extend.store_index_k(pool, forward_batch, layer_id, d.keys, act_quant, 128, None)
            metadata = backend.forward_metadata
            seq_lens = metadata.indexer_seq_lens.to(torch.int32)
            got["index_k"] = dsa_extend.index_k_and_scale(
                pool,
                forward_batch,
                layer_id,
                seq_lens,
                metadata.real_page_table,
                int(seq_lens.sum()),
                int(seq_lens.max()),
            )
            got["index_args"] = (seq_lens, metadata.real_page_table, int(seq_lens.sum()), int(seq_lens.max()))

        if state is None:
            attention()
        else:
            for step in (attention, indexer) if layer_id % 2 == 0 else (indexer, attention):
                step()
        got["topk"] = topk
        captured.append(got)

    if state is None:
        for layer_id, got in enumerate(captured):
            assert got["kv_cache"].data_ptr() == pool.get_key_buffer(layer_id).data_ptr(), (
                "flag off: the kernel reads the pool"
            )
            current = torch.cat([data[layer_id].k, data[layer_id].k_rope], dim=-1)
            assert torch.equal(pool.kv_buffer[layer_id][forward_batch.out_cache_loc], current), (
                "flag off: every row written"
            )
        return None

    plan = state.plan
    slot_rows = plan.pages_per_request * PAGE
    kept = sorted({owner[t][0] for t in local})
    for layer_id, got in enumerate(captured):
        d = data[layer_id]
        dense, dense_index = _synchronous_reference(plan, snapshot, layer_id, d, upstream_group)
        readable = torch.tensor([r * slot_rows + p for r in kept for p in range(prefix[r] + extend[r])])
        kv = got["kv_cache_bytes"]
        assert torch.equal(kv[readable], dense[readable]), (
            f"rank {rank} layer {layer_id}: dense KV differs from the synchronous path"
        )
        for r in kept:
            for p in range(prefix[r] + extend[r]):
                truth = (
                    d.history[_loc(pages[r], p)]
                    if p < prefix[r]
                    else torch.cat([d.k[owner.index((r, p))], d.k_rope[owner.index((r, p))]], dim=-1)
                )
                assert torch.equal(kv[r * slot_rows + p], truth), (
                    f"rank {rank} layer {layer_id} request {r} position {p}"
                )
        k_fp8, k_scale = act_quant(d.keys, 128, None)
        dsa_index_k_cache.SetKAndS.execute(
            pool=pool,
            buf=dense_index,
            loc=plan.current_dense_locs.to(torch.int64),
            index_k=k_fp8,
            index_k_scale=k_scale,
        )
        seq_lens, table, total, longest = got["index_args"]
        want = dsa_index_k_cache.GetKAndS.execute(
            pool, dense_index, page_indices=table, seq_len_tensor=seq_lens, seq_len_sum=total, max_seq_len=longest
        )
        assert torch.equal(got["index_k"][0], want[0]) and torch.equal(got["index_k"][1], want[1]), (
            f"rank {rank} layer {layer_id}: index-K read differs from the synchronous path"
        )
        owned = (forward_batch.out_cache_loc // PAGE) % CP == rank
        current = torch.cat([d.k, d.k_rope], dim=-1)
        assert torch.equal(pool.kv_buffer[layer_id][forward_batch.out_cache_loc[owned]], current[owned])
    # Layers 0 and 2 share a buffer, layer 1 has the other.
    ptrs = [got["kv_cache"].data_ptr() for got in captured]
    assert ptrs[0] == ptrs[2] != ptrs[1], ptrs
    plan.raise_if_errors(f"rank {rank}")
    return ptrs


def _worker(rank, model_dir, init_method):
    from sglang_cpkv.testing.upstream_env import install_torchvision_stub

    install_torchvision_stub()
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # resolve as on Hopper
    os.environ["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    os.environ["SGLANG_CPKV_CHECKED"] = "1"
    _publish(model_dir, flag_on=True)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.cp.base import init_cp_strategy
    from sglang.srt.runtime_context import get_parallel

    from sglang_cpkv.hooks import dsa_extend, layer_history
    from sglang_cpkv.runtime.group import TorchDistCpGroup

    init_cp_strategy(enable_prefill_cp=True, cp_size=CP, cp_strategy="interleave")
    get_parallel().override_permanently(tp_rank=rank, attn_cp_rank=rank, attn_dcp_size=1, attn_dcp_rank=0)
    parallel_state.init_distributed_environment(
        world_size=CP, rank=rank, distributed_init_method=init_method, local_rank=0, backend="gloo"
    )
    parallel_state.initialize_model_parallel()  # patched: makes the exchange group after the attention-CP group
    attn_cp = parallel_state.get_attn_cp_group()
    exchange = layer_history.exchange_group()
    assert (exchange.cp_size, exchange.cp_rank) == (attn_cp.world_size, attn_cp.rank_in_group) == (CP, rank)
    assert exchange.group is not attn_cp.device_group and exchange.group is not attn_cp.cpu_group
    upstream_group = TorchDistCpGroup(attn_cp.device_group)

    ptrs_a = _run_batch(BATCH_A, rank, upstream_group, flag_on=True)
    ptrs_b = _run_batch(BATCH_B, rank, upstream_group, flag_on=True)
    assert set(ptrs_b) <= set(ptrs_a), "the smaller batch must reuse the dense buffers"

    _publish(model_dir, flag_on=False)
    dsa_extend.on_attn_cp_group_created(attn_cp)  # flag off: makes nothing (a second group would raise)
    assert layer_history.exchange_group() is exchange
    _run_batch(BATCH_A, rank, upstream_group, flag_on=False)


def test_prefetched_history_equals_the_synchronous_path_on_two_gloo_ranks(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DSA_CONFIG))
    init_method = f"file://{tmp_path / 'dist_init'}"
    mp.spawn(_worker, args=(str(tmp_path), init_method), nprocs=CP, join=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

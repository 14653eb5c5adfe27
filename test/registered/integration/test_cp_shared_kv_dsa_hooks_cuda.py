"""The DSA extend hooks on a GPU with upstream's CUDA pools and kernels (bs>1, shared prefix, cp=1).

Needs a CUDA device and the pinned upstream with its kernels (the image): upstream's fused index-K
store is a CUDA JIT kernel, so the index-K half of the mode (dense index-K view, owned store,
read through upstream's ``GetKAndS``) can only run here. Checked against upstream with the mode
off on the same batch (a full replica pool that upstream's own store/read paths fill):

* the dense latent view holds each request's own KV (history + current) at the remapped
  locations;
* the index K and scales read from the dense view with the dense page table equal upstream's read
  from the pool with the pool page table, request by request.

Skips (saying why) without a GPU or without upstream's CUDA stack; fails instead under
``SGLANG_CPKV_REQUIRE_UPSTREAM=1``, which the GPU test environment exports (``scripts/gpu_env/install.sh``:
the pinned upstream from carried wheels, the patch queue applied, ``sgl_kernel`` served by the import-only
stand-in).
"""

import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_cpkv.testing.ci_register import register_cuda_ci
from sglang_cpkv.testing.upstream_env import install_torchvision_stub, skip_or_fail

register_cuda_ci(est_time=120, stage="cpkv", runner_config="1-gpu")

PAGE = 64
CAPACITY = 12
PREFIX = [128, 128, 100]
EXTEND = [40, 71, 50]
PAGES = [[1, 2, 3], [1, 2, 4, 5], [6, 7, 8]]
REQ_POOL_INDICES = [3, 1, 2]


def _upstream():
    if not torch.cuda.is_available():
        skip_or_fail("needs a CUDA device")
    try:
        install_torchvision_stub()
        from sglang.kernels.ops.kvcache.dsa_fused_store_index_cache import (
            can_use_dsa_fused_store,
            fused_store_index_k_cache,
        )
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool
        from sglang.srt.runtime_context import get_parallel
    except ImportError as exc:
        skip_or_fail(f"needs the pinned upstream sglang with its CUDA kernels: {exc}")
    if not can_use_dsa_fused_store(torch.bfloat16, torch.int64, PAGE):
        skip_or_fail("upstream's fused index-K store is not available on this device")
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, attn_cp_size=1, attn_cp_rank=0)
    return SimpleNamespace(pool_cls=DSATokenToKVPool, req_pool_cls=ReqToTokenPool, store=fused_store_index_k_cache)


def _loc(r, pos):
    return PAGES[r][pos // PAGE] * PAGE + pos % PAGE


def _pool(up):
    return up.pool_cls(
        size=(CAPACITY - 1) * PAGE,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=1,
        device="cuda",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=576,
    )


def test_dense_views_match_upstream_reads_per_request():
    up = _upstream()
    from sglang_cpkv.hooks import dsa_extend
    from sglang_cpkv.runtime.group import SingleRankGroup

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(2)
    seq = [p + e for p, e in zip(PREFIX, EXTEND)]
    req_pool = up.req_pool_cls(size=4, max_context_len=4 * PAGE, device=dev, enable_memory_saver=False)
    for r, row in enumerate(REQ_POOL_INDICES):
        req_pool.req_to_token[row, : seq[r]] = torch.tensor([_loc(r, p) for p in range(seq[r])], dtype=torch.int32)
    history_locs = torch.tensor([_loc(r, p) for r in range(3) for p in range(PREFIX[r]) if r != 1], device=dev)
    out_cache_loc = torch.tensor([_loc(r, p) for r in range(3) for p in range(PREFIX[r], seq[r])], device=dev)
    n_hist, n = history_locs.numel(), out_cache_loc.numel()
    k = torch.randn(n_hist + n, 1, 512, generator=g, device=dev, dtype=torch.bfloat16)
    k_rope = torch.randn(n_hist + n, 1, 64, generator=g, device=dev, dtype=torch.bfloat16)
    index_key = torch.randn(n_hist + n, 128, generator=g, device=dev, dtype=torch.bfloat16)

    pool, replica = _pool(up), _pool(up)
    for p in (pool, replica):  # the history, written by upstream before this batch
        p.set_mla_kv_buffer(None, history_locs, k[:n_hist], k_rope[:n_hist], layer_id_override=0)
        up.store(index_key[:n_hist], p.get_index_k_with_scale_buffer(0), history_locs, p.index_page_size)
    replica.set_mla_kv_buffer(None, out_cache_loc, k[n_hist:], k_rope[n_hist:], layer_id_override=0)
    up.store(index_key[n_hist:], replica.get_index_k_with_scale_buffer(0), out_cache_loc, replica.index_page_size)

    state = dsa_extend.build_extend_state(
        pool=pool,
        req_to_token=req_pool.req_to_token,
        req_pool_indices=torch.tensor(REQ_POOL_INDICES, device=dev),
        prefix_lens=PREFIX,
        extend_lens=EXTEND,
        out_cache_loc=out_cache_loc,
        cp_size=1,
        cp_rank=0,
        strategy="none",
        group=SingleRankGroup(),
    )
    fb = SimpleNamespace(**{dsa_extend.BATCH_ATTR: state})
    dense = dsa_extend.extend_dense_kv(pool, 0, fb, k[n_hist:], k_rope[n_hist:])
    assert dsa_extend.store_index_k(pool, fb, 0, index_key[n_hist:], None, 128, None)  # the fused store: no act_quant

    table = req_pool.req_to_token[torch.tensor(REQ_POOL_INDICES, device=dev), : max(seq)]
    remapped = dsa_extend.remap_page_table(state.plan, table, None)
    full = replica.get_key_buffer(0)
    for r in range(3):
        want = full[table[r, : seq[r]].long()]
        got = dense[remapped[r, : seq[r]].long()]
        assert torch.equal(got, want), f"request {r}: dense latent view differs from upstream's replica"

    seq_lens = torch.tensor(seq, dtype=torch.int32, device=dev)
    pool_pages = torch.div(table[:, ::PAGE], PAGE, rounding_mode="floor").to(torch.int32)
    dense_pages = torch.div(remapped[:, ::PAGE], PAGE, rounding_mode="floor").to(torch.int32)
    want_k, want_s = replica.get_index_k_scale_buffer(0, seq_lens, pool_pages, sum(seq), max(seq))
    got_k, got_s = dsa_extend.index_k_and_scale(pool, fb, 0, seq_lens, dense_pages, sum(seq), max(seq))
    assert torch.equal(got_k, want_k) and torch.equal(got_s, want_s)
    state.plan.raise_if_errors()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

"""Triton tiles of the hash-table inverse's remap and build on one GPU (issue 33; its record:
benchmark/results/2026-12-03-h200-hash-inverse/triton_tiles.txt, where this script lived until issue 55). The tile
lists were edited between that session's calls; the defaults of ops/triton/ come from them.

    PYTHONPATH=$PWD/python SGLANG_CPKV_OPS_BACKEND=triton python3 benchmark/probe_triton_tiles.py
"""

import torch
import triton

from sglang_cpkv.ops import reference
from sglang_cpkv.ops import triton as T
from sglang_cpkv.ops.errors import new_error_counter

torch.manual_seed(0)
R, P, C, N, K, page = 8, 2048, 40960, 4096, 2048, 64
table = torch.stack([torch.randperm(C)[:P] for _ in range(R)]).to(torch.int32)
inv = reference.build_page_inverse(
    table.reshape(-1), torch.arange(R).repeat_interleave(P), R, C, new_error_counter("cpu")
)
inv = inv.to("cuda")
req = torch.arange(N) * R // N
pages = table[req][torch.arange(N)[:, None], torch.randint(0, P, (N, K))]
locs = (pages.long() * page + torch.randint(0, page, (N, K))).to(torch.int32)
locs[torch.rand(N, K) < 0.05] = -1
locs, req = locs.cuda(), req.cuda()
err = new_error_counter("cuda")
want = T.remap_locs(locs, req, inv, page, err)
for bn, bk, nw in [(0, 0, 0), (1, 64, 1)]:  # the tiles of call 3 (triton_tiles.txt)
    fn = lambda: T.remap_locs(locs, req, inv, page, err, block_n=bn, block_k=bk, num_warps=nw)
    assert torch.equal(fn(), want)
    print(
        f"triton remap bn={bn} bk={bk} nw={nw}: {triton.testing.do_bench(fn, warmup=20, rep=200) * 1e3:.1f} us",
        flush=True,
    )
flat = table.reshape(-1).cuda()
entry_req = torch.arange(R).repeat_interleave(P).cuda()
for block in (0, 128, 64, 512):
    fn = lambda: T.build_page_inverse(flat, entry_req, R, C, err, block=block)
    print(f"triton build block={block}: {triton.testing.do_bench(fn, warmup=20, rep=200) * 1e3:.1f} us", flush=True)

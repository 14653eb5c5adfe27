"""Multi-GPU CP correctness harness: bs>1 vs bs=1 byte equality, on real CP ranks, in two stacks.

**Serving** (:mod:`.serving`, the default of the CLI): upstream's DSA attention kit through the patched
backend, every route a server can take; each rank has upstream's distributed init and the patched
model-parallel groups. Needs the pinned upstream.

**Toy** (the modules below; torch and triton only): a small DSA-like prefill stack (:mod:`.model`: exact integer arithmetic on an fp32/bf16 grid, so no
bit depends on batch composition, row position or reduction order) runs scenario requests
(:mod:`.scenarios`: shared prefixes, per-request marker suffixes) through a radix-style prefix-caching
allocator (:mod:`.allocator`: reachable mode, and the collision modes of the seed's fork), with
chunked prefill, owner-sharded pools, layer-ahead prefetch and CURRENT_REUSE (:mod:`.engine`), on
real CP ranks (gloo on CPU, NCCL with one process per GPU). :mod:`.compare` judges every request
of a batch against the same request run alone; :mod:`.driver` runs it all and writes the report,
including the negative control (the seed's 1-D value-keyed inverse), which must show
contamination on the collision class and be harmless on the reachable class.

    python scripts/run_cp_harness.py --cp 1,2 --bs-list 2,4,8 --device cuda --out harness.json
"""

from sglang_cpkv.harness.driver import main, run_harness

__all__ = ["main", "run_harness"]

"""The CP correctness harness: bs>1 vs bs=1 byte equality on real CP ranks, through the serving path.

:mod:`.serving` runs upstream's DSA attention kit through the patched backend on every route a server can take,
one process per CP rank (gloo on CPU, NCCL with one GPU per rank, or gloo with every rank on one GPU), and judges
every request of a batch against its run alone and against the mode off. :mod:`.cli` is its command line. Test
support, not in the wheel; needs the pinned upstream.

    python scripts/run_cp_harness.py --cp 1,2 --bs-list 2,4,8 --device cuda --out harness.json
"""

"""The mode's reserved buffers for GLM-5.1-FP8 at cp 8, from upstream's own pool sizing (CPU, no GPU needed).

Resolves the P/D prefill server of the default deployment (``scripts/pd/glm51-fp8-b300.env``: TP 8 / CP 8,
interleave, chunked prefill 65536, FP8 KV, flashmla_auto / flashmla_kv, Mooncake) for the GLM-5 DSA config of the test fixtures (78 layers,
kv_lora 512 + rope 64 -> 656-byte packed FP8 rows, 128-dim index K, context 202752), with
``--enable-cp-shared-kv`` and the default ``--cp-shared-kv-max-batch-tokens``, and asks upstream's
``DefaultPoolConfigurator`` (patched) for the pool of a budget: the reservation it charges, each buffer group, and
the pool tokens the charge costs. Also with an EAGLE/MTP draft, and with upstream's default chunk size.

    python benchmark/cp_shared_kv_reservation.py [--budget-gib 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

GLM5_DIR = Path(__file__).resolve().parents[1] / "test" / "registered" / "upstream" / "fixtures" / "glm5_dsa"
PAGE, LAYERS = 64, 78
# The deployment's prefill server (scripts/pd/glm51-fp8-b300.env) as the sizing sees it.
DEPLOYMENT = dict(kv_cache_dtype="fp8_e4m3", dsa_prefill_backend="flashmla_auto", dsa_decode_backend="flashmla_kv")
CONFIGS = {
    "deployment (chunk 65536)": dict(chunked_prefill_size=65536),
    "deployment + EAGLE/MTP draft": dict(chunked_prefill_size=65536, speculative_algorithm="EAGLE"),
    "upstream's default chunk size": {},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-gib", type=float, default=100.0, help="KV budget per rank handed to the sizing")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    os.environ["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    os.environ["SGLANG_CP_DRAFT_SHARED_KV"] = "1"
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    torch.cuda.get_device_capability = lambda *a, **k: (10, 0)  # the B300-class prefill GPU the deployment plays
    from sglang_cpkv.capacity.upstream import pool_configurator, prefill_cp_server
    from sglang_cpkv.hooks import reservation as reservation_hooks

    budget = int(args.budget_gib * 2**30)
    rows = []
    for name, extra in CONFIGS.items():
        pools = {}
        for mode_on in (False, True):
            _, configurator = pool_configurator(
                prefill_cp_server(str(GLM5_DIR), **DEPLOYMENT, **extra, enable_cp_shared_kv=mode_on),
                layers=LAYERS,
                page_size=PAGE,
            )
            pools[mode_on] = configurator.calculate_pool_sizes(budget, PAGE).max_total_num_tokens
        reserved = reservation_hooks.published()
        rows.append(
            {
                "config": name,
                "chunked_prefill_size": reserved.chunk_tokens,
                "max_batch_tokens": reserved.max_batch_tokens,
                "dense_slots": reserved.dense_slots,
                "backends": reserved.backends,
                "parts_mib_per_backend": {k: round(v / 2**20, 1) for k, v in reserved.parts().items()},
                "reserved_gib": round(reserved.total_bytes / 2**30, 3),
                "pool_tokens_off": pools[False],
                "pool_tokens_on": pools[True],
                "pool_cost_percent": round(100 * (pools[False] - pools[True]) / pools[False], 2),
            }
        )
        print(json.dumps(rows[-1]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"budget_gib": args.budget_gib, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

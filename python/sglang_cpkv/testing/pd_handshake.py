"""Run upstream's P/D bootstrap handshake on a CPU machine: a prefill registers, a decode makes first contact.

    echo '{"prefill": {"argv": [...], "env": {...}}, "decode": {"argv": [...], "env": {...}}}' \\
        | python -m sglang_cpkv.testing.pd_handshake

Both ``argv`` are server command lines upstream's ``ServerArgs`` resolves (a local DSA ``config.json``, ``--device
cuda``, one bootstrap port). Upstream's objects do the work: ``CommonKVBootstrapServer``, a ``CommonKVManager`` per
prefill rank in ``PREFILL`` mode (registration), then one in ``DECODE`` mode (first contact, rank mapping). Output:
one JSON object (``info``, ``prefill_ranks``, ``decode``) or ``{"error", "message"}``; no GPU, process group or KV
transfer. Used by ``integration/test_cp_shared_kv_pd.py``; design: ``docs/design/cp-shared-kv.md`` section 8.
"""

from __future__ import annotations

import json
import sys
import time

from sglang_cpkv.envs import environment

HANDSHAKE_TIMEOUT_S = 30.0


def _kv_args(server_args, engine_rank: int):
    """Upstream's KVArgs of an MLA pool with no buffers: what the handshake compares (page size, dtype)."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.disaggregation.base.conn import KVArgs

    resolved = resolved_view(server_args)
    args = KVArgs()
    args.engine_rank = engine_rank
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, args.kv_layer_ids = [], [], [], []
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.state_types, args.state_data_ptrs, args.state_data_lens = [], [], []
    args.state_item_lens, args.state_layer_ids = [], []
    args.kv_cache_dtype_str = str(resolved.kv_cache_dtype)
    args.page_size = resolved.page_size
    args.system_dp_rank = 0
    args.pp_rank = 0
    return args


def _resolved(argv: list[str]):
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def _publish(server_args, world_rank: int) -> None:
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank))
    # pp_size 1: no pipeline group is built (nor read) without torch.distributed.
    get_parallel().override_permanently(pp_group=None)


def _run_prefill(case: dict) -> list[dict]:
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode

    with environment(case.get("env", {})):
        server_args = _resolved(case["argv"])
        CommonKVBootstrapServer(server_args.host, server_args.disaggregation_bootstrap_port)
        ranks = []
        for world_rank in range(server_args.tp_size):
            _publish(server_args, world_rank)
            manager = CommonKVManager(
                _kv_args(server_args, world_rank), DisaggregationMode.PREFILL, server_args, is_mla_backend=True
            )
            ranks.append({"cp_rank": manager.attn_cp_rank, "sends": not manager.is_dummy_cp_rank})
    return ranks


def _run_decode(case: dict) -> tuple[dict, dict]:
    import requests
    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import reset_context

    reset_context()
    with environment(case.get("env", {})):
        server_args = _resolved(case["argv"])
        _publish(server_args, 0)
        manager = CommonKVManager(_kv_args(server_args, 0), DisaggregationMode.DECODE, server_args, is_mla_backend=True)
        address = f"127.0.0.1:{server_args.disaggregation_bootstrap_port}"
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        while not manager.try_ensure_parallel_info(address):  # 503 until every prefill rank registered
            if time.monotonic() > deadline:
                raise TimeoutError(f"no prefill info from the bootstrap server at {address}")
            time.sleep(0.2)
    info = manager.prefill_info_table[address]
    query = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    payload = requests.get(f"http://{address}/route?{query}", timeout=5).json()
    mapping = {
        "target_cp_ranks": info.target_cp_ranks,
        "required_prefill_response_num": info.required_prefill_response_num,
    }
    return payload, mapping


def main() -> int:
    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    import torch

    # The DSA resolution branches ask for a device capability; report Hopper's.
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    case = json.load(sys.stdin)
    try:
        prefill_ranks = _run_prefill(case["prefill"])
        info, decode = _run_decode(case["decode"])
        result = {"info": info, "prefill_ranks": prefill_ranks, "decode": decode}
    except Exception as exc:  # a refusal by either side is the result
        result = {"error": type(exc).__name__, "message": str(exc)}
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Resolve upstream ``ServerArgs`` for a list of command lines on a CPU machine; print JSON.

    echo '[{"argv": [...], "env": {"NAME": "1"}}, ...]' | python -m sglang_cpkv.testing.resolve_server_args

Run it with the tree to test first on ``PYTHONPATH`` (:mod:`.upstream_trees`). Each case resolves a fresh record
(``prepare_server_args`` then ``resolve_once``) with its ``env`` set; the output is one JSON object per case:
``{"resolved": {field: repr}}`` or ``{"error": type, "message": str}``. The device capability is pinned to
``--capability`` (default 9.0) and the model comes from a local ``config.json`` (pass ``--skip-tokenizer-init``
and ``--device cuda`` in ``argv``). Used by ``integration/test_cp_shared_kv_server_args.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_cpkv.envs import environment


def _resolve(case: dict) -> dict:
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.server_args import prepare_server_args

    try:
        with environment(case.get("env", {})):
            server_args = prepare_server_args(case["argv"])
            server_args.resolve_once()
            view = resolved_view(server_args)
            return {"resolved": {f.name: repr(getattr(view, f.name)) for f in record_fields(type(server_args))}}
    except (Exception, SystemExit) as exc:  # the refusal is the result (argparse exits on an unknown flag)
        return {"error": type(exc).__name__, "message": str(exc)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", default="9.0", help="device capability MAJOR.MINOR to report")
    args = parser.parse_args()
    major, minor = (int(x) for x in args.capability.split("."))

    from sglang_cpkv.upstream_import import install_torchvision_stub

    install_torchvision_stub()
    import torch

    torch.cuda.get_device_capability = lambda *a, **k: (major, minor)
    cases = json.load(sys.stdin)
    json.dump([_resolve(case) for case in cases], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What both harness stacks put in their report: the summary of the check rows and the device line."""

from __future__ import annotations

import torch


def summarize(checks: list[dict], kinds) -> dict:
    """Counts of the check rows (each has ``check`` and ``passed``), overall and per kind of ``kinds``."""
    failed = sum(not c["passed"] for c in checks)
    return {
        "checks": len(checks),
        "passed": len(checks) - failed,
        "failed": failed,
        "by_kind": {
            k: {
                "passed": sum(c["passed"] for c in checks if c["check"] == k),
                "total": sum(c["check"] == k for c in checks),
            }
            for k in kinds
        },
    }


def device_line(device: str) -> str:
    return device if device == "cpu" else f"cuda ({torch.cuda.get_device_name(0)} x{torch.cuda.device_count()})"

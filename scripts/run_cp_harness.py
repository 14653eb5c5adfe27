#!/usr/bin/env python3
"""The CP correctness harness (bs>1 vs bs=1 byte equality through upstream's DSA kit and the patched backend):
one command.

    PYTHONPATH=python python scripts/run_cp_harness.py --cp 1,2 --bs-list 2,4,8 --device cuda --out harness.json

CPU (gloo): ``--device cpu``. Exit status 0 when every check passed. See :mod:`sglang_cpkv.harness.serving` for the
scenarios, the checks and the report.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sglang_cpkv.harness.cli import main

if __name__ == "__main__":
    sys.exit(main())

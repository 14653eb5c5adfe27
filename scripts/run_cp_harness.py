#!/usr/bin/env python3
"""Multi-GPU CP correctness harness (bs>1 vs bs=1 byte equality; --stack serving: upstream's DSA kit through the
patched backend, the default; --stack toy: whole-model prefill with the 1-D-inverse negative control): one command.

    PYTHONPATH=python python scripts/run_cp_harness.py --cp 1,2 --bs-list 2,4,8 --scenarios all \
        --device cuda --backend auto --out harness.json

CPU (gloo): ``--device cpu --backend torch``. Exit status 0 when every check passed. See
:mod:`sglang_cpkv.harness.driver` for the checks and the report.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sglang_cpkv.harness import main

if __name__ == "__main__":
    sys.exit(main())

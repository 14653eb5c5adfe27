#!/usr/bin/env python3
"""bs>1 vs bs=1 byte equality and cross-request contamination against a live server or P/D router.

The logic lives in sglang_cpkv.contamination_client (see its docstring or --help for the exit statuses):
    scripts/validate_bs_gt1_contamination.py --url http://127.0.0.1:8000 -n 8 --out result.json
"""

import sys
from pathlib import Path

try:
    from sglang_cpkv.contamination_client import main
except ImportError:  # a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from sglang_cpkv.contamination_client import main

if __name__ == "__main__":
    sys.exit(main())

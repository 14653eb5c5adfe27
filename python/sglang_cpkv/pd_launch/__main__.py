"""``python -m sglang_cpkv.pd_launch``: the P/D launcher's command line (:mod:`sglang_cpkv.pd_launch.cli`)."""

import sys

from sglang_cpkv.pd_launch.cli import main

if __name__ == "__main__":
    sys.exit(main())

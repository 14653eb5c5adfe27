"""``python -m sglang_cpkv.capacity``: the capacity planner's command line (:mod:`sglang_cpkv.capacity.cli`)."""

import sys

from sglang_cpkv.capacity.cli import main

sys.exit(main())

"""``python -m sglang_cpkv.soak``: the soak's command line (:mod:`sglang_cpkv.soak.cli`)."""

import sys

from sglang_cpkv.soak.cli import main

sys.exit(main())

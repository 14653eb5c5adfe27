"""``python -m sglang_cpkv.overlay``: the overlay tool's command line (:mod:`sglang_cpkv.overlay.cli`)."""

import sys

from sglang_cpkv.overlay.cli import main

sys.exit(main())

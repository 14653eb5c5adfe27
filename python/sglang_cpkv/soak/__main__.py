import sys

from sglang_cpkv.soak.cli import main

sys.exit(main())

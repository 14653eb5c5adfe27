import sys

from sglang_cpkv.capacity.cli import main

sys.exit(main())

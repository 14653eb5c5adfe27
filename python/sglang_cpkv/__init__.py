"""sglang-cpkv: CP shared-KV for DSA prefill on a pinned upstream SGLang.

This package imports with torch and triton only. Upstream sglang is reached solely through the
patch queue (``patches/``), whose hooks call into this package.
"""

__version__ = "0.1.0"

"""Hooks between the pinned upstream sglang and our CP shared-KV runtime.

Every module here is called from a patch of ``patches/core/`` (see
``docs/design/cp-shared-kv.md``) and imports upstream lazily, inside functions, so that
``import sglang_cpkv`` stays torch + triton only.
"""

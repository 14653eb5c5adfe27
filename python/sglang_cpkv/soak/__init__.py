"""The soak: upstream's P/D prefill server loop with ``--enable-cp-shared-kv``, request after request, checked.

``python -m sglang_cpkv.soak`` (:mod:`.cli`) runs scenarios of a seeded, traffic-shaped workload (:mod:`.workload`)
through upstream's own scheduler, disaggregation queues, radix cache, allocator and DSA backend (:mod:`.server`,
:mod:`.prefill`), a stand-in model whose KV rows are a function of their token prefixes (:mod:`.kv_function`,
:mod:`.model`), and the real Mooncake transfer engine to a decode server of upstream's objects (:mod:`.decode`); the
invariants (:mod:`.invariants`) and the report (:mod:`.report`). Design: ``docs/design/cp-shared-kv-soak.md``.
Test support: not in the wheel.
"""

"""What cp buys on a model and GPU: a capacity and per-layer cost planner from upstream's own pool sizing.

``python -m sglang_cpkv.capacity --preset glm-5.1-fp8 --gpu h200 --tp 8 --cp 1,2,4,8 --json c.json --plot c.png``
(also ``sglang-cpkv-capacity``): per cp, the KV tokens a prefill node holds with the mode, with upstream's replicated
CP and with upstream's kv-sharding, the mode's reservation, and the bytes the mode moves per layer for a batch.
Options and how it counts: ``docs/operations.md``, "The capacity planner".

Modules: :mod:`.upstream` (upstream's sizing, scoped), :mod:`.traffic` (per-layer bytes from the real plan),
:mod:`.planner` (the rows), :mod:`.presets` (models and GPUs), :mod:`.weights`, :mod:`.report` (table, JSON, plot),
:mod:`.cli`. Importing this package imports neither upstream nor matplotlib.
"""

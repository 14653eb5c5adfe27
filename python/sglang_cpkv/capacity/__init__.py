"""What cp buys on a model and GPU: a capacity and per-layer cost planner from upstream's own pool sizing.

``python -m sglang_cpkv.capacity --preset glm-5.1-fp8 --gpu h200 --tp 8 --cp 1,2,4,8 --json c.json --plot c.png``
(also ``sglang-cpkv-capacity``). Per cp it resolves, on the CPU, upstream 0.5.23's ``ServerArgs`` of a P/D
prefill server and runs upstream's pool configurator (patched: the mode's reservation is charged) and allocator
construction for three servers - the mode, upstream's replicated CP, upstream's kv-sharding - and reports the KV
tokens the node holds (what upstream's scheduler admits against), the mode's reservation, the longest context and
the concurrency that fit, and for a batch the bytes the mode moves per layer, today's pipeline beside the floor,
with their lower-bound times at the GPU's vendor peaks.

Modules: :mod:`.upstream` (upstream's sizing, scoped), :mod:`.traffic` (per-layer bytes from the real plan),
:mod:`.planner` (the rows), :mod:`.presets` (models and GPUs, with their sources), :mod:`.report` (table, JSON,
plot), :mod:`.cli`. Importing this package imports neither upstream nor matplotlib.
"""

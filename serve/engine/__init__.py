"""The only code that touches ONNX Runtime: the engine (engine.py, its layers drawn in state.py: adapters.py,
rows.py, step.py, prefill.py) over its KV cache (kv_cache.py: buffers, bindings, row copies), the prefix cache
(prefix_cache.py), sampling (sampling.py), speculation's proposers (speculation.py), prompt scoring
(prompt_scoring.py), sessions and devices (runtime.py), and the types that cross into and out of it
(types.py)."""

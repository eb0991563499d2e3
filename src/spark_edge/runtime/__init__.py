"""What spark-edge changes in vLLM's behaviour at runtime, and the compile cache's bookkeeping.

- `fixes`: every runtime patch of vLLM, applied by `apply_runtime_fixes()` (from the plugin).
- `compile_cache`: the cache root's stamp (ISA, versions, weight path) and the hit/miss event file.
- `memory`: handing freed allocator memory back to the OS.
- `post_import`: run a callback when a module is imported, so patches never import vLLM modules early.

Nothing here is imported by this package's `__init__`: the plugin runs in every vLLM process,
and each module imports only what it needs.
"""

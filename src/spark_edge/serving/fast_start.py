"""What a start spends beside loading the model, cut: full garbage collections, hashing the compilers, and
precompiling torch's headers.

Warm restarts of the default model, w4a16, single layout, command to a healthy /health, AMD EPYC Zen 4,
alternating the code before and after these cuts and runtime fix 10 (runtime/fixes.py) in one run, 5 each:
13.4-14.5 s before, 9.3-9.8 s after.

**Full garbage collections.** A start imports torch, vLLM and transformers (millions of objects the
collector tracks) and builds the engine, and CPython runs a full collection, which scans every one of them,
each time the objects that survived the younger collections grow by a quarter. On a warm restart of the
default model 16 full collections took 3.2 s of the 14.8 s to a healthy /health, while finding next to
nothing: what a start allocates is the server's for its whole life.

So the oldest generation's threshold is raised for the start: young collections still run (they free the
short-lived cycles a start makes), full ones wait. And once the server's modules are imported, what they
built is moved out of the collector's sight (`gc.freeze`, after a young collection): vLLM still collects
fully four times while it builds its engine (after creating the model, after loading it, after its
profiling run, and before it freezes the heap itself in `EngineCore.__init__`), and each of those then
scans only what the engine made (0.37 s each before). The threshold is put back when the engine is ready.

**The compilers' fingerprints.** Before it loads a compiled graph, vLLM keys it by Inductor's system
facts, among them a sha256 of Triton's sources and of its 477 MiB `libtriton.so` (0.34 s; Triton is
installed, xgrammar requires it, though CPU vLLM never runs it) and one of torch's sources (0.11 s).
torch computes both once per process and offers to start them early (`prefetch()`, a thread: hashing
releases the GIL), so they run on the second core while vLLM's server modules import.

**torch's precompiled header.** Before Inductor loads a compiled graph's library it precompiles torch's
headers (g++, ~490 MiB, ~5 s) into /tmp, unless it finds them there: a host keeps them, a container starts
without (its /tmp is new), so every warm container start compiled, beyond the plan's load peak. serve turns
header precompiling off (`TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0`, serve.import_time_env): measured
with /tmp's headers removed before each start, 3 each alternated, 14.9-18.0 s and a load peak of 1047-1060
MiB with it, 9.5-10.0 s and 718-739 MiB without. It is part of vLLM's compile key, so a cache compiled with
it is compiled once more. A cold compile is no slower without it (a graph has one or two C++ files, and
a header precompiled for them saves no parsing): 77.5 s to /health with the checkpoint built, against 74 s
in the engine phase alone of a cold start with it.
"""

from __future__ import annotations

import gc

_HELD_OFF = 1 << 30  # younger collections between two full ones: none during a start


def hold_off_full_collections() -> None:
    young, middle, oldest = gc.get_threshold()
    if oldest != _HELD_OFF:
        global _restore
        _restore = (young, middle, oldest)
        gc.set_threshold(young, middle, _HELD_OFF)


def freeze_imported() -> None:
    """Modules, classes and functions live as long as the process: never scanned again."""
    gc.collect(1)
    gc.freeze()


def prefetch_compiler_keys() -> None:
    """Call once torch._inductor is imported (vLLM's import does it)."""
    from torch._inductor import codecache

    for key in (codecache.triton_key, codecache.torch_key):
        prefetch = getattr(key, "prefetch", None)  # torch >= 2.10's prefetchable_cache
        if prefetch is not None:
            prefetch()


def resume_full_collections() -> None:
    if _restore is not None:
        gc.set_threshold(*_restore)


_restore: tuple[int, int, int] | None = None

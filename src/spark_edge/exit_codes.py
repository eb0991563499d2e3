"""Exit codes of the spark-edge command; README.md's table is generated from MEANINGS (scripts/readme_tables.py).

Distinct codes let a supervisor (Docker restart policy, Kubernetes) and a user tell
a problem that retrying will not fix from a crash. spark_edge.errors gives each error its code.
"""

OK = 0
FAILURE = 1
USAGE = 2
CHECKPOINT = 3
UNSUPPORTED_HOST = 4
MEMORY = 5
PEER = 6
ENGINE_DIED = 7

MEANINGS = {
    OK: "success",
    FAILURE: "unexpected error (a bug; the traceback is printed)",
    USAGE: "bad command-line usage, or a bad value in a `SPARK_EDGE_*` variable (named)",
    CHECKPOINT: "the model source or a built checkpoint is missing, corrupt or unsupported, or a TLS file given "
    "to vLLM cannot be read",
    UNSUPPORTED_HOST: "this host cannot run vLLM's CPU kernels (x86-64 needs AVX2, FMA and F16C; arm64 needs "
    "NEON), or cannot run the weight path asked for",
    MEMORY: "the memory plan does not fit under the ceiling even at the minimum context",
    PEER: "`bench --peer`: the peer (llama.cpp) could not be built or converted (one line says why; the "
    "spark-edge arms were still measured)",
    ENGINE_DIED: "`serve`: the engine process died while starting or serving (killed by the OOM killer, or a "
    "crash); the line says how",
}

"""Exit codes of the spark-edge command (documented in the README).

Distinct codes let a supervisor (Docker restart policy, Kubernetes) and a user tell
a problem that retrying will not fix from a crash.
"""

OK = 0
FAILURE = 1  # unexpected error (a bug): the traceback is printed
USAGE = 2  # bad command-line usage (click's own code)
CHECKPOINT = 3  # model source or built checkpoint missing, corrupt or unsupported
UNSUPPORTED_HOST = 4  # this CPU cannot run vLLM's CPU kernels, or not the weight path asked for
MEMORY = 5  # the memory plan does not fit under the ceiling even at the minimum context
PEER = 6  # bench --peer: the peer (llama.cpp) could not be built or converted; spark-edge's arms were measured
ENGINE_DIED = 7  # serve: the engine process died while serving (OOM killer, crash); a supervisor restarts it

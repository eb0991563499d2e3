"""Where vLLM's model worker runs: inside the engine-core process, or in a process of its own.

vLLM's OpenAI server always runs the engine core in a process of its own (the frontend stays
off the compute threads). On CPU, vLLM 0.32 then also moves the single model worker into a
third process (`CpuPlatform.check_and_update_config` turns the "uni" executor into "mp" unless
VLLM_ENABLE_V1_MULTIPROCESSING=0), so every decode step crosses a shared-memory queue between
two busy-polling processes. On a 2-core box that costs about a third of the decode rate.

"engine" (default) keeps the worker in the engine-core process: VLLM_ENABLE_V1_MULTIPROCESSING=0
is read only by that CPU check, the offline `LLM` class (not used by the server) and a log line;
the API server's engine client is multiprocess regardless. "split" is vLLM's own layout, kept for
comparison (`spark-edge bench --paths w4a16,w4a16@split`).

"single" runs the engine core on a thread of the API server's process (runtime/inproc_engine.py,
installed by runtime/fixes.py when SPARK_EDGE_PROCESS_LAYOUT says so): one import of torch and vLLM,
one process, the engine and its worker as in "engine".
"""

from __future__ import annotations

from spark_edge.environment import PROCESS_LAYOUT, STUCK_STEP_TIMEOUT

LAYOUTS = ("engine", "split", "single")
DEFAULT_STUCK_STEP_S = int(STUCK_STEP_TIMEOUT.default or 0)
# single measured no slower than engine on every served figure, and 0.65x its settled memory (AMD EPYC Zen 4,
# default model, w4a16, warm, same run: tg128 97.3 vs 83.9 tok/s, 4 streams 291.5 vs 273.1 tok/s, TTFT p95 at
# 4 streams 125 vs 124 ms, settled 841 vs 1306 MiB); docs/footprint.md
DEFAULT_LAYOUT = "single"


def layout_env(layout: str) -> dict[str, str]:
    """What vLLM (and the in-process engine's fix) read at import; the layout's variable is set to the layout
    resolved, so every process and patch of this server sees the same one."""
    if layout in ("engine", "single"):
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", PROCESS_LAYOUT.name: layout}
    if layout == "split":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", PROCESS_LAYOUT.name: layout}
    raise ValueError(f"unknown process layout {layout!r} (known: {', '.join(LAYOUTS)})")


def layout_args(layout: str) -> list[str]:
    """vLLM arguments: "uni" names the in-process executor (vLLM picks it for one worker anyway)."""
    layout_env(layout)  # validates
    return ["--distributed-executor-backend", "mp" if layout == "split" else "uni"]

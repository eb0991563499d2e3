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
"""

from __future__ import annotations

LAYOUTS = ("engine", "split")
DEFAULT_LAYOUT = "engine"


def layout_env(layout: str) -> dict[str, str]:
    if layout == "engine":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if layout == "split":
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    raise ValueError(f"unknown process layout {layout!r} (known: {', '.join(LAYOUTS)})")


def layout_args(layout: str) -> list[str]:
    """vLLM arguments: "uni" names the in-process executor (vLLM picks it for one worker anyway)."""
    layout_env(layout)  # validates
    return ["--distributed-executor-backend", "uni" if layout == "engine" else "mp"]

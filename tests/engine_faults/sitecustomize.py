"""Test-only: put on PYTHONPATH by tests/test_single_process.py, it makes the next engine step fail on request.

While the file named by SPARK_EDGE_TEST_ENGINE_FAULT holds "raise", an engine step raises; while it holds
"hang", a step sleeps (the stuck engine the in-process client's watchdog must catch). Absent or empty, the
engine runs as usual.
"""

import os

_FLAG = os.environ.get("SPARK_EDGE_TEST_ENGINE_FAULT")

if _FLAG:
    import time
    from pathlib import Path

    from spark_edge.runtime.post_import import when_imported

    def _fault() -> str:
        try:
            return Path(_FLAG).read_text().strip()
        except OSError:
            return ""

    def _patch(core_module) -> None:
        step = core_module.EngineCore.step

        def faulty_step(self, *args, **kwargs):
            fault = _fault()
            if fault == "raise":
                raise RuntimeError("injected engine fault (tests/engine_faults)")
            if fault == "hang":
                time.sleep(3600)
            return step(self, *args, **kwargs)

        core_module.EngineCore.step = faulty_step

    when_imported("vllm.v1.engine.core", _patch)

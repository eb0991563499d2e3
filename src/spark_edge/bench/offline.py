"""The offline engine beside the server: vLLM's `LLM` in one process, and a profile of its decode step.

Run as a child process (`python -m spark_edge.bench.offline CHECKPOINT VOCAB`), since vLLM's engine
cannot be torn down cleanly inside the bench. It prints one JSON line: prefill (pp512) and decode
(tg128 minus tg1) rates with the same semantics as the served arms, the aggregate decode rate of as many
sequences as the served plan decodes together (so the served 4-stream figure can be told apart from what
the engine does with 4 rows), and the top ops of a profiled run of decode steps by self CPU time per
step, which shows what surrounds the GEMMs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

RESULT_PREFIX = "OFFLINE_RESULT "
PROFILED_STEPS = 32
TOP_OPS = 15


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def _tg128_tps(llm, prompt, seqs: int, reps: int) -> float:
    """Decode tokens/s of `seqs` one-token prompts together: 128-token minus 1-token runs, as llama-bench's tg128."""
    t1 = min(_timed(llm, [prompt(1) for _ in range(seqs)], 1) for _ in range(reps))
    t128 = min(_timed(llm, [prompt(1) for _ in range(seqs)], 128) for _ in range(reps))
    return seqs * 127 / (t128 - t1)


def _profile_decode(llm, prompt: list[int]) -> list[dict]:
    """Self CPU time per decode step of the ops that cost most (the worker runs in this process)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _timed(llm, [prompt], PROFILED_STEPS + 1)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]
    return [
        {
            "op": e.key,
            "calls_per_step": e.count / PROFILED_STEPS,
            "self_ms_per_step": e.self_cpu_time_total / 1000 / PROFILED_STEPS,
        }
        for e in rows
    ]


def kv_cache_bytes(checkpoint: str) -> int:
    """The KV cache the memory plan gives the served arms at full context: every sequence at full length."""
    from spark_edge.planning.memory_plan import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, kv_bytes_for
    from spark_edge.planning.model_shape import ModelShape

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return kv_bytes_for(ModelShape.from_config(config), DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS)


def run(checkpoint: str, vocab: int, reps: int) -> dict:
    from vllm import LLM

    rng = random.Random(1)
    prompt = lambda n: [rng.randrange(256, vocab) for _ in range(n)]  # noqa: E731
    start = time.perf_counter()
    from spark_edge.planning.memory_plan import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS

    llm = LLM(
        model=checkpoint,
        dtype="bfloat16",
        max_model_len=DEFAULT_MAX_MODEL_LEN,
        max_num_seqs=DEFAULT_MAX_NUM_SEQS,
        kv_cache_memory_bytes=kv_cache_bytes(checkpoint),
        distributed_executor_backend="uni",
    )
    ready_s = time.perf_counter() - start
    _timed(llm, [prompt(8)], 8)  # warm-up
    pp = min(_timed(llm, [prompt(512)], 1) for _ in range(reps))
    return {
        "ready_s": ready_s,
        "pp512_tps": 512 / pp,
        "tg128_tps": _tg128_tps(llm, prompt, 1, reps),
        "batched_seqs": DEFAULT_MAX_NUM_SEQS,
        "batched_tg128_tps": _tg128_tps(llm, prompt, DEFAULT_MAX_NUM_SEQS, reps),
        "profile_top_ops": _profile_decode(llm, prompt(1)),
    }


def run_offline(
    checkpoint: Path, vocab: int, reps: int, cache_root: Path, log_path: Path, timeout_s: float = 1800
) -> dict:
    """The child process; raises with the log's tail if it fails."""
    env = {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(cache_root),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    cmd = [sys.executable, "-m", "spark_edge.bench.offline", str(checkpoint), str(vocab), str(reps)]
    with open(log_path, "ab") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(f"the offline engine run failed: {engine_error(log_path)} (log: {log_path})")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def engine_error(log_path: Path) -> str:
    """The engine's own last error line (vLLM logs the cause before the traceback's end), else the last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:400]


if __name__ == "__main__":
    result = run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)

"""The llama.cpp peer's arm: llama-server measured by the same client as the spark-edge arms, then llama-bench.

llama-server gets what spark-edge's server gets: the same threads (the usable cores), as many slots as
`--max-num-seqs` and the same context per sequence, so the streams at 1/4/8 clients compare like with
like. llama-bench's figures (pp512, tg128, same threads) are llama.cpp's own in-process measurement,
reported beside the served ones for each GGUF. llama-perplexity scores Q4_K_M and BF16 on the fidelity text:
llama.cpp's own 4-bit cost on this model, the fidelity gate's second term (issue #36: within 0.01 of it where
the source's own grid puts x1.06 out of reach).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spark_edge.bench.server_arm import ArmResult, Launch, free_port, measure_server

LLAMA_BENCH_TIMEOUT_S = 1800
PERPLEXITY_QUANTS = ("Q4_K_M", "BF16")  # the 4-bit format the gate compares with, over its own bf16
# llama-server's own lookup decoding (n-grams of the context, no draft model), with llama.cpp's defaults: the
# peer of spark-edge's n-gram speculation (an arm of its own where a spark-edge arm speculates)
LOOKUP_ENV = {"LLAMA_ARG_SPEC_TYPE": "ngram-simple"}
_FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


@dataclass(frozen=True)
class Peer:
    bin_dir: Path
    ggufs: dict[str, Path]  # quantization -> GGUF; the first is the one llama-server serves
    threads: int
    context: int  # per sequence, as spark-edge's --max-model-len
    slots: int  # as spark-edge's --max-num-seqs
    llama_bench: bool = True  # also run llama-bench on every GGUF (one arm of the peer does)

    @property
    def served_quant(self) -> str:
        return next(iter(self.ggufs))


def llama_server_launch(peer: Peer, port: int, env: dict[str, str]) -> Launch:
    gguf = peer.ggufs[peer.served_quant]
    # llama-server splits -c among its -np slots: the total is the context times the slots
    cmd = [
        str(peer.bin_dir / "llama-server"),
        "-m",
        str(gguf),
        "-a",
        gguf.stem,
        "-t",
        str(peer.threads),
        "-c",
        str(peer.context * peer.slots),
        "-np",
        str(peer.slots),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics",
        "--no-webui",
    ]
    return Launch(cmd, {**os.environ, **env}, gguf.stem)  # the arm's variables over the bench's own


def parse_llama_bench(jsonl: str) -> dict:
    """llama-bench `-o jsonl`: one object per test; pp (n_gen 0) and tg (n_prompt 0) rows become rates."""
    rows = [json.loads(line) for line in jsonl.splitlines() if line.strip().startswith("{")]
    out: dict = {}
    for row in rows:
        if row["n_prompt"] > 0 and row["n_gen"] == 0:
            key = f"pp{row['n_prompt']}"
        elif row["n_gen"] > 0 and row["n_prompt"] == 0:
            key = f"tg{row['n_gen']}"
        else:
            continue
        out[f"{key}_tps"] = row["avg_ts"]
        out[f"{key}_stddev_tps"] = row["stddev_ts"]
        out.setdefault("build", f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})")
        out.setdefault("threads", row.get("n_threads"))
    if "pp512_tps" not in out or "tg128_tps" not in out:
        raise ValueError(f"llama-bench printed no pp512 and tg128 rows ({len(rows)} rows)")
    return out


def _exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died with {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died with signal {-returncode}"
    return f"exited with {returncode}"


def run_llama_bench(peer: Peer, gguf: Path, reps: int) -> dict:
    cmd = [
        str(peer.bin_dir / "llama-bench"),
        "-m",
        str(gguf),
        "-t",
        str(peer.threads),
        "-p",
        "512",
        "-n",
        "128",
        "-r",
        str(reps),
        "-o",
        "jsonl",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LLAMA_BENCH_TIMEOUT_S)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"llama-bench on {gguf.name} {_exit_reason(done.returncode)}: {last}")
    return parse_llama_bench(done.stdout)


def run_peer_arm(
    tag: str, peer: Peer, vocab: int, log_path: Path, reps: int, served: bool, env: dict[str, str]
) -> ArmResult:
    """llama-server through the bench's client, then llama-bench on every GGUF (never at the same time)."""
    port = free_port()
    result = measure_server(
        tag, llama_server_launch(peer, port, env), port, vocab, log_path, reps, ready_timeout_s=300, served=served
    )
    for quant, gguf in peer.ggufs.items() if peer.llama_bench else ():
        try:
            result.llama_bench[quant] = run_llama_bench(peer, gguf, reps)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            result.llama_bench[quant] = {"error": str(exc)}
    return result


def run_llama_perplexity(peer: Peer, gguf: Path, text: Path, window: int, windows: int) -> float:
    """llama.cpp's perplexity of `text` in `windows` windows of `window` tokens (it scores each window's
    second half, so its figure is its own scale: only its ratios between GGUFs are compared)."""
    cmd = [
        str(peer.bin_dir / "llama-perplexity"),
        "-m",
        str(gguf),
        "-f",
        str(text),
        "-c",
        str(window),
        "--chunks",
        str(windows),
        "-t",
        str(peer.threads),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=LLAMA_BENCH_TIMEOUT_S)
    found = _FINAL_PPL.search(done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        last = (done.stderr.strip().splitlines() or [""])[-1]
        raise RuntimeError(f"llama-perplexity on {gguf.name} {_exit_reason(done.returncode)}: {last}")
    return float(found.group(1))


def peer_perplexity(peer: Peer, text: Path, window: int, windows: int) -> dict:
    """{GGUF: perplexity} for PERPLEXITY_QUANTS and `q4_k_m_ratio`, or {"error": why}."""
    try:
        scored = {q: run_llama_perplexity(peer, peer.ggufs[q], text, window, windows) for q in PERPLEXITY_QUANTS}
    except (KeyError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return {**scored, "q4_k_m_ratio": round(scored["Q4_K_M"] / scored["BF16"], 4)}

#!/usr/bin/env python3
"""Two servers of one checkpoint on one host: do they share its weights? Writes docs/shared-weights.md,
naming the host (issue #35's targets).

    .venv/bin/python scripts/shared_weights.py [--what "the 1.7B shape, w4a16"] [--out F] [-- SERVE OPTIONS]

One data folder (a temporary one, or $SPARK_EDGE_HOME when given). Server A starts (building and compiling if
it must), answers a completion, and its process tree's memory is read from /proc/PID/smaps: Rss and Pss of
the mapped weights (the files under mapped-weights/ that runtime fix 9 maps), of other files, and anonymous.
Then server B starts on the same folder with the same options, answers, and both trees are read again. The
servers start one after the other: B compiles nothing (A's cache) and A idles while B loads.

What #35 asks: the two trees' summed Pss of the weights within 5% of A's alone (one copy, shared), B adding
no more than its own anonymous memory, a tree's file-backed Rss at least 0.8x the checkpoint's bytes, and its
settled anonymous Rss within a margin over the KV cache of its plan (`spark-edge plan --json`, same options);
#34 asks the same margin of the one-process layout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from footprint import host  # noqa: E402 (this folder's footprint.py: how the generated docs name the host)

from spark_edge.metrics.process_tree import process_tree  # noqa: E402
from spark_edge.runtime.mapped_weights import MAPPED_DIR, checkpoint_key  # noqa: E402
from spark_edge.serving.server_process import ServerProcess, free_port  # noqa: E402

MiB = 1 << 20
START_TIMEOUT_S = 1800  # a first start builds and compiles; the 1.7B shape's build takes minutes


@dataclass
class Memory:
    """One process tree's resident memory, in bytes, by kind of mapping."""

    weights_rss: int = 0
    weights_pss: int = 0
    files_rss: int = 0  # other file-backed mappings: libraries, the checkpoint if vLLM maps it
    anon_rss: int = 0
    weight_files: frozenset[str] = frozenset()

    @property
    def file_rss(self) -> int:
        return self.weights_rss + self.files_rss


_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$")
_FIELD = re.compile(r"^(\w+):\s+(\d+) kB$")


def _mappings(pid: int) -> list[tuple[str, dict[str, int]]]:
    """(path, {field: bytes}) for each mapping of /proc/PID/smaps; anonymous ones have no path."""
    out: list[tuple[str, dict[str, int]]] = []
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text(errors="replace").splitlines()
    except OSError:  # gone since the tree was listed
        return out
    for line in lines:
        if header := _HEADER.match(line):
            out.append((header.group(1), {}))
        elif out and (field := _FIELD.match(line)):
            out[-1][1][field.group(1)] = int(field.group(2)) * 1024
    return out


def tree_memory(root_pid: int) -> Memory:
    m = Memory()
    files: set[str] = set()
    for pid in process_tree(root_pid):
        for path, f in _mappings(pid):
            anon = f.get("Anonymous", 0)
            m.anon_rss += anon
            if f"/{MAPPED_DIR}/" in path:
                m.weights_rss += f.get("Rss", 0) - anon
                m.weights_pss += f.get("Pss", 0) - anon  # a private mapping's anonymous pages are its own
                files.add(path.removesuffix(" (deleted)"))
            elif path.startswith("/"):
                m.files_rss += f.get("Rss", 0) - anon
    m.weight_files = frozenset(files)
    return m


def checkpoint_bytes(home: Path, weight_files: frozenset[str]) -> tuple[Path, int]:
    """The served checkpoint (the folder of $HOME/checkpoints whose key names the mapped file) and its bytes."""
    names = {Path(p).stem for p in weight_files}
    for folder in sorted((home / "checkpoints").iterdir()):
        if folder.is_dir() and checkpoint_key(folder) in names:
            return folder, sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    raise SystemExit(f"no checkpoint under {home / 'checkpoints'} is the one mapped ({sorted(names)})")


def start(name: str, home: Path, serve_args: list[str], logs: Path) -> ServerProcess:
    port = free_port()
    cmd = [str(REPO / ".venv" / "bin" / "spark-edge"), "serve", "--port", str(port), *serve_args]
    env = {**os.environ, "SPARK_EDGE_HOME": str(home)}
    server = ServerProcess(cmd, f"http://127.0.0.1:{port}/health", logs / f"{name}.log", env).start()
    server.wait_ready(START_TIMEOUT_S)
    url = f"http://127.0.0.1:{port}"
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    if reply.status_code != 200:
        raise SystemExit(f"server {name} answered {reply.status_code}: {reply.text[:500]}")
    return server


def planned_kv_bytes(home: Path, serve_args: list[str]) -> int:
    """The KV cache bytes of the plan `serve` makes with these options (`spark-edge plan --json`)."""
    cmd = [str(REPO / ".venv" / "bin" / "spark-edge"), "plan", "--json", *serve_args]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "SPARK_EDGE_HOME": str(home)})
    if run.returncode != 0:
        raise SystemExit(f"spark-edge plan exited {run.returncode}: {run.stderr[-2000:]}")
    return int(json.loads(run.stdout)["kv_bytes"])


def mib(n: int) -> str:
    return f"{n / MiB:.0f}"


def report(what: str, a_alone: Memory, a: Memory, b: Memory, folder: Path, ckpt_bytes: int, kv: int) -> str:
    one_copy = a_alone.weights_pss
    summed = a.weights_pss + b.weights_pss
    mapped = sum(Path(p).stat().st_size for p in a_alone.weight_files)
    rows = [
        ("A alone", a_alone),
        ("A, with B running", a),
        ("B", b),
    ]
    lines = [
        "# Two servers of one checkpoint",
        "",
        f"Generated by `scripts/shared_weights.py` on **{host()}** (figures are this host's). Server: "
        f"`spark-edge serve`, {what}; checkpoint `{folder.name}`, {mib(ckpt_bytes)} MiB of safetensors; its "
        f"mapped weights (the kernels' layout, runtime fix 9) {mib(mapped)} MiB. Server A starts and answers, "
        "then server B on the same data folder; each process tree read from /proc/PID/smaps, in MiB.",
        "",
        "| tree | mapped weights Rss | mapped weights Pss | other files Rss | anonymous Rss |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {mib(m.weights_rss)} | {mib(m.weights_pss)} | {mib(m.files_rss)} | {mib(m.anon_rss)} |"
            for name, m in rows
        ),
        "",
        "| figure | measured | target |",
        "|---|---:|---:|",
        f"| the weights' Pss of A and B summed / A's alone (one copy) | {summed / one_copy:.3f} | <= 1.05 |",
        f"| B's anonymous Rss / A's (with B running) | {b.anon_rss / a.anon_rss:.3f} | B adds its own only |",
        f"| A's file-backed Rss / the checkpoint's bytes | {a_alone.file_rss / ckpt_bytes:.2f} | >= 0.8 |",
        f"| of which its mapped weights | {a_alone.weights_rss / ckpt_bytes:.2f} | |",
        f"| A's anonymous Rss over the plan's KV cache ({mib(kv)} MiB), MiB | {mib(a_alone.anon_rss - kv)} | "
        "<= 1331 (#35), <= 614 (#35 with #34), <= 600 (#34) |",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "shared-weights.md")
    parser.add_argument("--what", default="", help="what the options serve, said in the heading")
    parser.add_argument("serve_args", nargs="*")
    args = parser.parse_args()
    given = os.environ.get("SPARK_EDGE_HOME")
    with tempfile.TemporaryDirectory(prefix="spark-edge-shared-") as tmp:
        home, logs = Path(given or tmp), Path(tmp)
        kv = planned_kv_bytes(home, args.serve_args)
        first = start("a", home, args.serve_args, logs)
        try:
            a_alone = tree_memory(first.pid)
            if not a_alone.weight_files:
                raise SystemExit("server A maps no weights file: runtime fix 9 did not run (see its log)")
            second = start("b", home, args.serve_args, logs)
            try:
                a, b = tree_memory(first.pid), tree_memory(second.pid)
            finally:
                second.stop()
        finally:
            first.stop()
    if b.weight_files != a.weight_files:
        raise SystemExit(f"the servers map different files: {sorted(a.weight_files)} vs {sorted(b.weight_files)}")
    folder, ckpt_bytes = checkpoint_bytes(home, a_alone.weight_files)
    what = args.what or " ".join(args.serve_args) or "default options"
    text = report(what, a_alone, a, b, folder, ckpt_bytes, kv)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

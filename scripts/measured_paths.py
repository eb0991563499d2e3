"""`auto`'s evidence, from the bench's runs: src/spark_edge/probe/measured_paths.json.

For each host class and model shape, the newest run in docs/bench-runs/ (names lead with their date) that
measured two or more 4-bit weight paths side by side: each path's served decode (tg128, best pass) and, where
the run scored fidelity on real weights with a bf16 arm, its perplexity over bf16's; and the fidelity gate
that the newest run with llama-perplexity of Q4_K_M on that host class and shape gives (x1.06 where none has;
a run of the peer's perplexity alone need not measure the paths' speeds again). Only runs that carry
`isa` and `model_shape` (written by `spark-edge bench` since they existed) count; speeds are never compared
across runs.

    python scripts/measured_paths.py            # rewrite the table
    python scripts/measured_paths.py --check    # exit 1 if the table is not what the runs say

tests/test_measured_paths.py runs the check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spark_edge.probe.measured_paths import TABLE, fidelity_gate

RUNS = Path(__file__).resolve().parents[1] / "docs" / "bench-runs"
FOUR_BIT = ("w4a16", "w4a8")  # plain arms only: a variant (+...) or a layout (@...) is not what auto serves


def _perplexity_ratio(run: dict, arm: dict) -> float | None:
    bf16 = run["arms"].get("bf16", {}).get("perplexity")
    if run.get("synthetic") or not bf16 or not arm.get("perplexity"):
        return None
    return round(arm["perplexity"] / bf16, 4)


def _peer_ratios(runs: list[dict]) -> dict[tuple[str, str], float]:
    """The newest llama.cpp Q4_K_M perplexity ratio per host class and shape, from runs on real weights."""
    ratios = {}
    for run in runs:
        ratio = run.get("peer", {}).get("perplexity", {}).get("q4_k_m_ratio")
        if ratio is not None and not run.get("synthetic"):
            ratios[(run["isa"], run["model_shape"])] = ratio
    return ratios


def table_rows(runs: Path = RUNS) -> list[dict]:
    keyed = [json.loads(f.read_text()) | {"_file": f.name} for f in sorted(runs.glob("*.json"))]
    keyed = [run for run in keyed if "model_shape" in run]
    peer_ratios = _peer_ratios(keyed)
    newest: dict[tuple[str, str], dict] = {}
    for run in keyed:
        file_name = run["_file"]
        arms = {p: run["arms"][p] for p in FOUR_BIT if run["arms"].get(p, {}).get("tg128_tps")}
        if len(arms) < 2:
            continue
        paths = {
            name: {
                "tg128_tps": round(arm["tg128_tps"]["best"], 1),
                "perplexity_ratio": _perplexity_ratio(run, arm),
                "run": file_name,
            }
            for name, arm in arms.items()
        }
        key = (run["isa"], run["model_shape"])
        newest[key] = {
            "isa": run["isa"],
            "shape": run["model_shape"],
            "gate": fidelity_gate(None if run.get("synthetic") else peer_ratios.get(key)),
            "paths": paths,
        }
    return [newest[key] for key in sorted(newest)]


def rendered(runs: Path = RUNS) -> str:
    return json.dumps(table_rows(runs), indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    text = rendered()
    if args.check:
        if not TABLE.is_file() or TABLE.read_text() != text:
            print(f"{TABLE} is stale: run python scripts/measured_paths.py", file=sys.stderr)
            return 1
        return 0
    TABLE.write_text(text)
    print(f"{TABLE}: {len(table_rows())} host class and model shape rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

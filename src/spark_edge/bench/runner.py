"""Run several arms side by side: arm order rotates every pass, and the spread is reported.

The machine is shared and noisy, so only ratios measured in one run mean anything;
a single pass is labelled as such, and a ratio inside the spread is not a ranking.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from spark_edge.bench.fidelity import top1_agreement
from spark_edge.bench.report import peer_perplexity_line
from spark_edge.bench.server_arm import ArmResult, run_arm

if TYPE_CHECKING:
    from spark_edge.bench.peer_arms import Peer

MiB = 1 << 20
# (metric, better) -- "max" for rates, "min" for time and memory
METRICS = (
    ("tg128_tps", "max"),
    ("pp512_tps", "max"),
    ("load_peak_bytes", "min"),
    ("settled_bytes", "min"),
    ("ready_s", "min"),
    ("metrics_scrape_s", "min"),
)


def rotated(arms: list[str], pass_index: int) -> list[str]:
    k = pass_index % len(arms)
    return arms[k:] + arms[:k]


@dataclass(frozen=True)
class Arm:
    checkpoint: Path
    vocab: int
    serve_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    peer: Peer | None = None  # set: the arm is llama.cpp's, served from the GGUFs made of `checkpoint`


def _run_one(
    tag: str,
    arm: Arm,
    p: int,
    home: Path,
    log_dir: Path,
    reps: int,
    fidelity_windows: list[list[int]] | None,
    served: bool,
) -> ArmResult:
    log_path = log_dir / f"{tag}.log"
    if arm.peer is not None:
        from spark_edge.bench.peer_arms import run_peer_arm

        return run_peer_arm(tag, arm.peer, arm.vocab, log_path, reps, served, arm.env)
    return run_arm(
        tag,
        arm.checkpoint,
        arm.vocab,
        home,
        log_path,
        reps,
        arm.serve_args,
        arm.env,
        fidelity_windows=fidelity_windows if p == 0 else None,
        served=served,
    )


def run_passes(
    arms: dict[str, Arm],
    passes: int,
    home: Path,
    log_dir: Path,
    reps: int,
    log: Callable[[str], None],
    fidelity_windows: list[list[int]] | None = None,
    served: bool = False,
) -> dict[str, list[ArmResult]]:
    """Fidelity (deterministic) is scored on each arm's first pass only."""
    results: dict[str, list[ArmResult]] = {tag: [] for tag in arms}
    for p in range(passes):
        for tag in rotated(list(arms), p):
            arm = arms[tag]
            log(f"pass {p + 1}/{passes}: {tag}")
            try:
                r = _run_one(tag, arm, p, home, log_dir, reps, fidelity_windows, served)
            except Exception as exc:  # a failed arm is a result too: record it, keep going
                log(f"  {tag} failed: {exc} (log: {log_dir / f'{tag}.log'})")
                r = ArmResult(tag, 0, 0, 0, 0, 0, 0, "failed", errors=[str(exc)])
            else:
                log(
                    f"  ready {r.ready_s:.1f} s ({r.cache}), tg128 {r.tg128_tps:.1f} tok/s, "
                    f"pp512 {r.pp512_tps:.0f} tok/s, load peak {r.load_peak_bytes / MiB:.0f} MiB, "
                    f"settled {r.settled_bytes / MiB:.0f} MiB"
                )
                if r.served:
                    log("  streamed: " + served_line(r.served))
                for quant, figures in r.llama_bench.items():
                    log(f"  llama-bench {quant}: " + llama_bench_line(figures))
            results[tag].append(r)
    return results


def served_line(served: dict) -> str:
    levels = ", ".join(
        f"{c['streams']}x {c['aggregate_tps']:.1f} tok/s (ttft p50 {1000 * c['ttft_p50_s']:.0f} ms)"
        for c in served["concurrency"]
    )
    grounded = f", grounded tg128 {served['grounded_tg128_tps']:.1f}" if "grounded_tg128_tps" in served else ""
    return f"tg128 {served['tg128_tps']:.1f}{grounded} tok/s, pp512 {served['pp512_tps']:.0f} tok/s; aggregate {levels}"


def llama_bench_line(figures: dict) -> str:
    if "error" in figures:
        return f"failed: {figures['error']}"
    return (
        f"pp512 {figures['pp512_tps']:.1f} ±{figures['pp512_stddev_tps']:.1f} tok/s, "
        f"tg128 {figures['tg128_tps']:.1f} ±{figures['tg128_stddev_tps']:.1f} tok/s"
    )


def _best(values: list[float], better: str) -> float:
    return max(values) if better == "max" else min(values)


def _ratios(arm: dict, other: dict) -> dict:
    return {
        metric: arm[metric]["best"] / other[metric]["best"]
        for metric, _ in METRICS
        if metric in arm and metric in other and other[metric]["best"]
    }


def peer_summary(runs: list[ArmResult], tag: str) -> dict:
    """The peer's best figures over passes: llama-bench per GGUF, and llama-server streamed."""
    bench: dict = {}
    for r in runs:
        for quant, figures in r.llama_bench.items():
            kept = bench.get(quant)
            if kept is None or "error" in kept or ("error" not in figures and figures["tg128_tps"] > kept["tg128_tps"]):
                bench[quant] = figures
    streamed = [r.served for r in runs if r.served and not r.errors]
    return {
        "arm": tag,
        "llama_bench": bench,
        "streamed": max(streamed, key=lambda s: s["tg128_tps"]) if streamed else {},
    }


def summarize(results: dict[str, list[ArmResult]], baseline: str, peer: str | None = None) -> dict:
    """Best, median and spread per metric and arm; ratios against the baseline and against the peer's arm."""
    summary: dict = {"arms": {}, "baseline": baseline}
    for tag, runs in results.items():
        ok = [r for r in runs if not r.errors]
        arm: dict = {
            "passes": len(runs),
            "failed": len(runs) - len(ok),
            "runs": [{k: v for k, v in asdict(r).items() if k != "top1"} for r in runs],
        }
        scored = next((r for r in ok if r.top1), None)
        if scored:
            arm["perplexity"] = scored.perplexity
            base_scored = next((r for r in results[baseline] if r.top1), None)
            if base_scored:
                arm["top1_agreement"] = top1_agreement(base_scored, scored)
                arm["perplexity_ratio"] = scored.perplexity / base_scored.perplexity
        for metric, better in METRICS:
            values = [getattr(r, metric) for r in ok]
            if values:
                best = _best(values, better)
                spread = (max(values) - min(values)) / best if best else 0.0
                arm[metric] = {"best": best, "median": statistics.median(values), "spread": spread}
        warm = [r.ready_s for r in ok if r.cache == "warm"]
        cold = [r.ready_s for r in ok if r.cache == "cold"]
        if warm and cold:
            arm["warm_over_cold_ready"] = min(warm) / min(cold)
        summary["arms"][tag] = arm
    base = summary["arms"].get(baseline, {})
    for arm in summary["arms"].values():
        arm["vs_baseline"] = _ratios(arm, base)
    if peer is not None:
        summary["peer"] = peer_summary(results[peer], peer)
        for tag, arm in summary["arms"].items():
            if tag != peer:
                arm["vs_peer"] = _ratios(arm, summary["arms"][peer])
    return summary


def format_table(summary: dict) -> str:
    w = max(10, *(len(tag) for tag in summary["arms"]))  # the arm column fits the longest tag
    head = (
        f"{'arm':<{w}} {'tg128 tok/s':>12} {'pp512 tok/s':>12} {'load peak MiB':>14} {'settled MiB':>12} "
        f"{'peak/settled':>12} {'ready s':>8}   ratios vs {summary['baseline']} (tg, pp, peak)"
        + (f"; vs {summary['peer']['arm']}" if "peer" in summary else "")
    )
    lines = [head, "-" * len(head)]
    if forced := summary.get("forced_isa"):
        lines.insert(0, f"forced {forced}: every arm ran its {forced} kernels on {summary.get('host', 'this host')}")
    for tag, arm in summary["arms"].items():
        if "tg128_tps" not in arm:
            lines.append(f"{tag:<{w}} all {arm['passes']} passes failed")
            continue

        def cell(metric: str, scale: float = 1.0, fmt: str = ".1f") -> str:
            m = arm[metric]
            return f"{m['best'] / scale:{fmt}} ±{100 * m['spread']:.0f}%"

        ratio = arm["load_peak_bytes"]["best"] / max(arm["settled_bytes"]["best"], 1)
        vs = arm.get("vs_baseline", {})
        lines.append(
            f"{tag:<{w}} {cell('tg128_tps'):>12} {cell('pp512_tps', fmt='.0f'):>12} "
            f"{cell('load_peak_bytes', MiB, '.0f'):>14} {cell('settled_bytes', MiB, '.0f'):>12} {ratio:>12.2f} "
            f"{arm['ready_s']['best']:>8.1f}   "
            f"{vs.get('tg128_tps', 0):.2f}x {vs.get('pp512_tps', 0):.2f}x {vs.get('load_peak_bytes', 0):.2f}x"
            + (f"; {_triple(arm['vs_peer'])}" if arm.get("vs_peer") else "")
        )
    for tag, arm in summary["arms"].items():
        if "perplexity" in arm:
            lines.append(
                f"{tag:<{w}} perplexity {arm['perplexity']:.3f} (x{arm.get('perplexity_ratio', 1):.3f} vs "
                f"{summary['baseline']}), teacher-forced top-1 agreement {arm.get('top1_agreement', 1):.3f}"
            )
    lines.extend(_served_lines(summary))
    if "peer" in summary:
        lines.extend(
            f"{summary['peer']['arm']} llama-bench {quant}: {llama_bench_line(figures)}"
            for quant, figures in summary["peer"]["llama_bench"].items()
        )
        if "perplexity" in summary["peer"]:
            lines.append(f"{summary['peer']['arm']} {peer_perplexity_line(summary['peer']['perplexity'])}")
    passes = max(a["passes"] for a in summary["arms"].values())
    if passes < 2:
        lines.append("one pass only: not a result, a smoke run (spreads need two or more passes)")
    lines.append("± is (max - min) / best over passes; a ratio inside the spread is not a ranking")
    return "\n".join(lines)


def _triple(vs: dict) -> str:
    return " ".join(f"{vs.get(m, 0):.2f}x" for m in ("tg128_tps", "pp512_tps", "load_peak_bytes"))


def _peer_ratio(value: float, peer_value: float | None) -> str:
    return f" ({value / peer_value:.2f}x peer)" if peer_value else ""


def _grounded_ratio(served: dict, peer_served: dict) -> str:
    if not served.get("grounded_tg128_tps") or not peer_served.get("grounded_tg128_tps"):
        return ""
    return f", grounded tg128 {served['grounded_tg128_tps'] / peer_served['grounded_tg128_tps']:.2f}x"


def _served_lines(summary: dict) -> list[str]:
    peer = summary.get("peer", {})
    peer_streamed = peer.get("streamed", {})
    lines = []
    for tag, arm in summary["arms"].items():
        served = [r["served"] for r in arm["runs"] if r.get("served")]
        if served:
            best = max(served, key=lambda s: s["tg128_tps"])
            vs_peer = ""
            if peer_streamed and tag != peer.get("arm"):
                levels = {c["streams"]: c["aggregate_tps"] for c in peer_streamed["concurrency"]}
                vs_peer = (
                    f" (vs peer: tg128 {best['tg128_tps'] / peer_streamed['tg128_tps']:.2f}x"
                    + _grounded_ratio(best, peer_streamed)
                    + f", pp512 "
                    f"{best['pp512_tps'] / peer_streamed['pp512_tps']:.2f}x, aggregate "
                    + ", ".join(
                        f"{c['streams']}x {c['aggregate_tps'] / levels[c['streams']]:.2f}x"
                        for c in best["concurrency"]
                        if levels.get(c["streams"])
                    )
                    + ")"
                )
            lines.append(f"{tag} streamed {served_line(best)}{vs_peer}")
    # the offline engine runs in one process, as llama-bench does: compare it with llama-bench's served GGUF
    in_process = next(iter(peer.get("llama_bench", {}).values()), {})
    for path, off in summary.get("offline", {}).items():
        if "error" in off:
            lines.append(f"offline {path}: failed: {off['error']}")
            continue
        lines.append(
            f"offline {path} (vLLM LLM, one process): tg128 {off['tg128_tps']:.1f} tok/s"
            f"{_peer_ratio(off['tg128_tps'], in_process.get('tg128_tps'))}, {off['batched_seqs']} sequences "
            f"{off['batched_tg128_tps']:.1f} tok/s together, pp512 {off['pp512_tps']:.0f} "
            f"tok/s{_peer_ratio(off['pp512_tps'], in_process.get('pp512_tps'))}; decode step, top ops "
            "by self time:"
        )
        lines.extend(
            f"    {op['self_ms_per_step']:7.3f} ms/step {op['calls_per_step']:6.1f} calls  {op['op'][:60]}"
            for op in off["profile_top_ops"][:10]
        )
    return lines


def write_json(summary: dict, path: Path) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")

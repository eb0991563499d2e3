"""What the bench measured of each 4-bit weight path, per host class and model shape: `auto`'s evidence where a
host runs more than one 4-bit path at its own kernels (an AMX host: w4a16, and w4a8 on vLLM's AMX kernel).

Which path decodes faster depends on the model, not only on the host (Xeon AMX: w4a8 is the faster on a 1.7B
shape, w4a16 on the default model), and so does fidelity: int8 activations cost the default model a perplexity
of x1.571 bf16's. So `auto` takes, among the paths measured on this host class and model shape, the fastest
whose held-out perplexity is within the fidelity gate (random weights have no fidelity to keep: speed alone
decides for them); where none is within it, the most faithful; where nothing was measured, the caller's default.

The gate (issue #36): x1.06 of bf16's perplexity, or llama.cpp Q4_K_M's own ratio over its BF16 on the same
text plus 0.01, whichever is looser; the second is what a source whose weights were already 4-bit (the default
model: Q4_1) allows. The bench measures that ratio with llama-perplexity in the same run.

measured_paths.json beside this module is generated from docs/bench-runs/ by scripts/measured_paths.py (the
newest run that measured each path with the fields `isa`, `model_shape`, `synthetic`); `--check` in the suite.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from spark_edge.checkpoints.synthetic_marker import synthetic_origin

TABLE = Path(__file__).with_name("measured_paths.json")
FIDELITY_GATE = 1.06  # perplexity on held-out text, over bf16's (issue #36's gate)
PEER_MARGIN = 0.01  # over llama.cpp Q4_K_M's own ratio, where that is looser


def fidelity_gate(q4_k_m_ratio: float | None) -> float:
    """The gate for one model: x1.06, or Q4_K_M's measured ratio + 0.01 where that is looser."""
    return FIDELITY_GATE if q4_k_m_ratio is None else round(max(FIDELITY_GATE, q4_k_m_ratio + PEER_MARGIN), 4)


def shape_key(config: dict[str, Any]) -> str:
    """The geometry that decides a path's speed, as one string: architecture, layers, widths, heads, vocabulary."""
    heads = int(config["num_attention_heads"])
    arch = (config.get("architectures") or ["?"])[0]
    return (
        f"{arch} l{config['num_hidden_layers']} h{config['hidden_size']} i{config['intermediate_size']} "
        f"q{heads} kv{config.get('num_key_value_heads') or heads} v{config['vocab_size']}"
    )


@dataclass(frozen=True)
class PathMeasurement:
    tg128_tps: float  # served single-stream decode, best pass
    perplexity_ratio: float | None  # over bf16's on the same text; None: not scored (random weights, no bf16 arm)
    run: str  # the bench JSON in docs/bench-runs/

    def faithful(self, gate: float) -> bool:
        return self.perplexity_ratio is not None and self.perplexity_ratio <= gate


@dataclass(frozen=True)
class Evidence:
    isa: str
    shape: str
    paths: dict[str, PathMeasurement]
    synthetic_model: bool  # the model asked for has random weights: its fidelity does not decide
    gate: float = FIDELITY_GATE  # fidelity_gate() of the run that measured the paths

    def pick(self, candidates: tuple[str, ...]) -> tuple[str, str] | None:
        """(path, why) among `candidates`, or None unless every candidate was measured."""
        if not all(c in self.paths for c in candidates):
            return None
        measured = {c: self.paths[c] for c in candidates}
        if self.synthetic_model:
            kept = list(measured)
        else:
            kept = [c for c, m in measured.items() if m.faithful(self.gate)]
        if not kept:
            scored = [c for c, m in measured.items() if m.perplexity_ratio is not None]
            if not scored:
                return None  # fidelity unknown for a real model: not ours to guess
            best = min(scored, key=lambda c: measured[c].perplexity_ratio or 0.0)
            return best, f"none within x{self.gate} of bf16's perplexity; the most faithful: {self._figures()}"
        fastest = max(kept, key=lambda c: measured[c].tg128_tps)
        dropped = sorted(set(measured) - set(kept))
        why = f"the fastest{' of those within the fidelity gate' if dropped else ''}: {self._figures()}"
        if self.synthetic_model:
            why += "; random weights: fidelity does not decide"
        return fastest, why

    def gate_problem(self, path: str) -> str | None:
        """Why `path` fails the fidelity gate on this model, if it was measured to."""
        m = self.paths.get(path)
        if self.synthetic_model or m is None or m.perplexity_ratio is None or m.faithful(self.gate):
            return None
        return (
            f"{path}'s perplexity on this model shape is x{m.perplexity_ratio:.3f} bf16's, outside the fidelity "
            f"gate (x{self.gate}; docs/bench-runs/{m.run})"
        )

    def _figures(self) -> str:
        parts = []
        for name, m in sorted(self.paths.items(), key=lambda item: -item[1].tg128_tps):
            ppl = f", perplexity x{m.perplexity_ratio:.3f}" if m.perplexity_ratio is not None else ""
            parts.append(f"{name} {m.tg128_tps:.1f} tok/s{ppl}")
        runs = ", ".join(sorted({m.run for m in self.paths.values()}))
        return f"measured on a {self.isa} host for this model shape ({'; '.join(parts)}; docs/bench-runs/{runs})"


@cache
def _table() -> dict[tuple[str, str], tuple[float, dict[str, PathMeasurement]]]:
    rows = json.loads(TABLE.read_text()) if TABLE.is_file() else []
    return {(r["isa"], r["shape"]): (r["gate"], {p: PathMeasurement(**m) for p, m in r["paths"].items()}) for r in rows}


def evidence(isa: str, config: dict[str, Any]) -> Evidence | None:
    """What was measured on this host class for this model's shape (a model whose config cannot be read: None)."""
    try:
        shape = shape_key(config)
    except (KeyError, TypeError, ValueError):
        return None
    row = _table().get((isa, shape))
    if row is None:
        return None
    gate, paths = row
    return Evidence(isa, shape, paths, synthetic_origin(config) is not None, gate)

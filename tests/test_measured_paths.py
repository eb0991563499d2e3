"""`auto` on a host that runs two 4-bit paths picks by measurement (issue #36): the fastest within the fidelity
gate on this host class and model shape, the most faithful when none is, w4a16 when nothing was measured; the
table is what docs/bench-runs/ say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from measured_paths import main as measured_paths
from measured_paths import table_rows

from spark_edge.checkpoints.synthetic_marker import SYNTHETIC_KEY
from spark_edge.probe import probe_device, select_weight_path
from spark_edge.probe.measured_paths import Evidence, PathMeasurement, evidence, fidelity_gate, shape_key

FIXTURES = Path(__file__).parent / "fixtures" / "probe"
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


def _evidence(
    w4a16: tuple[float, float | None], w4a8: tuple[float, float | None], synthetic: bool, gate: float = 1.06
) -> Evidence:
    paths = {
        "w4a16": PathMeasurement(w4a16[0], w4a16[1], "run.json"),
        "w4a8": PathMeasurement(w4a8[0], w4a8[1], "run.json"),
    }
    return Evidence("amx", shape_key(CONFIG), paths, synthetic, gate)


def test_the_gate_is_x1_06_or_q4_k_m_plus_0_01_whichever_is_looser() -> None:
    assert fidelity_gate(None) == 1.06
    assert fidelity_gate(1.02) == 1.06  # a high-precision source: Q4_K_M is close, x1.06 holds
    assert fidelity_gate(1.063) == 1.073  # the default model: its Q4_1 grid puts x1.06 out of reach
    faithful_at_its_gate = _evidence((95.9, 1.061), (120.0, 1.571), synthetic=False, gate=1.073)
    assert faithful_at_its_gate.pick(("w4a16", "w4a8"))[0] == "w4a16"
    assert "the fastest of those within" in faithful_at_its_gate.pick(("w4a16", "w4a8"))[1]


@pytest.mark.parametrize(
    ("w4a16", "w4a8", "synthetic", "picked"),
    [
        ((95.9, 1.04), (80.6, 1.05), False, "w4a16"),  # both within the gate: the faster
        ((95.9, 1.04), (120.0, 1.571), False, "w4a16"),  # the faster fails the gate
        ((14.6, 1.04), (17.0, 1.05), False, "w4a8"),
        ((95.9, 1.061), (80.6, 1.571), False, "w4a16"),  # none within: the most faithful
        ((14.6, None), (17.0, None), True, "w4a8"),  # random weights: speed alone
        ((14.6, 1.04), (17.0, 1.571), True, "w4a8"),  # a random-weight model of a measured real shape
    ],
)
def test_the_fastest_path_within_the_gate(w4a16, w4a8, synthetic: bool, picked: str) -> None:
    found = _evidence(w4a16, w4a8, synthetic).pick(("w4a16", "w4a8"))
    assert found is not None and found[0] == picked, found
    assert "tok/s" in found[1] and "docs/bench-runs/run.json" in found[1]


def test_unknown_fidelity_of_a_real_model_or_an_unmeasured_path_decides_nothing() -> None:
    assert _evidence((14.6, None), (17.0, None), synthetic=False).pick(("w4a16", "w4a8")) is None
    assert _evidence((14.6, 1.0), (17.0, 1.0), synthetic=False).pick(("w4a16", "bf16")) is None


def _spr(tmp_path: Path):
    import shutil

    root = tmp_path / "sapphire_rapids"
    shutil.copytree(FIXTURES / "sapphire_rapids", root, symlinks=True)
    return probe_device(root, machine="x86_64")


def test_auto_on_amx_follows_the_measurement_and_priority_fidelity_does_not_ask(tmp_path: Path) -> None:
    spr = _spr(tmp_path)
    faster_w4a8 = _evidence((14.6, None), (17.0, None), synthetic=True)
    asked: list[str] = []

    def measured(isa: str) -> Evidence:
        asked.append(isa)
        return faster_w4a8

    choice = select_weight_path(spr, measured=measured)
    assert choice.name == "w4a8" and asked == ["amx"]
    assert "w4a8 17.0 tok/s" in choice.reason and "random weights" in choice.reason
    assert select_weight_path(spr, priority="fidelity", measured=measured).name == "w4a16"
    assert asked == ["amx"]  # a fidelity priority reads no measurement


def test_an_explicit_path_is_served_with_a_note_when_it_failed_the_gate(tmp_path: Path) -> None:
    spr = _spr(tmp_path)
    failed = _evidence((95.9, 1.061), (80.6, 1.571), synthetic=False, gate=1.073)
    choice = select_weight_path(spr, explicit="w4a8", measured=lambda isa: failed)
    assert choice.name == "w4a8"
    assert "x1.571 bf16's, outside the fidelity gate (x1.073" in choice.notes[0]
    assert select_weight_path(spr, explicit="w4a16", measured=lambda isa: failed).notes == ()


def _run(arms: dict, synthetic: bool = False, shape: str = "S", isa: str = "amx", peer_ratio: float = 0) -> dict:
    run = {"isa": isa, "model_shape": shape, "synthetic": synthetic, "arms": arms}
    if peer_ratio:
        run["peer"] = {"perplexity": {"Q4_K_M": 26.6 * peer_ratio, "BF16": 26.6, "q4_k_m_ratio": peer_ratio}}
    return run


def _arm(tg128: float, perplexity: float = 0.0) -> dict:
    return {"tg128_tps": {"best": tg128, "median": tg128, "spread": 0.0}, "perplexity": perplexity}


def test_the_table_keeps_the_newest_side_by_side_run_per_host_class_and_shape(tmp_path: Path) -> None:
    runs = {
        "2026-12-01-a.json": _run({"bf16": _arm(40, 25.0), "w4a16": _arm(90, 26.5), "w4a8": _arm(80, 39.3)}),
        "2026-12-02-b.json": _run(
            {"bf16": _arm(41, 25.0), "w4a16": _arm(95, 26.5), "w4a8": _arm(81, 39.3)}, peer_ratio=1.063
        ),
        "2026-12-03-one-path.json": _run({"w4a16": _arm(99, 26.5)}),  # nothing side by side: ignored
        "2026-12-03-variant.json": _run({"w4a16": _arm(99), "w4a16+fp8kv": _arm(98)}),  # a variant: ignored
        "2026-12-03-synthetic.json": _run(
            {"w4a16": _arm(14.6, 4e4), "w4a8": _arm(17.0, 4e4)}, True, "B", peer_ratio=1.2
        ),
        "2026-12-04-old.json": {"arms": {"w4a16": _arm(1), "w4a8": _arm(2)}},  # no isa or shape: ignored
        "2026-12-05-peer-only.json": _run({"bf16": _arm(40, 25.0)}, peer_ratio=1.044),  # the gate, not speeds
    }
    for name, run in runs.items():
        (tmp_path / name).write_text(json.dumps(run))
    rows = {row["shape"]: row for row in table_rows(tmp_path)}
    assert rows["S"]["paths"]["w4a16"] == {"tg128_tps": 95.0, "perplexity_ratio": 1.06, "run": "2026-12-02-b.json"}
    assert rows["S"]["paths"]["w4a8"]["perplexity_ratio"] == 1.572
    synthetic = {"tg128_tps": 17.0, "perplexity_ratio": None, "run": "2026-12-03-synthetic.json"}
    assert rows["B"]["paths"]["w4a8"] == synthetic
    assert rows["S"]["gate"] == 1.06  # the newest llama-perplexity ratio (+ 0.01 = 1.054), from a run of its own
    assert rows["B"]["gate"] == 1.06  # random weights: their peer ratio says nothing


def test_the_shipped_table_is_what_the_runs_say_and_the_lookup_reads_it() -> None:
    assert measured_paths(["--check"]) == 0
    for row in json.loads((Path(__file__).parents[1] / "src/spark_edge/probe/measured_paths.json").read_text()):
        assert row["paths"], row
    assert evidence("no-such-class", CONFIG) is None
    assert evidence("amx", {"hidden_size": 1}) is None  # an unreadable config: no evidence, not a crash
    marked = evidence("amx", {**CONFIG, SYNTHETIC_KEY: {"like": "x", "seed": 1}})
    assert marked is None or marked.synthetic_model


def test_each_image_bakes_what_auto_picks_for_the_default_model_on_its_host_class() -> None:
    """The images carry the default model on one weight path: where the bench measured the paths apart for that
    model on an image's host class, the image's path is the one `auto` picks there."""
    from spark_edge import registry
    from spark_edge.checkpoints.sources import open_source
    from spark_edge.probe.weight_path_choice import AMX_CANDIDATES

    config = open_source(None).hf_config()
    for image in registry.IMAGES.values():
        found = evidence(image.isa, config)
        picked = found.pick(AMX_CANDIDATES) if found else None
        if picked:
            assert image.weight_path == picked[0], (image.tag, picked)

"""`spark-edge synth`: real geometries with random weights, deterministic, written tensor by tensor."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from spark_edge import exit_codes
from spark_edge.checkpoints import synth
from spark_edge.checkpoints.command import SYNTH_PRESETS
from spark_edge.checkpoints.synthetic_marker import synthetic_origin
from spark_edge.cli import main
from spark_edge.planning.memory_plan import int8_head_copies

# published parameter counts (embedding counted once when tied)
PARAMS = {
    "smollm2-1.7b": 1.71e9,
    "llama-3.2-1b": 1.24e9,
    "qwen2.5-1.5b": 1.54e9,
    "qwen3-1.7b": 1.72e9,
    "gemma-3-1b": 1.0e9,
    "phi-3-mini": 3.82e9,
    "spark-x2.5-1.7b": 1.7e9,
}


def test_the_command_offers_every_preset() -> None:
    assert set(SYNTH_PRESETS) == set(synth.PRESETS) == set(PARAMS)


@pytest.mark.parametrize("name", sorted(synth.PRESETS))
def test_geometry_names_and_size_of_each_preset(name: str) -> None:
    preset = synth.PRESETS[name]
    specs = synth.tensor_specs(preset)
    params = sum(math.prod(s.shape) for s in specs)
    assert abs(params - PARAMS[name]) / PARAMS[name] < 0.06, params
    names = {s.name for s in specs}
    assert len(names) == len(specs)
    last = f"model.layers.{preset.layers - 1}."
    assert any(n.startswith(last) for n in names) and not any(
        n.startswith(f"model.layers.{preset.layers}.") for n in names
    )
    assert ("lm_head.weight" in names) == (not preset.tied)
    assert any(n.endswith("q_proj.bias") for n in names) == preset.qkv_bias
    config = synth.hf_config(name, preset, 7, 1, 2)
    assert config["num_hidden_layers"] == preset.layers and config["vocab_size"] == preset.vocab
    assert synthetic_origin(config) == f"random weights shaped like {name} (seed 7)"


def test_weights_are_deterministic_by_seed_and_name() -> None:
    spec = synth.TensorSpec(
        "model.layers.0.mlp.down_proj.weight", torch.bfloat16, (synth.BLOCK_ELEMENTS // 900 + 5, 900)
    )
    a, b = synth.random_tensor(spec, 3), synth.random_tensor(spec, 3)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a, synth.random_tensor(spec, 4))
    assert abs(a.float().std().item() - 1 / math.sqrt(900)) < 1e-3


def test_a_1_7b_checkpoint_is_written_in_under_1_gib(tmp_path: Path) -> None:
    """Streamed: weights a block at a time, the tokenizer converted after them with no second GGUF reader held.
    Peak RSS of the writing process, torch included, in an environment of its own (the suite's processes leave
    variables behind): 673 MiB on the AMD EPYC Zen 3 host, 684 MiB on an AMD EPYC Zen 4, most of it the GGUF
    vocabulary's conversion. The peak is VmHWM, the high-water mark of the process's own memory: ru_maxrss
    is not, since Linux carries the parent's high-water mark into it across vfork + exec (1545 MiB here
    inside the full run, where pytest itself had grown that large)."""
    out = tmp_path / "smollm2-1.7b"
    code = (
        "import sys; from pathlib import Path; from spark_edge.checkpoints.synth import write_synthetic; "
        "write_synthetic('smollm2-1.7b', Path(sys.argv[1]), 0); "
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
    )
    env = {
        key: os.environ[key] for key in ("PATH", "HOME", "PYTHONPATH", "SPARK_EDGE_HOME", "TMPDIR") if key in os.environ
    }
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**env, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak_mib = int(done.stdout.split()[-1]) / 1024
    assert peak_mib < 1024, peak_mib
    config = json.loads((out / "config.json").read_text())
    assert config["spark_edge_synthetic"] == {"like": "smollm2-1.7b", "seed": 0}
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert weights > 2 * 1.7e9  # bf16
    assert (out / "tokenizer.json").is_file()
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).hidden_size == 2048


def test_synth_refuses_a_folder_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("data")
    result = CliRunner().invoke(main, ["synth", "--like", "llama-3.2-1b", "--out", str(tmp_path)])
    assert result.exit_code == exit_codes.USAGE and "not empty" in result.output
    assert (tmp_path / "keep.txt").read_text() == "data"


def test_synth_names_the_presets_on_a_wrong_one(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["synth", "--like", "gpt-5", "--out", str(tmp_path / "x")])
    assert result.exit_code == exit_codes.USAGE and "smollm2-1.7b" in result.output


@pytest.mark.parametrize("name", sorted(synth.PRESETS))
def test_plan_sizes_each_preset_from_its_config(name: str, tmp_path: Path) -> None:
    """What synth is for: `spark-edge plan --model DIR` sizes a box for the model before its weights exist."""
    (tmp_path / "config.json").write_text(json.dumps(synth.hf_config(name, synth.PRESETS[name], 0, 1, 2)))
    result = CliRunner().invoke(
        main, ["plan", "--model", str(tmp_path), "--weight-path", "w4a16", "--memory-limit", str(8 << 30), "--json"]
    )
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    params = sum(math.prod(s.shape) for s in synth.tensor_specs(synth.PRESETS[name]))
    # the linears at about 4.5-5 bits a weight, the vocabulary table at 8 (and, on VNNI hosts without AMX,
    # oneDNN's copy of it)
    config = synth.hf_config(name, synth.PRESETS[name], 0, 1, 2)
    table = config["vocab_size"] * config["hidden_size"]
    held = plan["weights_bytes"] - int8_head_copies() * table
    assert 0.45 * (params - table) + table < held < 0.8 * (params - table) + table * 1.01
    assert plan["fits"]


def test_the_writer_takes_a_tensor_a_block_of_rows_at_a_time(tmp_path: Path) -> None:
    """Blocks are written as they come and must add up to the planned shape; a short or misshapen block
    sequence is refused, naming the tensor."""
    from safetensors.torch import load_file

    from spark_edge.checkpoints.safetensors_stream import RowChunks, TensorSpec, write_safetensors

    spec = TensorSpec("w", torch.bfloat16, (5, 3))
    whole = torch.arange(15, dtype=torch.float32).view(5, 3).to(torch.bfloat16)
    write_safetensors(tmp_path, [spec], [("w", RowChunks(spec.dtype, spec.shape, iter([whole[:2], whole[2:]])))])
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], whole)
    (tmp_path / "bad").mkdir()
    for blocks, message in (
        ([whole[:2]], "hold 2 rows"),
        ([whole[:, :2]], "does not fit"),
        ([whole, whole[:1]], "hold 6 rows"),
    ):
        with pytest.raises(ValueError, match=message):
            write_safetensors(tmp_path / "bad", [spec], [("w", RowChunks(spec.dtype, spec.shape, iter(blocks)))])

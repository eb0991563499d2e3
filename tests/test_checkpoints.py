"""The GGUF -> bf16 Hugging Face converter, its manifest and its refusals."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize
from safetensors import safe_open

from spark_edge.checkpoints.default_model import default_gguf
from spark_edge.checkpoints.gguf_source import GGUFSource
from spark_edge.checkpoints.manifest import MANIFEST_NAME, verify_checkpoint
from spark_edge.errors import CheckpointError
from spark_edge.exit_codes import CHECKPOINT
from spark_edge.weight_paths.builder import build_checkpoint

from conftest import flip_middle_byte


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", framework="pt") as st:
        return {name: st.get_tensor(name) for name in st.keys()}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark_edge.cli", *args], capture_output=True, text=True)


# -- the default model's conversion -----------------------------------------------------------


def test_tensor_names_shapes_dtypes_match_gguf(bf16_checkpoint: Path) -> None:
    reader = GGUFReader(default_gguf())
    tensors = _tensors(bf16_checkpoint)
    config = json.loads((bf16_checkpoint / "config.json").read_text())
    assert len(tensors) == len(reader.tensors)
    assert config["num_hidden_layers"] == int(reader.fields["llama.block_count"].contents())
    assert config["hidden_size"] == int(reader.fields["llama.embedding_length"].contents())
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in tensors
    by_gguf = GGUFSource(default_gguf()).gguf_tensor_info()
    for hf_name, (gguf_name, _) in by_gguf.items():
        gguf_tensor = next(t for t in reader.tensors if t.name == gguf_name)
        # ggml lists dimensions innermost first
        assert tuple(tensors[hf_name].shape) == tuple(int(d) for d in reversed(gguf_tensor.shape.tolist()))
        assert tensors[hf_name].dtype == torch.bfloat16


def test_values_are_the_dequantized_gguf_values(bf16_checkpoint: Path) -> None:
    reader = GGUFReader(default_gguf())
    tensors = _tensors(bf16_checkpoint)
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
    ]:
        t = by_name[gguf_name]
        expected = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert torch.equal(tensors[hf_name], expected.reshape(tensors[hf_name].shape).to(torch.bfloat16))


def test_q_and_k_rows_are_unpermuted_back_to_hf_order(bf16_checkpoint: Path) -> None:
    # llama.cpp reorders each head's rows as interleaved rotary pairs; HF keeps the two halves apart.
    reader = GGUFReader(default_gguf())
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    raw = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).to(torch.bfloat16)
    hf = _tensors(bf16_checkpoint)["model.layers.0.self_attn.k_proj.weight"]
    half = 32  # head_dim 64
    # within each head, HF row r is GGUF row 2r and HF row half + r is GGUF row 2r + 1
    for head in (0, 2):
        base = head * 2 * half
        for r in (0, 5, 31):
            assert torch.equal(hf[base + r], raw[base + 2 * r])
            assert torch.equal(hf[base + half + r], raw[base + 2 * r + 1])
    assert not torch.equal(hf, raw)


def test_tokenizer_round_trip_and_vocabulary(bf16_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(bf16_checkpoint))
    reader = GGUFReader(default_gguf())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = [bytes(tokens.parts[i]).decode("utf-8") for i in tokens.data]
    assert len(tok) == len(vocab)
    for token_id in (0, 1, 2, 100, 504, 4649, len(vocab) - 1):
        assert tok.convert_ids_to_tokens(token_id) == vocab[token_id]
    for text in ["The capital of France is", "héllo wörld — 12345 日本語 ", "<|im_start|>user\nHi<|im_end|>"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    # llama.cpp's "smollm" pre-tokenizer splits every digit on its own
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    bos = int(reader.fields["tokenizer.ggml.bos_token_id"].contents())
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos)
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False).startswith("<|im_start|>")


# -- manifest, idempotence, atomicity ---------------------------------------------------------


def test_manifest_lists_every_file_and_its_source(bf16_checkpoint: Path) -> None:
    manifest = json.loads((bf16_checkpoint / MANIFEST_NAME).read_text())
    files = {p.name for p in bf16_checkpoint.iterdir()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == files
    assert manifest["inputs"]["weight_path"] == "bf16"
    assert manifest["inputs"]["source"]["kind"] == "gguf"
    assert len(manifest["inputs"]["source"]["sha256"]) == 64
    assert manifest["inputs"]["tool"]["name"] == "spark-edge"
    verify_checkpoint(bf16_checkpoint)


def test_second_build_is_a_no_op(bf16_checkpoint: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in bf16_checkpoint.iterdir()}
    result = build_checkpoint(None, "bf16", bf16_checkpoint)
    assert result.built is False
    assert {p.name: p.stat().st_mtime_ns for p in bf16_checkpoint.iterdir()} == before


def test_manifest_catches_a_flipped_byte(checkpoint_copy: Path) -> None:
    flip_middle_byte(checkpoint_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(checkpoint_copy)


def test_manifest_catches_truncation(checkpoint_copy: Path) -> None:
    weights = checkpoint_copy / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        verify_checkpoint(checkpoint_copy, full=False)


def test_corrupt_build_is_rebuilt(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "tokenizer.json").write_text("{}")
    messages: list[str] = []
    result = build_checkpoint(None, "bf16", checkpoint_copy, log=messages.append)
    assert result.built is True
    assert any("rebuilding" in m and "corrupt" in m for m in messages)
    verify_checkpoint(checkpoint_copy)
    assert sorted(p.name for p in checkpoint_copy.parent.iterdir() if p.name.startswith(".copy.") and p.is_dir()) == []


def test_foreign_folder_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to overwrite"):
        build_checkpoint(None, "bf16", out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_hf_folder_as_source_reproduces_the_weights(bf16_checkpoint: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain-hf"
    shutil.copytree(bf16_checkpoint, plain, ignore=shutil.ignore_patterns(MANIFEST_NAME))
    rebuilt = build_checkpoint(plain, "bf16", tmp_path / "rebuilt").out
    original, again = _tensors(bf16_checkpoint), _tensors(rebuilt)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)
    assert json.loads((rebuilt / MANIFEST_NAME).read_text())["inputs"]["source"]["kind"] == "hf"


# -- bad inputs: clear error, non-zero exit, no partial output ---------------------------------


def _write_gguf(path: Path, arch: str) -> None:
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _truncated_copy(tmp_path: Path) -> Path:
    path = tmp_path / "truncated.gguf"
    with open(default_gguf(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(default_gguf().stat().st_size // 2))
    return path


def _not_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a GGUF" * 10)
    return path


def _other_arch(tmp_path: Path) -> Path:
    path = tmp_path / "falcon.gguf"
    _write_gguf(path, "falcon")
    return path


@pytest.mark.parametrize(
    "make_source, message",
    [
        (lambda tmp: tmp / "missing.gguf", "no such file"),
        (_truncated_copy, "truncated|unreadable"),
        (_not_gguf, "not a GGUF file"),
        (_other_arch, "unsupported architecture 'falcon'"),
        (lambda tmp: tmp, "no config.json"),
    ],
    ids=["missing", "truncated", "not-gguf", "unsupported-arch", "folder-without-config"],
)
def test_bad_input_fails_clearly_without_output(tmp_path: Path, make_source, message: str) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    source = make_source(src_dir)
    out = tmp_path / "out"
    result = _cli("build", "--weight-path", "bf16", "--model", str(source), "--out", str(out))
    assert result.returncode == CHECKPOINT, result.stderr
    assert "spark-edge: error:" in result.stderr and "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr
    assert not out.exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.") and p.is_dir()] == []


def test_a_model_transformers_does_not_build_declares_its_tensor_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generic code names no model: a declared layout alone decides the roles (Spark-X2.5's is one)."""
    from spark_edge.checkpoints import architecture
    from spark_edge.models.declared_layout import DeclaredLayout

    toy = DeclaredLayout("ToyForCausalLM", "toy", "model.tok.weight", "lm_head.weight", (".mix.weight",), (".gate.w",))
    monkeypatch.setattr(architecture, "DECLARED_LAYOUTS", (toy,))
    arch = architecture.structure({"architectures": ["ToyForCausalLM"], "tie_word_embeddings": True})
    assert arch.role("model.tok.weight", (10, 4)) is architecture.Role.EMBEDDING
    assert arch.role("lm_head.weight", (10, 4)) is architecture.Role.TIED_HEAD
    assert arch.role("model.layers.0.mix.weight", (4, 4)) is architecture.Role.LINEAR
    assert arch.role("model.layers.0.gate.w", (2, 4)) is architecture.Role.FULL_PRECISION
    assert arch.role("model.layers.0.norm.weight", (4,)) is architecture.Role.VECTOR
    with pytest.raises(CheckpointError, match="refusing to guess"):
        arch.role("model.layers.0.other.weight", (4, 4))

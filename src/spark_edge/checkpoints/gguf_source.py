"""A GGUF file as a checkpoint source: HF config, HF tensor names, dequantized tensors.

Tensors are dequantized one at a time from the memory-mapped file, so a 1.7 B model
never has two full copies in memory.  Only the Llama architecture is mapped for now;
anything else is refused by name before a byte is written.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from spark_edge.checkpoints.errors import CheckpointError
from spark_edge.checkpoints.fingerprint import file_sha256
from spark_edge.checkpoints.safetensors_stream import TensorSpec

_MAGIC = b"GGUF"

# GGUF tensor name -> HF Llama tensor name ({i} is the layer index)
_LLAMA_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")

# llama.cpp pre-tokenizers that split every digit on its own (its "\p{N}" rule);
# transformers' GGUF tokenizer conversion leaves that step out.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}

SUPPORTED_ARCHITECTURES = ("llama",)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _LLAMA_NAMES:
        return _LLAMA_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m:
        template = _LLAMA_NAMES.get(f"blk.{{i}}.{m.group(2)}")
        if template:
            return template.format(i=m.group(1))
    return None


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (interleaved rotary pairs -> HF halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        self._reader = self._open(self.path)
        self._meta = {k: self._field(k) for k in self._reader.fields if not k.startswith("tokenizer.ggml.")}
        arch = self._meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        self._arch = arch
        self._tensors = self._map_tensors()
        self._config = self._build_config()

    # -- opening and validation ---------------------------------------------------------
    @staticmethod
    def _open(path: Path) -> Any:
        if not path.is_file():
            raise CheckpointError(f"{path}: no such file")
        with open(path, "rb") as f:
            if f.read(4) != _MAGIC:
                raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
        from gguf import GGUFReader

        try:
            reader = GGUFReader(path)
        except Exception as exc:  # the reader raises bare ValueError/IndexError on damage
            raise CheckpointError(f"{path}: unreadable GGUF ({type(exc).__name__}: {exc})") from exc
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise CheckpointError(f"{path}: truncated (tensor {t.name} runs past the end of the file)")
        return reader

    def _field(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        return None if field is None else field.contents()

    def _map_tensors(self) -> dict[str, Any]:
        mapped: dict[str, Any] = {}
        for t in self._reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} has no Hugging Face {self._arch} equivalent")
            mapped[name] = t
        if "model.embed_tokens.weight" not in mapped:
            raise CheckpointError(f"{self.path}: no token embedding (token_embd.weight)")
        return mapped

    # -- config -------------------------------------------------------------------------
    def _build_config(self) -> dict[str, Any]:
        a = self._arch
        m = self._meta

        def need(key: str) -> Any:
            value = m.get(f"{a}.{key}")
            if value is None:
                raise CheckpointError(f"{self.path}: metadata {a}.{key} is missing")
            return value

        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        n_vocab = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = int(m.get(f"{a}.vocab_size") or (len(n_vocab.data) if n_vocab else 0))
        embd_rows = int(self._tensors["model.embed_tokens.weight"].shape[1])
        if vocab != embd_rows:
            raise CheckpointError(f"{self.path}: vocab size {vocab} does not match the embedding's {embd_rows} rows")
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(m.get(f"{a}.attention.head_count_kv") or heads),
            "head_dim": int(m.get(f"{a}.rope.dimension_count") or hidden // heads),
            "max_position_embeddings": int(need("context_length")),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(m.get(f"{a}.rope.freq_base") or 10000.0),
            "vocab_size": vocab,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "torch_dtype": "bfloat16",
        }
        for key, tok_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
            value = self._field(f"tokenizer.ggml.{tok_key}_token_id")
            if value is not None:
                config[key] = int(value)
        if m.get(f"{a}.rope.scaling.type") not in (None, "none"):
            raise CheckpointError(f"{self.path}: RoPE scaling {m.get(f'{a}.rope.scaling.type')!r} is not supported yet")
        return config

    def hf_config(self) -> dict[str, Any]:
        return dict(self._config)

    # -- tensors ------------------------------------------------------------------------
    def tensor_specs(self) -> list[TensorSpec]:
        # ggml lists dimensions innermost first; HF/torch outermost first
        return [
            TensorSpec(name, torch.float32, tuple(int(d) for d in reversed(t.shape.tolist())))
            for name, t in self._tensors.items()
        ]

    def _transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        if name.endswith("self_attn.q_proj.weight"):
            return lambda w: _unpermute_rope(w, self._config["num_attention_heads"])
        if name.endswith("self_attn.k_proj.weight"):
            return lambda w: _unpermute_rope(w, self._config["num_key_value_heads"])
        return None

    def load(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in HF layout."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        try:
            array = dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot dequantize {t.name} ({t.tensor_type.name}): {exc}") from exc
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        transform = self._transform(name)
        if transform is not None:
            array = transform(array)
        return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a writable copy

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.tensor_specs():
            yield spec.name, self.load(spec.name)

    # -- tokenizer and identity ---------------------------------------------------------
    def save_tokenizer(self, out: Path) -> None:
        """Convert the GGUF vocabulary into Hugging Face tokenizer files in `out`."""
        self.tokenizer_saver()(out)

    def tokenizer_saver(self) -> Callable[[Path], None]:
        """save_tokenizer without this source: transformers reads the GGUF vocabulary again to convert it, so a
        caller that drops the source first does not hold two readers (~0.2 GiB of Python objects each)."""
        gen = {k: self._config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in self._config}
        return functools.partial(save_gguf_tokenizer, self.path, digit_split=self._field("tokenizer.ggml.pre")
                                 in _DIGIT_SPLIT_PRE, generation=gen)

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path.resolve()), "sha256": file_sha256(self.path)}

    def gguf_tensor_info(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """HF name -> (GGUF name, HF-order shape), for checks against the GGUF metadata."""
        return {
            name: (t.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for name, t in self._tensors.items()
        }


def save_gguf_tokenizer(path: Path, out: Path, digit_split: bool, generation: dict[str, int]) -> None:
    """Hugging Face tokenizer files in `out` from the GGUF at `path`, through transformers' converter."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot convert its tokenizer ({exc})") from exc
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for f in Path(tmp).iterdir():
            shutil.copy2(f, out / f.name)
    if digit_split:
        _split_digits(out / "tokenizer.json")
    _fix_tokenizer_class(out / "tokenizer_config.json")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _split_digits(path: Path) -> None:
    data = json.loads(path.read_text())
    digits = {"type": "Digits", "individual_digits": True}
    pre = data.get("pre_tokenizer")
    if pre and pre.get("type") != "Sequence":
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [digits, pre]}
        path.write_text(json.dumps(data, ensure_ascii=False))


def _fix_tokenizer_class(path: Path) -> None:
    # transformers 5 writes its internal backend name; older readers know only this one
    data = json.loads(path.read_text())
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    data.pop("is_local", None)
    data.pop("local_files_only", None)
    path.write_text(json.dumps(data, indent=2) + "\n")

"""A GGUF file as a checkpoint source: HF config, HF tensor names, dequantized tensors.

Tensors are dequantized one at a time from the memory-mapped file, so a 1.7 B model
never has two full copies in memory.  Tensor names follow llama.cpp's own naming: gguf-py's
tensor-name map applied to the names the Hugging Face architecture holds (its transformers
model on the meta device), so every tensor of the file must have its HF counterpart, shape
included, or the file is refused naming it.  The llama, qwen2 and qwen3 architectures are
mapped, and gemma3 and phi3 with what llama.cpp fixes in its code for them (Gemma 3's layer
pattern and sliding-layer RoPE base, its norms stored as 1 + w); anything else is refused by
name before a byte is written.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spark_edge.checkpoints.safetensors_stream import TensorSpec
from spark_edge.checkpoints.sources import gguf_fingerprint
from spark_edge.errors import CheckpointError

_MAGIC = b"GGUF"

GEMMA3_SWA_PERIOD = 6  # llama.cpp's gemma3 has five sliding-window layers, then a global one (not in the file)
GEMMA3_SWA_THETA = 10000.0  # and RoPE base 10000 on the sliding layers (neither)
GEMMA3_27B_LAYERS = 62  # llama.cpp knows the 27B by its layer count: its scores scale by hidden / heads


# An architecture's own config fields: (required metadata, optional metadata, the common config) -> fields;
# the readers take a key without the "ARCH." prefix, the required one raises naming the missing key
_Fields = Callable[[Callable[[str], Any], Callable[[str], Any], dict[str, Any]], dict[str, Any]]


def _gemma3_fields(need: Callable[[str], Any], get: Callable[[str], Any], config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's gemma3 reads from the file or fixes in its code, in Hugging Face's Gemma 3 fields."""
    period, layers = GEMMA3_SWA_PERIOD, config["num_hidden_layers"]
    big = layers == GEMMA3_27B_LAYERS
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        # scores scale by 1/sqrt(key_length), on the 27B by 1/sqrt(hidden / heads)
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"],
        "sliding_window": int(need("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)],
        "rope_local_base_freq": GEMMA3_SWA_THETA,
        "final_logit_softcapping": get("final_logit_softcapping"),
        "attn_logit_softcapping": None,
    }


def _phi3_fields(need: Callable[[str], Any], get: Callable[[str], Any], config: dict[str, Any]) -> dict[str, Any]:
    fields = {"sliding_window": get("attention.sliding_window")}
    original = get("rope.scaling.original_context_length")
    if original:
        fields["original_max_position_embeddings"] = int(original)
    return fields


@dataclass(frozen=True)
class _Family:
    architecture: str  # the Hugging Face class llama.cpp's converter reads
    model_type: str
    rope_permuted: bool = False  # llama.cpp reorders Q/K rows of its "llama" architecture only
    norm_shift: float = 0.0  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
    fields: _Fields | None = None


# llama.cpp architecture -> what its Hugging Face checkpoint was
_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", "llama", rope_permuted=True),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2"),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3"),
    "gemma3": _Family("Gemma3ForCausalLM", "gemma3_text", norm_shift=1.0, fields=_gemma3_fields),
    "phi3": _Family("Phi3ForCausalLM", "phi3", fields=_phi3_fields),
}
# tensors some converters add that no mapped architecture reads: refused by name
_UNMAPPED_EXTRAS = {
    "rope_freqs.weight": "per-dimension RoPE frequency factors (rope_freqs.weight, e.g. Llama 3.x's RoPE scaling)",
    "rope_factors_long.weight": "LongRoPE factors (rope_factors_long.weight, Phi-3's 128k variants)",
}

# llama.cpp pre-tokenizers that split every digit on its own (its "\p{N}" rule);
# transformers' GGUF tokenizer conversion leaves that step out.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}

SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def _hf_shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape in HF/torch order: ggml lists dimensions innermost first."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


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
        self._family = _FAMILIES[arch]
        self._gguf_tensors = {t.name: t for t in self._reader.tensors}
        self._config = self._build_config()
        self._tensors = self._map_tensors()

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
        """HF name -> GGUF tensor, through gguf-py's name map of this architecture; shapes checked."""
        import gguf

        from spark_edge.checkpoints.architecture import tensor_shapes

        arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == self._arch)
        names = gguf.get_tensor_name_map(arch, int(self._config["num_hidden_layers"]))
        expected = dict(tensor_shapes(self._config))
        to_hf: dict[str, str] = {}
        for hf in expected:
            stem, _, suffix = hf.rpartition(".")
            gguf_stem = names.get_name(stem)
            if gguf_stem is not None:
                to_hf[f"{gguf_stem}.{suffix}"] = hf
        mapped: dict[str, Any] = {}
        for extra, what in _UNMAPPED_EXTRAS.items():
            if extra in self._gguf_tensors:
                raise CheckpointError(f"{self.path}: {what} are not supported yet")
        for t in self._reader.tensors:
            hf = to_hf.get(t.name)
            if hf is None:
                raise CheckpointError(
                    f"{self.path}: tensor {t.name!r} has no Hugging Face {self._family.architecture} equivalent"
                )
            shape = _hf_shape(t)
            if shape != expected[hf]:
                raise CheckpointError(
                    f"{self.path}: tensor {t.name} is {list(shape)}; its config implies {list(expected[hf])}"
                )
            mapped[hf] = t
        missing = sorted(set(expected) - set(mapped))
        if missing:
            raise CheckpointError(
                f"{self.path}: {len(missing)} tensors of {self._family.architecture} are missing (first: {missing[0]})"
            )
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
        embedding = self._gguf_tensors.get("token_embd.weight")
        if embedding is None:
            raise CheckpointError(f"{self.path}: no token embedding (token_embd.weight)")
        n_vocab = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = int(m.get(f"{a}.vocab_size") or (len(n_vocab.data) if n_vocab else 0))
        embd_rows = int(embedding.shape[1])
        if vocab != embd_rows:
            raise CheckpointError(f"{self.path}: vocab size {vocab} does not match the embedding's {embd_rows} rows")
        # Qwen3's and Gemma's heads are wider than hidden / heads: key_length says so where the converter wrote it
        head_dim = int(m.get(f"{a}.attention.key_length") or hidden // heads)
        rope_dims = m.get(f"{a}.rope.dimension_count")
        if rope_dims and int(rope_dims) != head_dim:
            raise CheckpointError(
                f"{self.path}: RoPE on {rope_dims} of {head_dim} head dimensions is not supported yet"
            )
        config: dict[str, Any] = {
            "architectures": [self._family.architecture],
            "model_type": self._family.model_type,
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(m.get(f"{a}.attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "max_position_embeddings": int(need("context_length")),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(m.get(f"{a}.rope.freq_base") or 10000.0),
            "vocab_size": vocab,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": "output.weight" not in self._gguf_tensors,
            "torch_dtype": "bfloat16",
        }
        for key, tok_key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
            value = self._field(f"tokenizer.ggml.{tok_key}_token_id")
            if value is not None:
                config[key] = int(value)
        if m.get(f"{a}.rope.scaling.type") not in (None, "none"):
            raise CheckpointError(f"{self.path}: RoPE scaling {m.get(f'{a}.rope.scaling.type')!r} is not supported yet")
        if self._family.fields is not None:
            config.update(self._family.fields(need, lambda key: m.get(f"{a}.{key}"), config))
        return config

    def hf_config(self) -> dict[str, Any]:
        return dict(self._config)

    # -- tensors ------------------------------------------------------------------------
    def tensor_specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, torch.float32, _hf_shape(t)) for name, t in self._tensors.items()]

    def _transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        if self._family.norm_shift and name.endswith("norm.weight"):
            return lambda w: w - np.float32(self._family.norm_shift)
        if not self._family.rope_permuted:
            return None
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
        shape = _hf_shape(t)
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
        return functools.partial(
            save_gguf_tokenizer,
            self.path,
            digit_split=self._field("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE,
            generation=gen,
        )

    def fingerprint(self) -> dict[str, Any]:
        return gguf_fingerprint(self.path)

    def gguf_tensor_info(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """HF name -> (GGUF name, HF-order shape), for checks against the GGUF metadata."""
        return {name: (t.name, _hf_shape(t)) for name, t in self._tensors.items()}


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

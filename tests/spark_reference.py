"""Spark-X2.5 in plain PyTorch: the whole sequence at once, no KV cache, no vLLM, to check the vLLM model against.

Written from the architecture's description, independently of spark_edge.models.spark: it
shares no code with it (not the layout helpers, not the gate op, not vLLM's layers), reads
the checkpoint files itself, and computes in one dtype throughout (float64 by default, so
it is exact for practical purposes; bfloat16 to see what bf16 rounding alone does).

Per layer (x is the residual stream, positions 0..T-1):
    h = rmsnorm(x) * w_in
    q | k | v = h @ W_qkv^T          k, v: kv_heads heads, each shared by heads/kv_heads query heads
    q, k rotated neox style on their first rotary_dim dims (theta and rotary_dim per layer type)
    a = softmax(q k^T / sqrt(head_dim) + mask) v     mask: causal; sliding layers also drop keys
                                                     more than window-1 positions back
    a[:, head] *= sigmoid(h @ W_g^T)[:, head]        (silu if gate_attn_act_mode says so)
    x = x + a @ W_out^T
    h = rmsnorm(x) * w_post
    x = x + (gelu_erf(h @ W_gate^T) * (h @ W_up^T)) @ W_down^T
logits = (rmsnorm(x) * w_final) @ E^T      (E: the embedding, tied, or lm_head)

Also reads the 4-bit checkpoints spark-edge writes, decoding them with its own few lines:
cpu_int4 (w = (q - 8) * scale + zero, row-major nibbles, low nibble first; its 8-bit table w = q * scale,
one scale a row) and symmetric GPTQ (w = (q - 8) * scale, codes packed 8 per int32 along K).

int8_rows_from=P models int8 activations on the positions from P on, as a kernel that quantizes them
computes: each 4-bit linear's input row rounded to int8 per 32 inputs (d = max|x| / 127) against the
code part q * scale of the weights, the exact input against the offset part zero - 8 * scale.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                tensors[name] = st.get_tensor(name)
    if not tensors:
        raise FileNotFoundError(f"{folder}: no *.safetensors")
    return tensors


def _cpu_int4_parts(t: dict[str, torch.Tensor], prefix: str, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q * scale, zero - 8 * scale): the code part and the offset part of w = (q - 8) * scale + zero."""
    packed = t[f"{prefix}.weight_packed"]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).double()
    scale = t[f"{prefix}.weight_scale"].double().repeat_interleave(group, dim=1)
    zero = t[f"{prefix}.weight_zero"].double().repeat_interleave(group, dim=1)
    return codes * scale, zero - 8 * scale


def _int8_rounded(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded to int8 per row and block of inputs, symmetric, d = max|x| / 127."""
    xb = x.reshape(x.shape[0], -1, block)
    d = xb.abs().amax(dim=2, keepdim=True) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    return (torch.round(xb / safe).clamp(-127, 127) * d).reshape(x.shape)


def _gptq_weight(t: dict[str, torch.Tensor], prefix: str, group: int, zero_offset: int) -> torch.Tensor:
    """(q - z) * s per input column's group (g_idx; k // group without it), z = stored + zero_offset."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = t[f"{prefix}.qweight"].to(torch.int64) & 0xFFFFFFFF  # [K/8, N]
    codes = ((words.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF).reshape(-1, words.shape[1])  # [K, N]
    zwords = t[f"{prefix}.qzeros"].to(torch.int64) & 0xFFFFFFFF  # [G, N/8]
    zeros = ((zwords.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF).reshape(zwords.shape[0], -1) + zero_offset
    k = codes.shape[0]
    g = t[f"{prefix}.g_idx"].long() if f"{prefix}.g_idx" in t else torch.arange(k) // group
    scale = t[f"{prefix}.scales"].double()
    return ((codes.double() - zeros[g].double()) * scale[g]).t()


def _awq_weight(t: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    """(q - z) * s, unpacked with the nibble order of vLLM's own AWQ reader."""
    from vllm.model_executor.layers.quantization.auto_awq import _REVERSE_AWQ_PACK_ORDER

    shifts = torch.tensor(_REVERSE_AWQ_PACK_ORDER, dtype=torch.int64) * 4

    def unpack(words: torch.Tensor) -> torch.Tensor:
        w = words.to(torch.int64) & 0xFFFFFFFF
        return ((w.unsqueeze(-1) >> shifts) & 0xF).reshape(w.shape[0], -1).double()

    codes, zeros = unpack(t[f"{prefix}.qweight"]), unpack(t[f"{prefix}.qzeros"])  # [K, N], [G, N]
    g = torch.arange(codes.shape[0]) // group
    return ((codes - zeros[g]) * t[f"{prefix}.scales"].double()[g]).t()


def _ct_scheme(quant: dict) -> object:
    from compressed_tensors.quantization import QuantizationConfig

    (scheme,) = QuantizationConfig.model_validate(quant).config_groups.values()
    return scheme


def _ct_weight(t: dict[str, torch.Tensor], prefix: str, scheme: object) -> torch.Tensor:
    """Decoded by the compressed-tensors library itself (its pack-quantized decompressor)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    local = {k.removeprefix(prefix + "."): v for k, v in t.items() if k.startswith(prefix + ".weight_")}
    return PackedQuantizationCompressor.decompress(local, scheme)["weight"].double()


class _Weights:
    """Full-precision tensors by checkpoint name, whatever format the checkpoint stores them in."""

    def __init__(self, folder: Path, config: dict) -> None:
        self.t = _read_tensors(folder)
        q = config.get("quantization_config") or {}
        self.method = q.get("quant_method")
        self.group = int(q.get("group_size", 0))
        self.zero_offset = 0 if q.get("checkpoint_format") == "gptq_v2" else 1  # v1 stores zero point - 1
        self.ct_scheme = _ct_scheme(q) if self.method == "compressed-tensors" else None
        if self.method not in (None, "cpu_int4", "gptq", "awq", "compressed-tensors"):
            raise ValueError(f"reference: unknown quant_method {self.method!r}")

    def get(self, name: str) -> torch.Tensor:
        """`name` is a weight's checkpoint name ending in .weight; quantized forms are decoded."""
        if name in self.t:
            return self.t[name].double()
        prefix = name.removesuffix(".weight")
        if self.method == "cpu_int4" and f"{prefix}.weight_packed" in self.t:
            return sum(_cpu_int4_parts(self.t, prefix, self.group))
        if self.method == "cpu_int4" and f"{prefix}.weight_int8" in self.t:  # the 8-bit table: w = q * scale
            return self.t[f"{prefix}.weight_int8"].double() * self.t[f"{prefix}.weight_scale"].double()[:, None]
        if self.method == "gptq" and f"{prefix}.qweight" in self.t:
            return _gptq_weight(self.t, prefix, self.group, self.zero_offset)
        if self.method == "awq" and f"{prefix}.qweight" in self.t:
            return _awq_weight(self.t, prefix, self.group)
        if self.ct_scheme is not None and f"{prefix}.weight_packed" in self.t:
            return _ct_weight(self.t, prefix, self.ct_scheme)
        raise KeyError(f"reference: no tensor for {name}")

    def parts(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The code part and the offset part of a cpu_int4 weight (see the module docstring); None for any
        other tensor."""
        prefix = name.removesuffix(".weight")
        if self.method == "cpu_int4" and f"{prefix}.weight_packed" in self.t:
            return _cpu_int4_parts(self.t, prefix, self.group)
        return None

    def qkv(self, i: int) -> torch.Tensor:
        try:
            return self.get(qkv_name(i))
        except KeyError:  # the GPTQ export writes the three parts
            parts = [self.get(f"model.layers.{i}.self_attn.{p}_proj.weight") for p in "qkv"]
            return torch.cat(parts)


def qkv_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.q_k_v_proj.weight"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float, rotary_dim: int) -> torch.Tensor:
    """Neox-style rotation of the first rotary_dim dims of x [T, heads, head_dim]; the rest pass through."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def attention_mask(t: int, window: int | None) -> torch.Tensor:
    """bool [T, T]: query i may read key j."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    return allowed


class SparkReference:
    def __init__(
        self,
        folder: str | Path,
        dtype: torch.dtype = torch.float64,
        window_override: int | None = -1,
        int8_rows_from: int | None = None,
    ) -> None:
        """window_override: -1 keeps the config's window; None turns windows off (every layer full).
        int8_rows_from: see the module docstring (None: every activation exact)."""
        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        self.dtype = dtype
        c = self.config
        self.hidden = c["hidden_size"]
        self.heads = c["num_attention_heads"]
        self.kv_heads = c["num_key_value_heads"]
        self.head_dim = c["head_dim"]
        self.eps = c["rms_norm_eps"]
        self.layer_types = c["layer_types"]
        self.window = c.get("sliding_window") if window_override == -1 else window_override
        self.gate_act = c.get("gate_attn_act_mode", "sigmoid")
        w = _Weights(folder, c)
        cast = lambda x: x.to(dtype)  # noqa: E731
        self.embedding = cast(w.get("model.embedding.weight"))
        tied = c.get("tie_word_embeddings", False)
        self.final_norm = cast(w.get("model.norm.weight"))
        self.int8_rows_from = int8_rows_from
        # (code part, offset part) of the 4-bit linears by weight identity, when int8 rows are modelled
        self.int8_parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def linear(name: str, load: Callable[[], torch.Tensor]) -> torch.Tensor:
            parts = w.parts(name) if int8_rows_from is not None else None
            if parts is None:
                return cast(load())
            code, offset = cast(parts[0]), cast(parts[1])
            weight = code + offset  # what load() decodes, from the parts already read
            self.int8_parts[id(weight)] = (code, offset)
            return weight

        self.head = (
            linear("model.embedding.weight", lambda: self.embedding)
            if tied
            else linear("lm_head.weight", lambda: w.get("lm_head.weight"))
        )
        self.layers = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}"
            self.layers.append(
                {
                    "in_norm": cast(w.get(f"{p}.input_layernorm.weight")),
                    "qkv": linear(qkv_name(i), lambda: w.qkv(i)),  # noqa: B023 (called at once)
                    "gate": cast(w.get(f"{p}.self_attn.g_proj.weight")),
                    "out": linear(f"{p}.self_attn.out_proj.weight", lambda: w.get(f"{p}.self_attn.out_proj.weight")),  # noqa: B023
                    "post_norm": cast(w.get(f"{p}.post_attention_layernorm.weight")),
                    **{
                        key: linear(f"{p}.mlp.{name}.weight", lambda: w.get(f"{p}.mlp.{name}.weight"))  # noqa: B023
                        for key, name in (("mlp_gate", "gate_proj"), ("mlp_up", "up_proj"), ("mlp_down", "down_proj"))
                    },
                }
            )

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight^T, with the rows from int8_rows_from on as an int8-activation kernel computes them."""
        y = x @ weight.t()
        parts = self.int8_parts.get(id(weight))
        if parts is not None and self.int8_rows_from is not None:
            code, offset = parts
            tail = x[self.int8_rows_from :]
            y[self.int8_rows_from :] = _int8_rounded(tail) @ code.t() + tail @ offset.t()
        return y

    def _rope(self, layer_type: str) -> tuple[float, int]:
        params = self.config["rope_parameters"][layer_type]
        factor = params.get("partial_rotary_factor", 1.0)
        return float(params.get("rope_theta", 10000.0)), int(self.head_dim * factor)

    def _attention(self, layer: dict, h: torch.Tensor, positions: torch.Tensor, layer_type: str) -> torch.Tensor:
        t = h.shape[0]
        qkv = self._linear(h, layer["qkv"])
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q = qkv[:, :q_size].reshape(t, self.heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(t, self.kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(t, self.kv_heads, self.head_dim)
        theta, rotary_dim = self._rope(layer_type)
        q, k = rotate(q, positions, theta, rotary_dim), rotate(k, positions, theta, rotary_dim)
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=1)  # query head j reads KV head j // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        window = self.window if layer_type == "sliding_attention" else None
        scores = scores.masked_fill(~attention_mask(t, window), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)  # [T, heads, head_dim]
        score = h @ layer["gate"].t()  # [T, heads]
        gate = torch.sigmoid(score) if self.gate_act == "sigmoid" else torch.nn.functional.silu(score)
        out = out * gate[:, :, None]
        return self._linear(out.reshape(t, q_size), layer["out"])

    def _mlp(self, layer: dict, h: torch.Tensor) -> torch.Tensor:
        gate = self._linear(h, layer["mlp_gate"])
        gelu = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))
        return self._linear(gelu * self._linear(h, layer["mlp_up"]), layer["mlp_down"])

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """[T, vocab] next-token logits after each prefix of token_ids."""
        ids = torch.tensor(token_ids, dtype=torch.int64)
        positions = torch.arange(len(token_ids))
        x = self.embedding[ids]
        for layer, layer_type in zip(self.layers, self.layer_types):
            x = x + self._attention(layer, rms_norm(x, layer["in_norm"], self.eps), positions, layer_type)
            x = x + self._mlp(layer, rms_norm(x, layer["post_norm"], self.eps))
        return self._linear(rms_norm(x, self.final_norm, self.eps), self.head)

    def log_probs(self, token_ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.logits(token_ids).double(), dim=-1)

"""The few numbers of a decoder config that decide memory: layers, widths, vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        heads = int(config["num_attention_heads"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of every linear layer in the decoder stack, the head excluded."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = [(q, self.hidden), (kv, self.hidden), (kv, self.hidden), (self.hidden, q),
                     (self.intermediate, self.hidden), (self.intermediate, self.hidden),
                     (self.hidden, self.intermediate)]
        return per_layer * self.layers

    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V for every layer: vLLM's CPU backend allocates every layer in full."""
        return self.layers * self.kv_heads * self.head_dim * 2 * dtype_bytes

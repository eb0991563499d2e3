"""The few numbers of a decoder config that decide memory: layers, widths, vocabulary, attention windows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING_LAYER_TYPE = "sliding_attention"  # the `layer_types` spelling of a sliding-window layer


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    # hybrid attention (e.g. Spark-X2.5: 21 of 28 layers with a 512-token window): a sliding
    # layer's KV never holds more than its window plus the tokens of the step in flight
    sliding_layers: int = 0
    sliding_window: int = 0

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        heads = int(config["num_attention_heads"])
        layer_types = config.get("layer_types") or []
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        if not window:
            sliding = 0
        elif layer_types:
            sliding = sum(t == SLIDING_LAYER_TYPE for t in layer_types)
        else:  # a window and no layer types: vLLM windows every layer (Phi-3's 2047 tokens)
            sliding = int(config["num_hidden_layers"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab=int(config["vocab_size"]),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_layers=sliding,
            sliding_window=int(window) if sliding else 0,
        )

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of every linear layer in the decoder stack, the head excluded."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = [
            (q, self.hidden),
            (kv, self.hidden),
            (kv, self.hidden),
            (self.hidden, q),
            (self.intermediate, self.hidden),
            (self.intermediate, self.hidden),
            (self.hidden, self.intermediate),
        ]
        return per_layer * self.layers

    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int = 2) -> int:
        return self.kv_heads * self.head_dim * 2 * dtype_bytes  # K and V

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token in every layer: what a token inside every window costs."""
        return self.layers * self.kv_bytes_per_token_per_layer(dtype_bytes)

    def sliding_blocks(self, context: int, in_flight_tokens: int, block_tokens: int) -> int:
        """KV blocks one sequence holds in one sliding layer, as vLLM's KV manager reserves them:
        the last window-1 computed tokens plus the tokens in flight (blocks are freed per
        processed token), never more than the context, plus one block because the window
        need not start at a block boundary."""
        held = min(self.sliding_window - 1 + in_flight_tokens, context)
        return _cdiv(held, block_tokens) + 1

    def kv_cache_bytes(
        self, context: int, seqs: int, in_flight_tokens: int, block_tokens: int, dtype_bytes: int = 2
    ) -> int:
        """KV cache for `seqs` sequences of `context` tokens, in whole blocks, plus vLLM's null block.

        Every layer of a model without windows holds every token. With windows (vLLM's hybrid KV
        manager, on by default on CPU), full layers hold the context and sliding layers what
        `sliding_blocks` says, so sliding layers stop growing past window + in-flight tokens.
        """
        if not self.sliding_layers:
            blocks = _cdiv(context * seqs, block_tokens) + 1
            return blocks * block_tokens * self.kv_bytes_per_token(dtype_bytes)
        full_layers = self.layers - self.sliding_layers
        per_seq = full_layers * _cdiv(context, block_tokens) + self.sliding_layers * self.sliding_blocks(
            context, in_flight_tokens, block_tokens
        )
        # the null block, charged in every layer (an upper bound: vLLM keeps one per KV cache group)
        layer_blocks = seqs * per_seq + self.layers
        return layer_blocks * block_tokens * self.kv_bytes_per_token_per_layer(dtype_bytes)

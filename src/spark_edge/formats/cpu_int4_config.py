"""The `quantization_config` of a cpu_int4 checkpoint: fields, defaults, validation.

Kept free of vLLM imports so the checkpoint writer can use it without loading vLLM.

Every switch that changes the graph vLLM traces must be a field here, not an
environment variable: vLLM hashes the HF config (quantization_config included) into its
compile-cache key, and an env var is invisible to that key, so a warm cache would
replay a graph built for the other setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spark_edge.registry import W4A16_GROUP

QUANT_METHOD = "cpu_int4"
BITS = 4
GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
DEFAULT_GROUP_SIZE = W4A16_GROUP  # the w4a16 path's, recorded in the registry

EMBEDDING_BITS = (4, 8)
# What a quantization_config without "embedding_bits" means: checkpoints written before the 8-bit table
# quantized the vocabulary table like every linear.
LEGACY_EMBEDDING_BITS = 4

_FIELDS = ("quant_method", "bits", "group_size", "quantize_embedding", "embedding_bits", "direct_dequant")


@dataclass(frozen=True)
class CpuInt4Settings:
    group_size: int = DEFAULT_GROUP_SIZE
    # the (tied) token embedding / LM head is quantized too; the head is the largest GEMM of a decode step
    quantize_embedding: bool = True
    # its bits when quantized: 4 (group-wise, as the linears) or 8 (per-row int8 codes and a scale, the head on
    # vLLM's int8 GEMM); the head decides every token (registry.W4A16_EMBEDDING_BITS says what each measured)
    embedding_bits: int = LEGACY_EMBEDDING_BITS
    # multi-row GEMMs and embedding lookups decode the kernel buffer itself (no row-major
    # copy resident); false keeps the checkpoint's row-major tensors for them instead
    direct_dequant: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(f"cpu_int4: group_size must be an integer, got {self.group_size!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"cpu_int4: group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.embedding_bits not in EMBEDDING_BITS or isinstance(self.embedding_bits, bool):
            raise ValueError(f"cpu_int4: embedding_bits must be one of {EMBEDDING_BITS}, got {self.embedding_bits!r}")
        for name in ("quantize_embedding", "direct_dequant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"cpu_int4: {name} must be true or false, got {getattr(self, name)!r}")

    def to_hf(self) -> dict[str, Any]:
        """The dict written as config.json's quantization_config."""
        return {
            "quant_method": QUANT_METHOD,
            "bits": BITS,
            "group_size": self.group_size,
            "quantize_embedding": self.quantize_embedding,
            "embedding_bits": self.embedding_bits,
            "direct_dequant": self.direct_dequant,
        }

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> CpuInt4Settings:
        """Parse a quantization_config; unknown keys are refused rather than ignored,
        since an ignored switch would silently serve another graph than the one asked for."""
        unknown = sorted(set(config) - set(_FIELDS))
        if unknown:
            raise ValueError(f"cpu_int4: unknown quantization_config keys {unknown} (known: {list(_FIELDS)})")
        method = config.get("quant_method", QUANT_METHOD)
        if method != QUANT_METHOD:
            raise ValueError(f"cpu_int4: quant_method is {method!r}")
        bits = config.get("bits", BITS)
        if bits != BITS:
            raise ValueError(f"cpu_int4: only {BITS}-bit weights are supported, got bits={bits!r}")
        return cls(
            group_size=config.get("group_size", DEFAULT_GROUP_SIZE),
            quantize_embedding=config.get("quantize_embedding", True),
            embedding_bits=config.get("embedding_bits", LEGACY_EMBEDDING_BITS),
            direct_dequant=config.get("direct_dequant", True),
        )

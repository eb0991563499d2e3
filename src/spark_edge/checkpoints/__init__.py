"""Checkpoint sources (GGUF, Hugging Face), per-weight-path builders, manifests."""

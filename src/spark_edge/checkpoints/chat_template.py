"""Where a checkpoint's chat template lives, looked up in the places transformers (and so vLLM) reads it from.

A checkpoint's template is its own: `build` copies the tokenizer files as they are (a GGUF's
`tokenizer.chat_template` comes through transformers' tokenizer conversion), and vLLM renders
`/v1/chat/completions` with it. Without one, vLLM answers chat requests with 400; `serve` says so at start.
"""

from __future__ import annotations

import json
from pathlib import Path

# transformers >= 4.43 writes the template as a file of its own; older exports keep it in tokenizer_config.json
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def chat_template_source(folder: Path) -> str | None:
    """The file of `folder` that holds its chat template, or None when it has none."""
    for name in TEMPLATE_FILES:
        if (folder / name).is_file():
            return name
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return "tokenizer_config.json" if isinstance(config, dict) and config.get("chat_template") else None


def missing_template_note(folder: Path, vllm_args: tuple[str, ...] | list[str]) -> str | None:
    """What `serve` tells the operator when chat requests will be refused, or None when they will be served."""
    given = any(a == "--chat-template" or a.startswith("--chat-template=") for a in vllm_args)
    if given or chat_template_source(folder):
        return None
    return (
        f"model: {folder.name} has no chat template in its tokenizer files: /v1/chat/completions will answer 400, "
        "/v1/completions works; give one with `-- --chat-template FILE`"
    )

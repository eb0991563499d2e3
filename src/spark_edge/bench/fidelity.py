"""Fidelity through the real engine: perplexity and teacher-forced top-1 agreement.

Both come from vLLM's `prompt_logprobs` on /v1/completions: for every position of a
fixed text the server returns the log-probability of the true next token and its own
top-1 token.  Perplexity is exp(-mean logprob); top-1 agreement compares two servers'
top-1 tokens position by position, with identical inputs (teacher forcing), so one
early difference does not cascade the way free-running greedy text does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import requests

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")  # ~8k tokens of plain English
WINDOW = 512  # tokens per scored window
WINDOWS = 8


@dataclass
class Scored:
    logprobs: list[float]  # of the true token, per scored position
    top1: list[int]  # the server's most likely token, per scored position

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def text_chunks(
    checkpoint: Path, text_path: Path = DEFAULT_TEXT, chunk: int = WINDOW, chunks: int = WINDOWS
) -> list[list[int]]:
    """Token ids of a plain English text, cut into equal windows."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(checkpoint))(text_path.read_text())["input_ids"]
    windows = [ids[i : i + chunk] for i in range(0, len(ids) - chunk + 1, chunk)][:chunks]
    if not windows:
        raise ValueError(f"{text_path} is shorter than one {chunk}-token window")
    return windows


def score(url: str, model: str, windows: list[list[int]], headers: dict[str, str] | None = None) -> Scored:
    logprobs: list[float] = []
    top1: list[int] = []
    for window in windows:
        body = {"model": model, "prompt": window, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
        reply = requests.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=600)
        reply.raise_for_status()
        positions = reply.json()["choices"][0]["prompt_logprobs"]
        for token, entry in zip(window[1:], positions[1:]):  # position 0 has no prediction
            entries = {int(k): v for k, v in entry.items()}
            logprobs.append(entries[token]["logprob"])
            top1.append(next(k for k, v in entries.items() if v.get("rank") == 1))
    return Scored(logprobs, top1)


def top1_agreement(a: Scored, b: Scored) -> float:
    if len(a.top1) != len(b.top1):
        raise ValueError("scored different texts")
    return sum(x == y for x, y in zip(a.top1, b.top1)) / len(a.top1)

"""A workload grounded in its prompt: the edge's RAG and extraction traffic, where the answer repeats a passage
the prompt carries. It is where n-gram speculation (prompt lookup) finds its drafts, so the bench measures it
beside the random-prompt decode (where lookup finds drafts only when a small model's output loops).

Each request asks to copy a different passage of the fidelity text (only the instruction's few tokens are shared
between them), greedy, 128 tokens; the figure is the streamed decode rate (tokens after the first over the time
after the first).
"""

from __future__ import annotations

from spark_edge.bench.fidelity import DEFAULT_TEXT
from spark_edge.bench.streams import stream_completion

PASSAGE_CHARS = 1200  # ~250 tokens of English: more than the 128 generated, so the copy never runs out
GENERATED = 128


def grounded_prompts(count: int, text: str | None = None) -> list[str]:
    """`count` prompts, each a passage of the text at its own offset and the request to copy it."""
    body = " ".join((text if text is not None else DEFAULT_TEXT.read_text()).split())
    if len(body) < PASSAGE_CHARS * count:
        raise ValueError(f"the text holds fewer than {count} passages of {PASSAGE_CHARS} characters")
    passages = [body[i * PASSAGE_CHARS : (i + 1) * PASSAGE_CHARS] for i in range(count)]
    return [f"Copy the following passage exactly.\n\nPassage:\n{p}\n\nCopy:\n" for p in passages]


def grounded_decode_tps(url: str, model: str, reps: int, headers: dict[str, str] | None = None) -> float:
    """The best streamed decode rate over `reps` grounded requests."""
    return max(stream_completion(url, model, p, GENERATED, headers).decode_tps for p in grounded_prompts(reps))

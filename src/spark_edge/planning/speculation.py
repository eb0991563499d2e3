"""N-gram speculation (prompt lookup): drafts copied from the request's own text, verified in one step.

vLLM's CPU model runner runs `--speculative-config` with method `ngram`: its proposer (numba, on the host)
looks for the last few generated tokens earlier in the prompt and output and proposes what followed them;
the model verifies every draft in the next step, and greedy output is unchanged. A step then carries up to
1 + DRAFT_TOKENS tokens a sequence, which vLLM reserves out of max_num_batched_tokens: the plan's prefill
chunk keeps room for them. It pays where the answer repeats its prompt (extraction, RAG, edits; bench/grounded.py)
and while few requests decode together; with more, vLLM's per-batch schedule turns the drafts off.
"""

from __future__ import annotations

import json

SPECULATION = ("off", "ngram")
DRAFT_TOKENS = 4  # drafts a step: 60-79% accepted per draft position on the grounded workload (Xeon AMX)
LOOKUP_MIN, LOOKUP_MAX = 2, 4  # the n-gram lengths matched against the text so far, longest first
# Drafts only while this few sequences decode together: at 4 streams of random prompts speculation measured
# 0.88x of plain decoding (Xeon AMX, docs/bench-runs/2026-12-05-xeon-amx-default-ngram.json), where the batch
# already fills the GEMMs and rejected drafts cost rows; vLLM's scheduler takes the schedule per step.
MAX_SPECULATING_SEQS = 2
_ANY_BATCH = 1 << 16
# What speculation adds to the runtime's resident memory (numba's compiler for the proposer, its buffers):
# settled 761 vs 730 MiB and 903 vs 873 MiB in the two passes of docs/bench-runs/
# 2026-12-05-xeon-amx-default-ngram-schedule.json; the plan adds it to its baseline
RUNTIME_BYTES = 40 << 20


def runtime_bytes(draft_tokens: int) -> int:
    return RUNTIME_BYTES if draft_tokens else 0


def draft_tokens(mode: str) -> int:
    """Tokens a step may add to each sequence beyond its one."""
    if mode not in SPECULATION:
        raise ValueError(f"unknown speculation {mode!r} (known: {', '.join(SPECULATION)})")
    return DRAFT_TOKENS if mode == "ngram" else 0


def vllm_speculative_config(drafts: int) -> str | None:
    """vLLM's --speculative-config for a plan's `drafts` (draft_tokens()), None for none."""
    if drafts == 0:
        return None
    return json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": drafts,
            "prompt_lookup_min": LOOKUP_MIN,
            "prompt_lookup_max": LOOKUP_MAX,
            "num_speculative_tokens_per_batch_size": [
                [1, MAX_SPECULATING_SEQS, drafts],
                [MAX_SPECULATING_SEQS + 1, _ANY_BATCH, 0],
            ],
        },
        separators=(",", ":"),
    )

"""The memory plan: predicted RSS of the whole server, and a context that fits.

    steady       = runtime baseline + weights + KV cache + activations
    load peak    = steady + load transient (+ the C++ compiler, on a start that compiles)
    serving peak = steady + logits transient (a prompt_logprobs step)
    peak         = max(load peak, serving peak), which must fit the budget

Every term is RSS summed over vLLM's processes (API server, engine core and, in vLLM's own layout, a
worker), the figure a cgroup limit counts. All of it is anonymous except the weights once loaded: those
are mapped from their file (file-backed RSS, `file_backed_bytes`), which the cgroup charges all the same
(and must keep resident, or every decode step reads them back from disk), so they stay in every sum.
The constants below are calibrated by measurement; docs/memory-plan.md says how, and `spark-edge bench`
re-measures them.

The plan picks the prefill chunk, the KV cache and the context under `ceiling - headroom`:
first it halves the prefill chunk (vLLM's max_num_batched_tokens) down to MIN_PREFILL_CHUNK,
then it shrinks the KV cache from `max_num_seqs` full-length sequences down to one, then it
halves the context; if even MIN_CONTEXT does not fit, it refuses before anything is loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from spark_edge import exit_codes
from spark_edge.environment import kernel_enabled
from spark_edge.errors import SparkEdgeError
from spark_edge.planning import speculation
from spark_edge.planning.kv_dtype import KV_DTYPE_BYTES
from spark_edge.planning.model_shape import ModelShape
from spark_edge.planning.weight_bytes import BF16, weight_bytes
from spark_edge.probe.cpu_features import host_has_bf16_gemm, host_has_int8_dot, host_runs_packed_int8_gemm
from spark_edge.registry import weight_path as weight_path_spec

MiB = 1 << 20

# Calibrated on this machine (vLLM 0.32, torch 2.13, SmolLM2-135M), see docs/memory-plan.md.
# Anonymous RSS of vLLM's processes with weights, KV cache and activations subtracted (imports,
# oneDNN/OpenMP pools, the compiled graph, allocator slack), per process layout
# (serving/process_layout.py): "split" runs API server, engine core and worker; "engine" has
# no worker process of its own, which measured ~400 MiB less settled (1306-1442 vs 1696-1841 MiB
# on w4a16, side by side in one bench run).
# "single" (the engine core on a thread of the API server's process) settled at 841 MiB warm and 984 MiB after a
# cold compile on an AMD EPYC Zen 4 host (w4a16, default options: 271 MiB of weights, KV and activations), so
# ~710 MiB of runtime; its load peak on a cold start ran 943-1133 MiB (the compiler's share of it varies).
RUNTIME_BASELINE_BYTES = {"engine": 1200 * MiB, "split": 1600 * MiB, "single": 750 * MiB}
# Resident weights: the 4-bit paths keep one buffer per weight (their checkpoint bytes). bf16 keeps its
# checkpoint plus copies of the vocabulary table: vLLM's CPU head packs the (tied) table for oneDNN beside the
# embedding's own. Measured as settled anonymous RSS minus everything else, in copies of the table (vocab x
# hidden bf16): 2.57 on an Intel Xeon with AMX (default model), 1.9 and 2.0 on an AMD EPYC Zen 4 (default
# model and a 1.7B-shaped one). A whole-checkpoint factor (1.55, the Intel figure) fit the 135M model, whose
# table is a fifth of it, but planned the 1.7B's bf16 weights 1.4 GiB too high there (measured ~1.1x).
BF16_TABLE_COPIES = 2.6
# Without bf16 GEMM hardware (no AVX512-BF16, AMX or arm64 BF16) oneDNN converts bf16 itself, and the bf16
# path held more: on a Skylake-SP host the bf16 server's anonymous RSS under a 4-client load reached 1878 MiB
# against 1789 MiB planned with 1.55x the checkpoint (its load peak 1730 MiB). 2.15x covers that with 60 MiB to
# spare; the cause (oneDNN per-shape weight conversions is the suspect) is not yet measured, nor how it scales,
# so it stays a whole-checkpoint factor.
BF16_FACTOR_WITHOUT_BF16_HARDWARE = 2.15
# w4a16's 8-bit vocabulary table where integer dot products exist but vLLM's packed int8 GEMM does not run (AVX-VNNI
# without AVX-512, whose vLLM build has no such GEMM; or that GEMM disabled): oneDNN's int8 GEMM (the head) keeps
# its own packed copy of the codes (anonymous) beside the mapped rows the embedding lookup reads. With AVX512-VNNI
# (AMX included) vLLM's packed GEMM and the lookup share one packed table; without integer dot products
# spark-edge's kernel (or PyTorch's) reads the rows themselves (vllm_methods/cpu_int8_table.py).
INT8_HEAD_COPIES = 1


def int8_head_copies() -> int:
    """Copies of the 8-bit table the head's GEMM keeps beside the rows, on this host."""
    packed = host_runs_packed_int8_gemm() and kernel_enabled("int8_packed_gemm")
    return INT8_HEAD_COPIES if host_has_int8_dot() and not packed else 0


def resident_weight_bytes(shape: ModelShape, weight_path: str, group: int) -> int:
    """Weight bytes the server holds once loaded, on this host."""
    stored = weight_bytes(shape, weight_path, group)
    if weight_path == "w4a16":
        return stored + int8_head_copies() * shape.vocab * shape.hidden
    if weight_path_spec(weight_path).quantization is not None:
        return stored
    if not host_has_bf16_gemm():
        return int(BF16_FACTOR_WITHOUT_BF16_HARDWARE * stored)
    return stored + int(BF16_TABLE_COPIES * BF16 * shape.vocab * shape.hidden)


# Load-time excess over steady state: peak - settled measured 13 MiB on bf16 and w4a16
# (vLLM's profiling run and our 2048-row repack chunks stay small).  Each path's weight fraction
# (spark_edge.registry) covers repack transients of larger tables.
LOAD_TRANSIENT_FIXED_BYTES = 16 * MiB

HEADROOM_FRACTION = 0.10
MIN_HEADROOM_BYTES = 128 * MiB
MIN_CONTEXT = 256
KV_BLOCK_TOKENS = 128  # vLLM allocates the CPU KV cache in whole blocks
# The prefill chunk (vLLM's max_num_batched_tokens, passed by serve): the most tokens in one step.
# vLLM's CPU server default is 2048; we ask for 512 because a request with `prompt_logprobs`
# materialises logits for every prompt token of the step (below): 2048 tokens would cost the
# default model ~1 GiB and Spark's 131072-word vocabulary ~3 GiB beyond the steady state.
# A 512-token prompt still prefills in one step; longer prompts take several.
PREFILL_CHUNK_TOKENS = 512
# What `serve` asks for when not told otherwise (`plan`, the bench's offline engine and its peer follow)
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_MAX_NUM_SEQS = 4
MIN_PREFILL_CHUNK = 128
# Transient bytes per (prompt token x vocabulary word) of a prompt_logprobs step: measured
# on bf16 SmolLM2 (vocab 49152) as the process tree's anonymous RSS peak over settled,
# +276 MiB for 512 tokens and +980 MiB for 2000 tokens in one 2048-token step (11.5 and
# 10.5 bytes: fp32 logits, their log-softmax and the ranks)
PROMPT_LOGPROBS_BYTES_PER_LOGIT = 12


@dataclass(frozen=True)
class MemoryPlan:
    weight_path: str
    ceiling_bytes: int
    headroom_bytes: int
    baseline_bytes: int
    weights_bytes: int
    kv_bytes: int
    kv_tokens: int
    activation_bytes: int
    load_transient_bytes: int
    logits_transient_bytes: int
    compile_transient_bytes: int  # the C++ compiler beside the engine when this start compiles; 0 when warm
    kv_cache_dtype: str  # "bf16" or "fp8" (planning/kv_dtype.py)
    max_model_len: int
    requested_max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    draft_tokens: int = 0  # n-gram speculation's drafts a sequence a step (planning/speculation.py)

    @property
    def steady_bytes(self) -> int:
        return self.baseline_bytes + self.weights_bytes + self.kv_bytes + self.activation_bytes

    @property
    def file_backed_bytes(self) -> int:
        """The weights once loaded: mapped from their file (runtime/mapped_weights.py), so the kernel
        counts them as file-backed RSS; the cgroup still charges their pages, so they stay in the sums."""
        return self.weights_bytes

    @property
    def steady_anon_bytes(self) -> int:
        return self.steady_bytes - self.file_backed_bytes

    @property
    def load_peak_bytes(self) -> int:
        return self.steady_bytes + self.load_transient_bytes + self.compile_transient_bytes

    @property
    def serving_peak_bytes(self) -> int:
        return self.steady_bytes + self.logits_transient_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.load_peak_bytes, self.serving_peak_bytes)

    @property
    def budget_bytes(self) -> int:
        return self.ceiling_bytes - self.headroom_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    @property
    def reduced_context(self) -> bool:
        return self.max_model_len < self.requested_max_model_len

    @property
    def reduced_prefill_chunk(self) -> bool:
        return self.max_num_batched_tokens < PREFILL_CHUNK_TOKENS

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(
            steady_bytes=self.steady_bytes,
            steady_anon_bytes=self.steady_anon_bytes,
            file_backed_bytes=self.file_backed_bytes,
            load_peak_bytes=self.load_peak_bytes,
            serving_peak_bytes=self.serving_peak_bytes,
            peak_bytes=self.peak_bytes,
            budget_bytes=self.budget_bytes,
            fits=self.fits,
            reduced_context=self.reduced_context,
            reduced_prefill_chunk=self.reduced_prefill_chunk,
        )
        return d

    def summary(self) -> str:
        def mib(b: int) -> str:
            return f"{b / MiB:.0f} MiB"

        compiler = self.compile_transient_bytes
        compiling = f" + compiler {mib(compiler)} (this start compiles)" if compiler else ""
        ctx = f"context {self.max_model_len}"
        if self.reduced_context:
            ctx += f" (reduced from {self.requested_max_model_len} to fit)"
        ctx += f", prefill chunk {self.max_num_batched_tokens} tokens"
        if self.reduced_prefill_chunk:
            ctx += f" (reduced from {PREFILL_CHUNK_TOKENS} to fit)"
        if self.draft_tokens:
            ctx += f", n-gram speculation up to {self.draft_tokens} drafts a sequence a step"
        return (
            f"{self.weight_path}: peak {mib(self.peak_bytes)}, steady {mib(self.steady_bytes)} "
            f"(baseline {mib(self.baseline_bytes)} + weights {mib(self.weights_bytes)} file-backed + KV "
            f"{mib(self.kv_bytes)} ({self.kv_cache_dtype}) for {self.kv_tokens} tokens + activations "
            f"{mib(self.activation_bytes)}; "
            f"load transient {mib(self.load_transient_bytes)}" + compiling + f", prompt-logprobs transient "
            f"{mib(self.logits_transient_bytes)}) under a ceiling of {mib(self.ceiling_bytes)} "
            f"with {mib(self.headroom_bytes)} headroom; {ctx}"
        )


class PlanRefused(SparkEdgeError):
    """The model cannot be served under the ceiling even at the minimum context."""

    exit_code = exit_codes.MEMORY

    def __init__(self, message: str, plan: MemoryPlan):
        super().__init__(message)
        self.plan = plan


def activation_bytes(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The widest step: a full prefill chunk through one layer, plus fp32 logits per sequence."""
    per_token = 2 * (4 * shape.hidden + 3 * shape.intermediate)  # bf16 residual, qkv, mlp in/out
    return max_num_batched_tokens * per_token + 2 * 4 * max_num_seqs * shape.vocab


def logits_transient_bytes(shape: ModelShape, max_num_batched_tokens: int) -> int:
    """A step whose request asked for prompt_logprobs: logits for every token of the chunk."""
    return max_num_batched_tokens * shape.vocab * PROMPT_LOGPROBS_BYTES_PER_LOGIT


def kv_bytes_for(
    shape: ModelShape,
    tokens: int,
    seqs: int = 1,
    in_flight_tokens: int = PREFILL_CHUNK_TOKENS,
    kv_dtype: str = "bf16",
) -> int:
    """KV cache for `seqs` sequences of `tokens` tokens: whole blocks, plus the one vLLM's block pool
    keeps as its null block (without it, a KV sized for one full-length sequence is refused at start:
    "estimated maximum model length is 3968" for 4096). Sliding-window layers are charged only their
    window plus the tokens in flight (ModelShape.kv_cache_bytes); CPU vLLM has one batch in flight
    (no async scheduling there), of up to max_num_batched_tokens (the prefill chunk)."""
    return shape.kv_cache_bytes(tokens, seqs, in_flight_tokens, KV_BLOCK_TOKENS, KV_DTYPE_BYTES[kv_dtype])


def _plan(
    shape: ModelShape,
    weight_path: str,
    group: int,
    ceiling: int,
    context: int,
    kv_tokens: int,
    requested: int,
    max_num_seqs: int,
    baseline: int,
    batched: int,
    compile_transient: int,
    kv_dtype: str,
    draft_tokens: int,
) -> MemoryPlan:
    weights = resident_weight_bytes(shape, weight_path, group)
    return MemoryPlan(
        weight_path=weight_path,
        ceiling_bytes=ceiling,
        headroom_bytes=max(MIN_HEADROOM_BYTES, int(HEADROOM_FRACTION * ceiling)),
        baseline_bytes=baseline,
        weights_bytes=weights,
        kv_bytes=kv_bytes_for(shape, context, kv_tokens // context, batched, kv_dtype),
        kv_tokens=kv_tokens,
        activation_bytes=activation_bytes(shape, batched, max_num_seqs),
        load_transient_bytes=LOAD_TRANSIENT_FIXED_BYTES
        + int(weight_path_spec(weight_path).load_transient_fraction * weights),
        logits_transient_bytes=logits_transient_bytes(shape, batched),
        compile_transient_bytes=compile_transient,
        kv_cache_dtype=kv_dtype,
        max_model_len=context,
        requested_max_model_len=requested,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        draft_tokens=draft_tokens,
    )


def _prefill_chunks(step_tokens: int) -> list[int]:
    """PREFILL_CHUNK_TOKENS halved down to MIN_PREFILL_CHUNK; `step_tokens`: the most one decode step carries
    (vLLM wants room for one token a sequence, and reserves speculation's drafts out of the chunk besides)."""
    chunks, chunk = [], PREFILL_CHUNK_TOKENS
    while chunk >= max(MIN_PREFILL_CHUNK, step_tokens):
        chunks.append(chunk)
        chunk //= 2
    return chunks or [step_tokens]


def make_plan(
    shape: ModelShape,
    weight_path: str,
    ceiling_bytes: int,
    max_model_len: int,
    max_num_seqs: int = 4,
    group: int = 32,
    layout: str = "engine",
    calibrated_baseline: int | None = None,
    compile_transient: int = 0,
    kv_dtype: str = "bf16",
    draft_tokens: int = 0,
) -> MemoryPlan:
    """The largest KV cache and context (up to what was asked) that fit; raises PlanRefused.

    `calibrated_baseline`: this host's measured runtime baseline (planning/calibration.py); the plan
    takes the larger of it and the constant. `compile_transient`: what compiling adds to the load peak
    when this start compiles (planning/compile_state.py); `kv_dtype`: "bf16" or "fp8"; `draft_tokens`: n-gram
    speculation's drafts a sequence a step (planning/speculation.py), whose runtime the baseline counts."""
    baseline = max(RUNTIME_BASELINE_BYTES[layout], calibrated_baseline or 0) + speculation.runtime_bytes(draft_tokens)
    context = max_model_len
    while True:
        # KV for every sequence at full length, down to one full-length sequence
        for seqs in range(max_num_seqs, 0, -1):
            for batched in _prefill_chunks(max_num_seqs * (1 + draft_tokens)):
                plan = _plan(
                    shape,
                    weight_path,
                    group,
                    ceiling_bytes,
                    context,
                    context * seqs,
                    max_model_len,
                    max_num_seqs,
                    baseline,
                    batched,
                    compile_transient,
                    kv_dtype,
                    draft_tokens,
                )
                if plan.fits:
                    return plan
        if context <= MIN_CONTEXT:
            raise PlanRefused(
                f"does not fit: even a {context}-token context needs a peak of "
                f"{plan.peak_bytes / MiB:.0f} MiB, and the budget is {plan.budget_bytes / MiB:.0f} MiB "
                f"(ceiling {ceiling_bytes / MiB:.0f} MiB minus {plan.headroom_bytes / MiB:.0f} MiB headroom). "
                f"{plan.summary()}",
                plan,
            )
        context = max(MIN_CONTEXT, context // 2)

"""What a server runs with, resolved once for `spark-edge serve` / `warm` (and so for the bench's arms and
the images' warm-up, which run them) and for `spark-edge plan`.

- resolve_weight_path: the path asked for (`auto`: the probe's choice for this host and this model's shape,
  with --priority), refused where the host cannot run it.
- resolve_plan: the weight path a built checkpoint records (else that choice), the ceiling a server started
  from this process would have (serving_ceiling: --memory-limit, or what the probe finds free plus what this
  process holds), and the memory plan on it: the group size the config records and this host's calibrated
  baseline, and the C++ compiler where this start will compile (compile_state.py). So the limit
  `spark-edge plan` prints for a pod is the one `serve` will plan under.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from spark_edge import registry
from spark_edge.checkpoints.served import CheckpointKind, checkpoint_kind
from spark_edge.checkpoints.sources import model_id
from spark_edge.paths import checkpoint_dir
from spark_edge.planning.calibration import calibrated_baseline
from spark_edge.planning.ceiling import Ceiling, OwnMemory, serving_ceiling
from spark_edge.planning.compile_state import COMPILER_TRANSIENT_BYTES, compile_cache_root, compile_key, is_compiled
from spark_edge.planning.kv_dtype import fp8_problem
from spark_edge.planning.memory_plan import MemoryPlan, MiB, PlanRefused, make_plan
from spark_edge.planning.model_shape import ModelShape
from spark_edge.probe.device import DeviceProfile
from spark_edge.probe.measured_paths import evidence
from spark_edge.probe.weight_path_choice import WeightPathChoice, select_weight_path
from spark_edge.runtime.compile_cache import cache_stamp


def quant_group(config: dict, weight_path: str, shape: ModelShape) -> int:
    """The 4-bit group a built checkpoint records; for a source not built yet, what its writer would choose."""
    if "group_size" in config.get("quantization_config", {}):
        return int(config["quantization_config"]["group_size"])
    default = registry.weight_path(weight_path).default_group
    return default(k for _, k in shape.linear_shapes()) if default else 0  # 0: not a grouped path


def serving_plan(
    device: DeviceProfile,
    config: dict,
    weight_path: str,
    ceiling: Ceiling,
    max_model_len: int,
    max_num_seqs: int,
    layout: str,
    kv_dtype: str = "bf16",
    compiled: Callable[[MemoryPlan], bool] = lambda plan: False,
    draft_tokens: int = 0,
) -> MemoryPlan:
    """Raises PlanRefused, its message led by where the ceiling came from, or SettingRefused /
    UnsupportedHostError for an fp8 KV cache this model or host cannot run. `kv_dtype`: auto, bf16 or fp8
    (kv_dtype.py). `compiled`: whether the cache holds a plan's graph; a plan whose graph it does not hold
    counts the compiler. `draft_tokens`: speculation's per sequence and step (speculation.py)."""
    shape = ModelShape.from_config(config)
    baseline = calibrated_baseline(sorted(device.features), weight_path, layout)
    group = quant_group(config, weight_path, shape)

    def plan_for(kv: str) -> MemoryPlan:
        def plan(compile_transient: int) -> MemoryPlan:
            return make_plan(
                shape, weight_path, ceiling.bytes, max_model_len, max_num_seqs, group, layout, baseline,
                compile_transient, kv, draft_tokens,
            )  # fmt: skip

        warm = plan(0)
        if compiled(warm):
            return warm
        cold = plan(COMPILER_TRANSIENT_BYTES)
        # what an earlier start under this ceiling compiled: its graph is in the cache, this start loads it
        return replace(cold, compile_transient_bytes=0) if compiled(cold) else cold

    fp8 = fp8_problem(device, shape)
    if kv_dtype == "fp8" and fp8 is not None:
        raise fp8
    try:
        if kv_dtype != "auto":
            return plan_for(kv_dtype)
        return _auto_kv_plan(plan_for, fp8_runs=fp8 is None)
    except PlanRefused as exc:  # before vLLM is even imported: nothing to OOM-kill, nothing to crash-loop
        raise PlanRefused(f"{ceiling.describe()}: {exc}", exc.plan) from None


def _auto_kv_plan(plan_for: Callable[[str], MemoryPlan], fp8_runs: bool) -> MemoryPlan:
    """bf16, unless it serves a shorter context than asked (or none) and fp8, where it runs, serves longer."""
    try:
        bf16 = plan_for("bf16")
    except PlanRefused:
        if not fp8_runs:
            raise
        return plan_for("fp8")
    if not (bf16.reduced_context and fp8_runs):
        return bf16
    try:
        fp8 = plan_for("fp8")
    except PlanRefused:
        return bf16
    return fp8 if fp8.max_model_len > bf16.max_model_len else bf16


def resolve_weight_path(device: DeviceProfile, priority: str, setting: str, model: Path | None) -> WeightPathChoice:
    """`setting`: --weight-path, `auto` or a path's name; `model`: what was asked for (None: the default model),
    whose shape decides where the bench measured paths apart (measured_paths.py). Raises UnsupportedHostError."""
    return select_weight_path(
        device, priority, None if setting == "auto" else setting, lambda isa: evidence(isa, shape_config(model))
    )


def shape_config(model: Path | None) -> dict:
    """`model`'s config, from a checkpoint already built from it in the data folder where there is one (a build
    keeps its source's geometry; parsing a GGUF takes seconds a warm start does not have)."""
    if model is None or not (Path(model) / "config.json").is_file():
        for path in registry.WEIGHT_PATHS:
            built = checkpoint_dir(model_id(model), path) / "config.json"
            if built.is_file():
                return json.loads(built.read_text())
    return model_config(model)


@dataclass(frozen=True)
class ResolvedPlan:
    weight_path: str  # of the checkpoint served
    ceiling: Ceiling
    plan: MemoryPlan


def resolve_plan(
    device: DeviceProfile,
    choice: WeightPathChoice,
    model: Path | None,
    config: dict,
    memory_limit: int | None,
    max_model_len: int,
    max_num_seqs: int,
    layout: str,
    own: OwnMemory | None = None,
    kv_dtype: str = "auto",
    kind: CheckpointKind | None = None,
    draft_tokens: int = 0,
) -> ResolvedPlan:
    """`model`: what was asked for, or the checkpoint built from it; `config`: its config.json. Raises
    PlanRefused. `own`: this process's memory when the probe read the cgroup (default: now)."""
    built = (kind or checkpoint_kind(model)).weight_path
    path = built or choice.name
    served = Path(model) if built else checkpoint_dir(model_id(model), path)  # the folder serve hands to vLLM
    ceiling = serving_ceiling(device.memory, memory_limit, own)
    root, stamp = compile_cache_root(path), cache_stamp(sorted(device.features), path)

    def compiled(plan: MemoryPlan) -> bool:
        return is_compiled(root, stamp, plan_compile_key(served, plan))

    plan = serving_plan(
        device, config, path, ceiling, max_model_len, max_num_seqs, layout, kv_dtype, compiled, draft_tokens
    )
    return ResolvedPlan(path, ceiling, plan)


def smallest_ceiling(
    device: DeviceProfile,
    choice: WeightPathChoice,
    model: Path | None,
    config: dict,
    max_model_len: int,
    max_num_seqs: int,
    layout: str,
    lowest: int = 256 * MiB,
    highest: int = 8192 * MiB,
) -> ResolvedPlan:
    """The plan at the smallest ceiling, to the MiB, under which resolve_plan accepts these options: the
    memory limit the plan promises to hold. Raises PlanRefused when even `highest` is refused."""

    def plan(mib: int) -> ResolvedPlan | None:
        try:
            return resolve_plan(device, choice, model, config, mib * MiB, max_model_len, max_num_seqs, layout)
        except PlanRefused:
            return None

    lo, hi = lowest // MiB, highest // MiB  # the invariant: refused at lo, accepted at hi
    accepted = plan(hi)
    if accepted is None:
        resolve_plan(device, choice, model, config, highest, max_model_len, max_num_seqs, layout)  # raises
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if (found := plan(mid)) is not None:
            hi, accepted = mid, found
        else:
            lo = mid
    assert accepted is not None
    return accepted


def plan_compile_key(checkpoint: Path, plan: MemoryPlan) -> str:
    """The compile key of a server of `checkpoint` (the folder vLLM loads) run with `plan`."""
    folder = str(checkpoint.expanduser().absolute())
    decided = (plan.max_model_len, plan.max_num_seqs, plan.max_num_batched_tokens, plan.kv_cache_dtype)
    return compile_key(folder, plan.weight_path, *decided, plan.draft_tokens)


def model_config(model: Path | None) -> dict:
    """config.json of a built or HF checkpoint, or the config a GGUF converts to."""
    if model is not None and (Path(model) / "config.json").is_file():
        return json.loads((Path(model) / "config.json").read_text())
    from spark_edge.checkpoints.sources import open_source

    return open_source(model).hf_config()

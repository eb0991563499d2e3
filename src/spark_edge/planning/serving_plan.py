"""What a server runs with, resolved once for `spark-edge serve` / `warm` (and so for the bench's arms and
the images' warm-up, which run them) and for `spark-edge plan`.

- resolve_weight_path: the path asked for (`auto`: the probe's choice for this host, with --priority),
  refused where the host cannot run it.
- resolve_plan: the weight path a built checkpoint records (else that choice), the ceiling a server started
  from this process would have (serving_ceiling: --memory-limit, or what the probe finds free plus what this
  process holds), and the memory plan on it: the group size the config records and this host's calibrated
  baseline, and the C++ compiler where this start will compile (compile_state.py). So the limit
  `spark-edge plan` prints for a pod is the one `serve` will plan under.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from spark_edge import registry
from spark_edge.checkpoints.sources import model_id
from spark_edge.errors import PlanRefused
from spark_edge.paths import checkpoint_dir
from spark_edge.planning.calibration import calibrated_baseline
from spark_edge.planning.ceiling import Ceiling, serving_ceiling
from spark_edge.planning.compile_state import COMPILER_TRANSIENT_BYTES, compile_cache_root, compile_key, is_compiled
from spark_edge.planning.memory_plan import MemoryPlan, make_plan
from spark_edge.planning.model_shape import ModelShape
from spark_edge.probe.device import DeviceProfile
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
    compiled: Callable[[MemoryPlan], bool] = lambda plan: False,
) -> MemoryPlan:
    """Raises PlanRefused, its message led by where the ceiling came from. `compiled`: whether the cache
    holds a plan's graph; a plan whose graph it does not hold counts the compiler."""
    shape = ModelShape.from_config(config)
    baseline = calibrated_baseline(sorted(device.features), weight_path, layout)
    group = quant_group(config, weight_path, shape)

    def plan(compile_transient: int) -> MemoryPlan:
        return make_plan(
            shape, weight_path, ceiling.bytes, max_model_len, max_num_seqs, group, layout, baseline, compile_transient
        )

    try:
        warm = plan(0)
        if compiled(warm):
            return warm
        cold = plan(COMPILER_TRANSIENT_BYTES)
        # what an earlier start under this ceiling compiled: its graph is in the cache, this start loads it
        return replace(cold, compile_transient_bytes=0) if compiled(cold) else cold
    except PlanRefused as exc:  # before vLLM is even imported: nothing to OOM-kill, nothing to crash-loop
        raise PlanRefused(f"{ceiling.describe()}: {exc}", exc.plan) from None


def resolve_weight_path(device: DeviceProfile, priority: str, setting: str) -> WeightPathChoice:
    """`setting`: --weight-path, `auto` or a path's name. Raises UnsupportedHostError."""
    return select_weight_path(device, priority, None if setting == "auto" else setting)


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
    own_anon: int | None = None,
) -> ResolvedPlan:
    """`model`: what was asked for, or the checkpoint built from it; `config`: its config.json. Raises
    PlanRefused. `own_anon`: this process's anonymous RSS when the probe read the cgroup (default: now)."""
    from spark_edge.serving.checkpoint import built_weight_path  # (serving imports planning)

    built = built_weight_path(model)
    path = built or choice.name
    served = Path(model) if built else checkpoint_dir(model_id(model), path)  # the folder serve hands to vLLM
    ceiling = serving_ceiling(device.memory, memory_limit, own_anon)
    root, stamp = compile_cache_root(path), cache_stamp(sorted(device.features), path)

    def compiled(plan: MemoryPlan) -> bool:
        return is_compiled(root, stamp, plan_compile_key(served, plan))

    plan = serving_plan(device, config, path, ceiling, max_model_len, max_num_seqs, layout, compiled)
    return ResolvedPlan(path, ceiling, plan)


def plan_compile_key(checkpoint: Path, plan: MemoryPlan) -> str:
    """The compile key of a server of `checkpoint` (the folder vLLM loads) run with `plan`."""
    folder = str(checkpoint.expanduser().absolute())
    return compile_key(folder, plan.weight_path, plan.max_model_len, plan.max_num_seqs, plan.max_num_batched_tokens)

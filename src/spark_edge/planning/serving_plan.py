"""What a server runs with, resolved once for `spark-edge serve` / `warm` (and so for the bench's arms and
the images' warm-up, which run them) and for `spark-edge plan`.

- resolve_weight_path: the path asked for (`auto`: the probe's choice for this host, with --priority),
  refused where the host cannot run it.
- resolve_plan: the weight path a built checkpoint records (else that choice), the ceiling a server started
  from this process would have (serving_ceiling: --memory-limit, or what the probe finds free plus what this
  process holds), and the memory plan on it: the group size the config records and this host's calibrated
  baseline. So the limit `spark-edge plan` prints for a pod is the one `serve` will plan under.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spark_edge import registry
from spark_edge.errors import PlanRefused
from spark_edge.planning.calibration import calibrated_baseline
from spark_edge.planning.ceiling import Ceiling, serving_ceiling
from spark_edge.planning.memory_plan import MemoryPlan, make_plan
from spark_edge.planning.model_shape import ModelShape
from spark_edge.probe.device import DeviceProfile
from spark_edge.probe.weight_path_choice import WeightPathChoice, select_weight_path


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
) -> MemoryPlan:
    """Raises PlanRefused, its message led by where the ceiling came from."""
    shape = ModelShape.from_config(config)
    try:
        return make_plan(
            shape,
            weight_path,
            ceiling.bytes,
            max_model_len,
            max_num_seqs,
            quant_group(config, weight_path, shape),
            layout,
            calibrated_baseline(sorted(device.features), weight_path, layout),
        )
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

    path = built_weight_path(model) or choice.name
    ceiling = serving_ceiling(device.memory, memory_limit, own_anon)
    return ResolvedPlan(path, ceiling, serving_plan(device, config, path, ceiling, max_model_len, max_num_seqs, layout))

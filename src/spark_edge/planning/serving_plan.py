"""The memory plan a server runs with: one computation for `spark-edge serve` / `warm` and `spark-edge plan`.

Both take the weight path a built checkpoint records (or the probe's choice, with --priority), the group
size its config records, the ceiling a server started from this process would have (serving_ceiling:
--memory-limit, or what the probe finds free plus what this process holds), and this host's calibrated
baseline. So the limit `spark-edge plan` prints for a pod is the one `serve` will plan under.
"""

from __future__ import annotations

from spark_edge import registry
from spark_edge.planning.calibration import calibrated_baseline
from spark_edge.planning.ceiling import Ceiling
from spark_edge.errors import PlanRefused
from spark_edge.planning.memory_plan import MemoryPlan, make_plan
from spark_edge.planning.model_shape import ModelShape
from spark_edge.probe.device import DeviceProfile


def quant_group(config: dict, weight_path: str, shape: ModelShape) -> int:
    """The 4-bit group a built checkpoint records; for a source not built yet, what its writer would choose."""
    if "group_size" in config.get("quantization_config", {}):
        return int(config["quantization_config"]["group_size"])
    default = registry.weight_path(weight_path).default_group
    return default(k for _, k in shape.linear_shapes()) if default else 0  # 0: not a grouped path


def serving_plan(device: DeviceProfile, config: dict, weight_path: str, ceiling: Ceiling, max_model_len: int,
                 max_num_seqs: int, layout: str) -> MemoryPlan:
    """Raises PlanRefused, its message led by where the ceiling came from."""
    shape = ModelShape.from_config(config)
    try:
        return make_plan(shape, weight_path, ceiling.bytes, max_model_len, max_num_seqs,
                         quant_group(config, weight_path, shape), layout,
                         calibrated_baseline(sorted(device.features), weight_path, layout))
    except PlanRefused as exc:  # before vLLM is even imported: nothing to OOM-kill, nothing to crash-loop
        raise PlanRefused(f"{ceiling.describe()}: {exc}", exc.plan) from None

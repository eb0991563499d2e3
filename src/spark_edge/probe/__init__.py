"""The device probe: what this process may use (ISA, cores, memory) and which weight path fits.

Everything is read below an injectable root folder, so tests point it at fixture trees of
/proc and /sys; only the process's own state (architecture, affinity, AMX permission) is
asked of the kernel directly, and only when the root is the real "/".
"""

from spark_edge.errors import UnsupportedHostError
from spark_edge.probe.device import DeviceProfile, probe_device
from spark_edge.probe.images import IMAGES, image_isa_problem, recommended_image
from spark_edge.probe.weight_path_choice import PRIORITIES, WEIGHT_PATHS, WeightPathChoice, select_weight_path

__all__ = [
    "DeviceProfile",
    "IMAGES",
    "PRIORITIES",
    "UnsupportedHostError",
    "WEIGHT_PATHS",
    "WeightPathChoice",
    "image_isa_problem",
    "probe_device",
    "recommended_image",
    "select_weight_path",
]

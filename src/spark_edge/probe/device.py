"""The device profile: one frozen record of what this process may use."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spark_edge.probe.amx import request_amx_permission
from spark_edge.probe.cpu_features import probe_cpu_features
from spark_edge.probe.cpus import CpuBudget, probe_cpus
from spark_edge.probe.memory import MemoryBudget, probe_memory

# Other spellings of the two architectures spark-edge serves on.
_MACHINE_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


@dataclass(frozen=True)
class DeviceProfile:
    machine: str  # the running process's architecture: "x86_64", "aarch64", or as the kernel names it
    cpu_model: str | None
    features: frozenset[str]  # ISA extensions that matter to vLLM, kernel spellings ("avx512f", "asimddp")
    feature_source: str  # where features came from (cpu_features.CpuFeatures.source)
    amx_usable: bool  # amx_tile present and the kernel let this process use tile data
    cpus: CpuBudget
    memory: MemoryBudget

    def has(self, *names: str) -> bool:
        return all(n in self.features for n in names)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, with stable keys (the `probe --json` contract)."""
        return {
            "machine": self.machine,
            "cpu_model": self.cpu_model,
            "features": sorted(self.features),
            "feature_source": self.feature_source,
            "amx_usable": self.amx_usable,
            "cpus": {
                "affinity": list(self.cpus.affinity),
                "cgroup_quota": self.cpus.cgroup_quota,
                "usable_cores": self.cpus.usable_cores,
                "numa_nodes": [{"node": n.node, "cpus": list(n.cpus)} for n in self.cpus.numa_nodes],
            },
            "memory": {f"{key}_bytes": value for key, value in asdict(self.memory).items()},
        }


def probe_device(root: Path = Path("/"), machine: str | None = None) -> DeviceProfile:
    """Probe the machine whose /proc and /sys are under `root`.

    `machine` is the architecture of the process that will run vLLM. It defaults to this
    process's (os.uname), which is only right for the real root: under qemu-user, /proc/cpuinfo
    describes the host, so the architecture is never taken from files. A fixture root must
    say its machine.

    AMX permission is asked of the kernel only for the real root on x86_64. For any other root
    it is taken from the flags (amx_tile present = usable): a fixture tree has no process to ask.
    """
    live = _is_real_root(root)
    if machine is None:
        if not live:
            raise ValueError(f"probe_device({root}): pass machine= for a root other than '/'")
        machine = os.uname().machine
    machine = _MACHINE_ALIASES.get(machine.lower(), machine.lower())
    features = probe_cpu_features(root, machine)
    amx_flagged = machine == "x86_64" and "amx_tile" in features.names
    return DeviceProfile(
        machine=machine,
        cpu_model=features.model,
        features=features.names,
        feature_source=features.source,
        amx_usable=amx_flagged and (request_amx_permission() if live else True),
        cpus=probe_cpus(root, live),
        memory=probe_memory(root),
    )


def _is_real_root(root: Path) -> bool:
    return Path(root).resolve() == Path("/")


def host_line(profile: DeviceProfile | None = None) -> str:
    """The host a measurement belongs to: CPU model, usable cores, ISA features."""
    profile = profile or probe_device()
    return (
        f"{profile.cpu_model or 'unknown CPU'}, {profile.cpus.usable_cores} usable cores, "
        f"features: {' '.join(sorted(profile.features)) or 'none'}"
    )

"""`spark-edge probe`: print the device profile and the weight path chosen for it."""

from __future__ import annotations

import json
from pathlib import Path

import click

from spark_edge.errors import UnsupportedHostError
from spark_edge.probe.device import DeviceProfile, probe_device
from spark_edge.probe.measured_paths import Evidence, evidence
from spark_edge.probe.weight_path_choice import PRIORITIES, WEIGHT_PATHS, WeightPathChoice, select_weight_path

JSON_VERSION = 1  # bump when a key of `probe --json` changes meaning or disappears


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable keys).")
@click.option(
    "--priority",
    type=click.Choice(PRIORITIES),
    default="speed",
    show_default=True,
    help="speed: fastest path; fidelity: keep bf16 activations.",
)
@click.option(
    "--weight-path",
    type=click.Choice(WEIGHT_PATHS),
    default=None,
    help="Check an explicit weight path instead of choosing one.",
)
# Probing a /proc + /sys tree collected from another machine (or a test fixture); the
# architecture is the process's, not the files', so it must be given with --root.
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=Path("/"), hidden=True)
@click.option("--machine", default=None, hidden=True)
def probe(as_json: bool, priority: str, weight_path: str | None, root: Path, machine: str | None) -> None:
    """Show what this machine offers vLLM and which weight path fits it (for the default model)."""
    if machine is None and root.resolve() != Path("/"):
        raise click.UsageError("--root needs --machine (the architecture of the process that will serve)")
    profile = probe_device(root, machine)
    try:
        choice: WeightPathChoice | None = select_weight_path(profile, priority, weight_path, _default_model_evidence)
        error = None
    except UnsupportedHostError as exc:
        choice, error = None, str(exc)
    if as_json:
        click.echo(json.dumps(_as_json(profile, priority, choice, error), indent=2))
    else:
        click.echo(_table(profile, choice))
    if error is not None:
        raise UnsupportedHostError(error)  # after the table: what the host has, then why it is refused


def _default_model_evidence(isa: str) -> Evidence | None:
    """What the bench measured on this host class for the default model's shape (`serve` asks for its model)."""
    from spark_edge.checkpoints.sources import open_source

    return evidence(isa, open_source(None).hf_config())


def _as_json(profile: DeviceProfile, priority: str, choice: WeightPathChoice | None, error: str | None) -> dict:
    return {
        "version": JSON_VERSION,
        "device": profile.as_dict(),
        "priority": priority,
        "weight_path": None
        if choice is None
        else {
            "name": choice.name,
            "reason": choice.reason,
            "verified": choice.verified,
            "notes": list(choice.notes),
        },
        "error": error,
    }


def _table(profile: DeviceProfile, choice: WeightPathChoice | None) -> str:
    cpus, mem = profile.cpus, profile.memory
    quota = "none" if cpus.cgroup_quota is None else f"{cpus.cgroup_quota:g} CPUs"
    numa = len(cpus.numa_nodes) or "unknown"
    limit = "none" if mem.cgroup_limit is None else _size(mem.cgroup_limit)
    used = "unknown" if mem.cgroup_used is None else _size(mem.cgroup_used)
    rows = [
        ("machine", f"{profile.machine} ({profile.cpu_model or 'unknown model'})"),
        ("features", f"{' '.join(sorted(profile.features)) or 'none that vLLM uses'} (from {profile.feature_source})"),
    ]
    if profile.machine == "x86_64":
        rows.append(("AMX usable", "yes" if profile.amx_usable else "no"))
    rows += [
        (
            "usable cores",
            f"{cpus.usable_cores} (affinity {_cpu_list(cpus.affinity)}; cgroup quota {quota}; NUMA nodes {numa})",
        ),
        (
            "memory ceiling",
            f"{_size(mem.ceiling)} (host {_size(mem.host_total)} total, "
            f"{_size(mem.host_available)} available; cgroup limit {limit}, used {used})",
        ),
    ]
    if choice is None:
        rows.append(("weight path", "none: this host is not supported"))
    else:
        rows.append(("weight path", f"{choice.name} ({'verified' if choice.verified else 'unverified'})"))
        rows.append(("  why", choice.reason))
        rows += [("  note", note) for note in choice.notes]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _cpu_list(cpus: tuple[int, ...]) -> str:
    """Back to the kernel's compact form: (0, 1, 2, 5) -> "0-2,5"."""
    ranges: list[str] = []
    start = prev = None
    for cpu in cpus:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    if start is not None:
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(ranges) or "none"

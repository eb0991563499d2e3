"""Where this process's cgroup for one controller (cpu, memory) lives under /sys/fs/cgroup.

/proc/self/cgroup names the cgroup path per hierarchy: v1 lines read "4:cpu,cpuacct:/docker/abc",
the v2 unified line reads "0::/path". /proc/self/mountinfo says where each hierarchy is mounted
and which part of it the mount shows (its root), which differs between a container with a
cgroup namespace ("/" mounted, path "/") and one without ("/docker/abc" mounted, path
"/docker/abc"). When mountinfo does not help, the usual /sys/fs/cgroup layout is assumed.

Limits of every ancestor apply too (a systemd slice, a Kubernetes pod), so the answer is the
process's cgroup folder followed by each parent up to the mount point.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from spark_edge.probe.procfs import read_text

CGROUP_MOUNT = "sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupDirs:
    version: int  # 1 or 2: the files differ (cpu.max vs cpu.cfs_quota_us, ...)
    dirs: tuple[Path, ...]  # the process's cgroup first, then each ancestor up to the mount point


@dataclass(frozen=True)
class _Membership:
    hierarchy: str
    controllers: frozenset[str]
    path: str


@dataclass(frozen=True)
class _Mount:
    root: str
    mount_point: str
    fstype: str
    super_options: frozenset[str]


def cgroup_dirs(root: Path, controller: str) -> CgroupDirs | None:
    """The cgroup folders whose `controller` files bound this process, or None without cgroups."""
    text = read_text(root, "proc/self/cgroup")
    if text is None:
        return None
    memberships = _parse_proc_cgroup(text)
    mounts = _parse_mountinfo(read_text(root, "proc/self/mountinfo") or "")
    # A controller listed on a v1 line is managed there (hybrid hosts mount an empty v2
    # hierarchy beside the v1 ones); otherwise it lives in the v2 unified hierarchy.
    for m in memberships:
        if controller in m.controllers:
            mount = _find_mount(mounts, "cgroup", controller, m.path)
            mount_dir = _mount_dir(root, mount) if mount else _v1_fallback_dir(root, m.controllers, controller)
            return CgroupDirs(1, _dirs_for(root, mount_dir, mount.root if mount else "/", m.path))
    for m in memberships:
        if m.hierarchy == "0" and not m.controllers:
            mount = _find_mount(mounts, "cgroup2", None, m.path)
            mount_dir = _mount_dir(root, mount) if mount else root / CGROUP_MOUNT
            return CgroupDirs(2, _dirs_for(root, mount_dir, mount.root if mount else "/", m.path))
    return None


def _parse_proc_cgroup(text: str) -> list[_Membership]:
    memberships = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        # "name=systemd" hierarchies carry no resource controller.
        names = frozenset(c for c in controllers.split(",") if c and not c.startswith("name="))
        if hierarchy != "0" and not names:
            continue
        memberships.append(_Membership(hierarchy, names, path.strip()))
    return memberships


def _parse_mountinfo(text: str) -> list[_Mount]:
    # "36 35 0:30 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw,relatime master:1 - cgroup cgroup rw,cpu,cpuacct"
    # The optional fields before " - " vary in number, so split there first.
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        before, after = left.split(), right.split()
        if not sep or len(before) < 5 or len(after) < 3:
            continue
        mounts.append(_Mount(_unescape(before[3]), _unescape(before[4]), after[0], frozenset(after[2].split(","))))
    return mounts


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _find_mount(mounts: list[_Mount], fstype: str, controller: str | None, path: str) -> _Mount | None:
    candidates = [m for m in mounts if m.fstype == fstype and (controller is None or controller in m.super_options)]
    # Prefer a mount that shows the process's own cgroup (bind mounts of other subtrees exist).
    for m in candidates:
        if _relative(path, m.root) is not None:
            return m
    return candidates[0] if candidates else None


def _mount_dir(root: Path, mount: _Mount) -> Path:
    return root / mount.mount_point.lstrip("/")


def _v1_fallback_dir(root: Path, controllers: frozenset[str], controller: str) -> Path:
    # Distributions mount co-mounted controllers as "cpu,cpuacct" with a "cpu" symlink beside it.
    base = root / CGROUP_MOUNT
    for name in (",".join(sorted(controllers)), controller):
        if (base / name).is_dir():
            return base / name
    return base / controller


def _relative(path: str, mount_root: str) -> str | None:
    """`path` relative to the part of the hierarchy a mount shows, or None when outside it."""
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root:
        return ""
    if path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root.rstrip("/")) + 1 :]
    return None


def _dirs_for(root: Path, mount_dir: Path, mount_root: str, path: str) -> tuple[Path, ...]:
    rel = _relative(path, mount_root)
    leaf = mount_dir / rel if rel else mount_dir
    if not leaf.is_dir():
        # The path is not visible from here (e.g. a container that sees the host's path in
        # /proc/self/cgroup but has its own cgroup mounted at /sys/fs/cgroup): its mount is
        # the best view of the process's own limits.
        leaf = mount_dir
    dirs = [leaf]
    while dirs[-1] != mount_dir and mount_dir in dirs[-1].parents:
        dirs.append(dirs[-1].parent)
    return tuple(dirs)

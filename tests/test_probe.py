"""The device probe and the weight-path choice, on fixture trees of real machines and on this host.

Fixture trees under tests/fixtures/probe/<device>/ hold the /proc and /sys files of one machine;
container_v1 and container_v2 are overlays copied on top of a host tree. ARM auxv images are
binary, so they are written here with struct.pack from the hwcap values the kernel reports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from spark_edge import exit_codes
from spark_edge.cli import main
from spark_edge.probe import (
    UnsupportedHostError,
    image_isa_problem,
    probe_device,
    recommended_image,
    select_weight_path,
)
from spark_edge.probe.cpu_features import decode_arm_hwcaps, read_auxv_hwcaps
from spark_edge.probe.cpus import usable_cores
from spark_edge.probe.isa import isa_label

FIXTURES = Path(__file__).parent / "fixtures" / "probe"
GIB = 1 << 30
MIB = 1 << 20

AT_NULL, AT_PAGESZ, AT_HWCAP, AT_CLKTCK, AT_HWCAP2 = 0, 6, 16, 17, 26
# (AT_HWCAP, AT_HWCAP2) as the kernel reports them; each matches the Features line beside it.
GRAVITON3_HWCAPS = (0xDFFFFFFF, 0x1F201)  # fp asimd ... asimddp sha512 sve ... i8mm bf16 dgh rng
PI5_HWCAPS = (0x119FFF, 0x0)  # fp asimd ... lrcpc dcpop asimddp
GRAVITON4_HWCAPS = (0xFFF3FFFF, 0x3F3BF)  # Neoverse V2: adds sve2


def device_tree(tmp_path: Path, device: str, *overlays: str, files: dict[str, str | bytes] | None = None) -> Path:
    """A copy of a device's fixture tree, with overlays copied on top and extra files written in."""
    root = tmp_path / "root"
    for layer in (device, *overlays):
        shutil.copytree(FIXTURES / layer, root, dirs_exist_ok=True)
    for rel, content in (files or {}).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def auxv(hwcap: int, hwcap2: int) -> bytes:
    entries = [(AT_PAGESZ, 4096), (AT_HWCAP, hwcap), (AT_CLKTCK, 100), (AT_HWCAP2, hwcap2), (AT_NULL, 0)]
    return b"".join(struct.pack("=QQ", key, value) for key, value in entries)


def cpuinfo_features_line(device: str) -> set[str]:
    for line in (FIXTURES / device / "proc/cpuinfo").read_text().splitlines():
        if line.startswith("Features"):
            return set(line.split(":", 1)[1].split())
    raise AssertionError(f"{device} has no Features line")


# ----------------------------------------------------------------------------- x86 devices


def test_sapphire_rapids_with_amx_and_no_measurement_gets_w4a16(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "sapphire_rapids"), machine="x86_64")
    assert profile.machine == "x86_64"
    assert profile.cpu_model == "Intel(R) Xeon(R) Platinum 8488C"
    assert profile.features == {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512dq",
        "avx512vl",
        "avx512_bf16",
        "avx512_vnni",
        "avx_vnni",
        "amx_tile",
        "amx_bf16",
        "amx_int8",
    }
    assert profile.amx_usable
    choice = select_weight_path(profile)  # nothing measured for the model: int8 activations are not assumed
    assert (choice.name, choice.verified, choice.notes) == ("w4a16", True, ())
    assert "not both measured on this model shape" in choice.reason


def test_fidelity_priority_on_amx_prefers_w4a16(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "sapphire_rapids"), machine="x86_64")
    choice = select_weight_path(profile, priority="fidelity")
    assert (choice.name, choice.verified) == ("w4a16", True)
    assert "fidelity" in choice.reason


def test_amx_flag_without_kernel_permission_falls_back_to_w4a16(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "sapphire_rapids"), machine="x86_64")
    refused = dataclasses.replace(profile, amx_usable=False)
    choice = select_weight_path(refused)
    assert choice.name == "w4a16"
    assert "did not let this process use it" in choice.reason


def test_zen4_avx512_without_amx_gets_w4a16(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "zen4"), machine="x86_64")
    assert profile.cpu_model == "AMD EPYC 9R14"
    assert profile.features == {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512dq",
        "avx512vl",
        "avx512_bf16",
        "avx512_vnni",
    }
    assert not profile.amx_usable
    choice = select_weight_path(profile)
    assert (choice.name, choice.verified, choice.notes) == ("w4a16", True, ())
    assert "AVX-512" in choice.reason and "lacks amx_tile, amx_int8" in choice.reason


def test_haswell_avx2_only_gets_w4a16_on_the_avx2_kernels(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "haswell"), machine="x86_64")
    assert profile.features == {"avx2", "fma", "f16c"}
    choice = select_weight_path(profile)
    assert (choice.name, choice.verified) == ("w4a16", True)
    assert "AVX2" in choice.reason
    assert any("no native bf16" in note for note in choice.notes)


def test_w4a8_is_refused_without_avx512_before_vllm_loads(tmp_path: Path) -> None:
    """vLLM's _C_AVX2 has no GPTQ kernel (cpu_gemm_wna16): on an AMD EPYC Zen 3 the engine died at its first
    forward with an AttributeError; now serve exits 4 naming w4a16."""
    profile = probe_device(device_tree(tmp_path, "haswell"), machine="x86_64")
    with pytest.raises(UnsupportedHostError, match="w4a8 runs vLLM's GPTQ kernels.*serve w4a16"):
        select_weight_path(profile, explicit="w4a8")
    zen4 = probe_device(device_tree(tmp_path / "zen4", "zen4"), machine="x86_64")
    assert select_weight_path(zen4, explicit="w4a8").name == "w4a8"  # its W4A16 vector kernel, with a note


def test_sandy_bridge_without_avx2_is_refused(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "sandy_bridge"), machine="x86_64")
    assert profile.features == set()  # avx only: none of the flags vLLM's kernels need
    with pytest.raises(UnsupportedHostError, match="lacks avx2, fma, f16c") as refused:
        select_weight_path(profile)
    assert "Haswell" in str(refused.value)  # says what to run on instead
    with pytest.raises(UnsupportedHostError):
        select_weight_path(profile, explicit="bf16")  # an explicit path does not make vLLM run


# ----------------------------------------------------------------------------- ARM devices


def test_graviton3_features_come_from_auxv(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "graviton3", files={"proc/self/auxv": auxv(*GRAVITON3_HWCAPS)})
    profile = probe_device(root, machine="aarch64")
    assert profile.feature_source == "auxv"
    assert profile.features == {"asimd", "asimddp", "sve", "i8mm", "bf16"}  # Neoverse V1 has SVE, not SVE2
    assert profile.cpu_model == "Arm Neoverse-V1"
    assert not profile.amx_usable
    choice = select_weight_path(profile)
    assert (choice.name, choice.verified) == ("w4a16", False)
    assert any("not yet verified on real ARM" in note for note in choice.notes)
    assert not any("bf16" in note for note in choice.notes)


def test_raspberry_pi5_falls_back_to_cpuinfo_features(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "raspberry_pi5"), machine="aarch64")  # no auxv in the tree
    assert profile.feature_source == "cpuinfo Features"
    assert profile.features == {"asimd", "asimddp"}
    assert profile.cpu_model == "Arm Cortex-A76"
    choice = select_weight_path(profile)
    assert (choice.name, choice.verified) == ("w4a16", False)
    assert any("not yet verified on real ARM" in note for note in choice.notes)
    assert any("no native bf16" in note for note in choice.notes)


@pytest.mark.parametrize("device, hwcaps", [("graviton3", GRAVITON3_HWCAPS), ("raspberry_pi5", PI5_HWCAPS)])
def test_auxv_decoding_agrees_with_the_kernels_features_line(device: str, hwcaps: tuple[int, int]) -> None:
    decoded = decode_arm_hwcaps(*read_auxv_hwcaps(auxv(*hwcaps)))
    wanted = cpuinfo_features_line(device) & {"asimd", "asimddp", "sve", "sve2", "i8mm", "bf16"}
    assert decoded == wanted


@pytest.mark.parametrize(
    "name, hwcap, hwcap2",
    [
        # one bit at a time, from arch/arm64/include/uapi/asm/hwcap.h (real CPUs set neighbours together)
        ("asimd", 1 << 1, 0),
        ("asimddp", 1 << 20, 0),
        ("sve", 1 << 22, 0),
        ("sve2", 0, 1 << 1),
        ("i8mm", 0, 1 << 13),
        ("bf16", 0, 1 << 14),
    ],
)
def test_each_hwcap_bit_decodes_to_its_feature_alone(name: str, hwcap: int, hwcap2: int) -> None:
    assert decode_arm_hwcaps(hwcap, hwcap2) == {name}


def test_auxv_decodes_sve2_on_neoverse_v2() -> None:
    assert decode_arm_hwcaps(*GRAVITON4_HWCAPS) == {"asimd", "asimddp", "sve", "sve2", "i8mm", "bf16"}


def test_auxv_without_hwcap_or_truncated_is_unreadable() -> None:
    assert read_auxv_hwcaps(struct.pack("=QQQQ", AT_PAGESZ, 4096, AT_NULL, 0)) is None
    assert read_auxv_hwcaps(auxv(*PI5_HWCAPS)[:-3]) is None
    assert read_auxv_hwcaps(b"") is None


def test_architecture_is_the_processes_not_cpuinfos(tmp_path: Path) -> None:
    # qemu-aarch64 on an x86 host: /proc/cpuinfo shows the host's Xeon, auxv the emulated CPU.
    root = device_tree(tmp_path, "sapphire_rapids", files={"proc/self/auxv": auxv(*GRAVITON3_HWCAPS)})
    profile = probe_device(root, machine="aarch64")
    assert (profile.machine, profile.feature_source) == ("aarch64", "auxv")
    assert "amx_tile" not in profile.features and not profile.amx_usable
    assert select_weight_path(profile).name == "w4a16"


def test_a_fixture_root_needs_its_machine(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="machine="):
        probe_device(device_tree(tmp_path, "zen4"))


# ----------------------------------------------------------------------------- cores and memory


def test_hosts_without_limits_use_affinity_and_host_memory(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "zen4"), machine="x86_64")
    assert profile.cpus.affinity == (0, 1, 2, 3)
    assert (profile.cpus.cgroup_quota, profile.cpus.usable_cores) == (None, 4)  # cpu.max "max 100000"
    assert [(n.node, n.cpus) for n in profile.cpus.numa_nodes] == [(0, (0, 1, 2, 3))]
    mem = profile.memory
    assert (mem.host_total, mem.host_available) == (15974440 * 1024, 15102388 * 1024)
    assert mem.cgroup_limit is None  # memory.max "max"
    assert mem.cgroup_used == 125829120 - (62914560 + 15728640 - 7864320)  # current - unmapped file cache
    assert mem.cgroup_mapped == 7864320  # the mapped part stays in use, and is reported (planning/ceiling.py)
    assert mem.ceiling == mem.host_available


def test_cgroup_v1_host_with_unlimited_memory(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "haswell"), machine="x86_64")
    assert profile.cpus.cgroup_quota is None  # cfs_quota_us -1
    assert profile.memory.cgroup_limit is None  # 9223372036854771712 is v1's "no limit"
    assert profile.memory.cgroup_used == 283115520 - (145752064 + 61865984 - 31850496)
    assert profile.memory.cgroup_mapped == 31850496  # v1's total_mapped_file
    assert profile.memory.ceiling == 7050812 * 1024


def test_container_cgroup_v2_with_2gib_and_one_and_a_half_cpus(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "zen4", "container_v2"), machine="x86_64")
    assert profile.cpus.cgroup_quota == 1.5
    assert profile.cpus.usable_cores == 1  # floor: one unthrottled thread, see cpus.py
    mem = profile.memory
    assert mem.cgroup_limit == 2 * GIB
    # 700 MiB current: 500 MiB inactive and 125 MiB active page cache, 62.5 MiB of it mapped
    assert mem.cgroup_used == 700 * MIB - (500 * MIB + 125 * MIB - 62.5 * MIB)
    assert mem.ceiling == 2 * GIB - mem.cgroup_used
    assert mem.host_available > mem.ceiling


def test_container_cgroup_v1_with_2gib_and_one_and_a_half_cpus(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "haswell", "container_v1"), machine="x86_64")
    assert profile.cpus.cgroup_quota == 1.5
    assert profile.cpus.usable_cores == 1
    mem = profile.memory
    assert mem.cgroup_limit == 2 * GIB
    # usage 900 MiB minus total_inactive_file 600 MiB (not the cgroup's own inactive_file, 100 MiB)
    # and total_active_file 20 MiB, all of it mapped
    assert mem.cgroup_used == 300 * MIB
    assert mem.ceiling == 2 * GIB - 300 * MIB


def test_container_at_cgroup_root_without_mountinfo_assumes_sys_fs_cgroup(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "zen4", "container_v2")
    (root / "proc/self/mountinfo").unlink()
    profile = probe_device(root, machine="x86_64")
    assert profile.cpus.cgroup_quota == 1.5
    assert profile.memory.cgroup_limit == 2 * GIB


def test_a_parents_limit_binds_the_process(tmp_path: Path) -> None:
    # systemd: the service's own cgroup is unlimited, its slice caps memory and CPU.
    root = device_tree(
        tmp_path,
        "zen4",
        files={
            "sys/fs/cgroup/system.slice/memory.max": f"{GIB}\n",
            "sys/fs/cgroup/system.slice/memory.current": f"{400 * MIB}\n",
            "sys/fs/cgroup/system.slice/memory.stat": f"anon {300 * MIB}\ninactive_file {100 * MIB}\nactive_file 0\n",
            "sys/fs/cgroup/system.slice/cpu.max": "250000 100000\n",
        },
    )
    profile = probe_device(root, machine="x86_64")
    assert profile.cpus.cgroup_quota == 2.5
    assert profile.cpus.usable_cores == 2
    assert profile.memory.cgroup_limit == GIB
    assert profile.memory.cgroup_used == 300 * MIB
    assert profile.memory.ceiling == GIB - 300 * MIB


def test_affinity_mask_limits_usable_cores(tmp_path: Path) -> None:
    status = (FIXTURES / "zen4/proc/self/status").read_text()
    status = status.replace("Cpus_allowed_list:\t0-3", "Cpus_allowed_list:\t2-3")
    profile = probe_device(device_tree(tmp_path, "zen4", files={"proc/self/status": status}), machine="x86_64")
    assert profile.cpus.affinity == (2, 3)
    assert profile.cpus.usable_cores == 2


def test_pi5_without_numa_or_memory_controller(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "raspberry_pi5"), machine="aarch64")
    assert profile.cpus.numa_nodes == ()
    assert (profile.memory.cgroup_limit, profile.memory.cgroup_used) == (None, None)
    assert profile.memory.ceiling == 7702148 * 1024


@pytest.mark.parametrize(
    "affinity, quota, cores",
    [
        (8, None, 8),
        (8, 1.5, 1),
        (8, 0.5, 1),
        (8, 2.99, 2),
        (2, 4.0, 2),
        (8, 3.0, 3),
    ],
)
def test_usable_cores_floors_the_quota_but_never_reaches_zero(affinity: int, quota: float | None, cores: int) -> None:
    assert usable_cores(affinity, quota) == cores


# ----------------------------------------------------------------------------- explicit paths, images


def test_explicit_weight_path_overrides_the_choice(tmp_path: Path) -> None:
    spr = probe_device(device_tree(tmp_path, "sapphire_rapids"), machine="x86_64")
    assert select_weight_path(spr, explicit="w4a16").name == "w4a16"
    bf16 = select_weight_path(spr, explicit="bf16")
    assert (bf16.name, bf16.verified) == ("bf16", True)
    assert "explicitly" in bf16.reason


def test_explicit_w4a8_without_amx_runs_unverified_with_a_note(tmp_path: Path) -> None:
    zen4 = probe_device(device_tree(tmp_path, "zen4"), machine="x86_64")
    choice = select_weight_path(zen4, explicit="w4a8")
    assert (choice.name, choice.verified) == ("w4a8", False)
    assert re.search("lacks amx_tile, amx_int8.*W4A16 vector kernel", choice.notes[0])


def test_explicit_path_on_arm_stays_unverified(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "graviton3", files={"proc/self/auxv": auxv(*GRAVITON3_HWCAPS)})
    profile = probe_device(root, machine="aarch64")
    choice = select_weight_path(profile, explicit="bf16")
    assert (choice.name, choice.verified) == ("bf16", False)
    with pytest.raises(UnsupportedHostError, match="AMX is an x86-64 extension"):
        select_weight_path(profile, explicit="w4a8")


def test_unknown_weight_path_or_priority_is_a_usage_error(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "zen4"), machine="x86_64")
    with pytest.raises(ValueError):
        select_weight_path(profile, explicit="int3")
    with pytest.raises(ValueError):
        select_weight_path(profile, priority="fastest")


def test_other_architectures_are_refused(tmp_path: Path) -> None:
    profile = probe_device(device_tree(tmp_path, "zen4"), machine="riscv64")
    with pytest.raises(UnsupportedHostError, match="riscv64.*x86-64.*arm64"):
        select_weight_path(profile)


@pytest.mark.parametrize(
    "device, machine, image",
    [
        ("sapphire_rapids", "x86_64", "spark-edge:amx"),
        ("zen4", "x86_64", "spark-edge:avx512"),
        ("haswell", "x86_64", "spark-edge:avx2"),
        ("sandy_bridge", "x86_64", None),
        ("raspberry_pi5", "aarch64", "spark-edge:arm"),
    ],
)
def test_recommended_image(tmp_path: Path, device: str, machine: str, image: str | None) -> None:
    assert recommended_image(probe_device(device_tree(tmp_path, device), machine=machine)) == image


@pytest.mark.parametrize(
    "device, machine, label",
    [("sapphire_rapids", "x86_64", "amx"), ("zen4", "x86_64", "avx512"), ("haswell", "x86_64", "avx2")]
    + [("raspberry_pi5", "aarch64", "arm64")],
)
def test_the_isa_label_names_the_image_that_fits(tmp_path: Path, device: str, machine: str, label: str) -> None:
    """One classification: the label in spark_edge_build_info and the start log is the image that runs here."""
    profile = probe_device(device_tree(tmp_path, device), machine=machine)
    assert isa_label(profile) == label
    assert image_isa_problem(label, profile) is None


def test_an_avx512f_cpu_without_avx512bw_is_labelled_avx2(tmp_path: Path) -> None:
    zen4 = probe_device(device_tree(tmp_path, "zen4"), machine="x86_64")
    partial = dataclasses.replace(zen4, features=zen4.features - {"avx512bw"})  # the images' AVX-512 needs all four
    assert isa_label(partial) == "avx2" and image_isa_problem("avx512", partial) is not None


def test_image_isa_check_names_the_image_to_use(tmp_path: Path) -> None:
    spr = probe_device(device_tree(tmp_path / "spr", "sapphire_rapids"), machine="x86_64")
    zen4 = probe_device(device_tree(tmp_path / "zen4", "zen4"), machine="x86_64")
    pi5 = probe_device(device_tree(tmp_path / "pi5", "raspberry_pi5"), machine="aarch64")
    haswell = probe_device(device_tree(tmp_path / "hsw", "haswell"), machine="x86_64")
    snb = probe_device(device_tree(tmp_path / "snb", "sandy_bridge"), machine="x86_64")

    assert image_isa_problem("amx", spr) is None
    assert image_isa_problem("avx512", spr) is None  # runs, though the amx image is faster
    assert image_isa_problem("arm64", pi5) is None
    assert image_isa_problem("amx", zen4) == (
        "spark-edge:amx needs AMX int8 tiles usable by this process (Sapphire "
        "Rapids or newer Xeon), and this CPU lacks amx_tile, amx_int8: use "
        "spark-edge:avx512 instead"
    )
    assert image_isa_problem("arm64", spr).endswith("this CPU is x86_64: use spark-edge:amx instead")
    assert image_isa_problem("avx512", pi5).endswith("this CPU is aarch64: use spark-edge:arm instead")
    assert image_isa_problem("avx512", haswell) == (
        "spark-edge:avx512 needs AVX-512 (avx512f, avx512bw, avx512dq, avx512vl), and this CPU lacks avx512f, "
        "avx512bw, avx512dq, avx512vl: use spark-edge:avx2 instead"
    )
    assert image_isa_problem("amx", haswell).endswith("use spark-edge:avx2 instead")
    assert image_isa_problem("avx2", haswell) is None
    assert image_isa_problem("avx2", zen4) is None  # runs, though the avx512 image is faster
    assert image_isa_problem("avx2", pi5).endswith("this CPU is aarch64: use spark-edge:arm instead")
    no_avx2 = image_isa_problem("avx2", snb)
    assert "this CPU lacks avx2, fma, f16c; no spark-edge image runs here" in no_avx2
    assert "no spark-edge image runs here" in image_isa_problem("avx512", snb)
    with pytest.raises(ValueError):
        image_isa_problem("avx10", spr)


# ----------------------------------------------------------------------------- the command

JSON_KEYS = {"version", "device", "priority", "weight_path", "error"}
DEVICE_KEYS = {"machine", "cpu_model", "features", "feature_source", "amx_usable", "cpus", "memory"}


def test_probe_command_json_has_stable_keys(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "zen4", "container_v2")
    result = CliRunner().invoke(main, ["probe", "--json", "--root", str(root), "--machine", "x86_64"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == JSON_KEYS and set(out["device"]) == DEVICE_KEYS
    assert set(out["device"]["cpus"]) == {"affinity", "cgroup_quota", "usable_cores", "numa_nodes"}
    assert set(out["device"]["memory"]) == {
        "host_total_bytes",
        "host_available_bytes",
        "cgroup_limit_bytes",
        "cgroup_used_bytes",
        "cgroup_mapped_bytes",
        "ceiling_bytes",
    }
    assert out["device"]["cpus"]["cgroup_quota"] == 1.5
    assert out["device"]["memory"]["cgroup_limit_bytes"] == 2 * GIB
    assert out["weight_path"]["name"] == "w4a16" and out["error"] is None


def test_probe_command_prints_a_table_with_the_choice(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "sapphire_rapids")
    result = CliRunner().invoke(main, ["probe", "--priority", "fidelity", "--root", str(root), "--machine", "x86_64"])
    assert result.exit_code == 0, result.output
    assert "Intel(R) Xeon(R) Platinum 8488C" in result.stdout
    assert "weight path     w4a16 (verified)" in result.stdout
    assert "fidelity priority" in result.stdout


def test_probe_command_refuses_an_unsupported_host_with_its_exit_code(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "sandy_bridge")
    result = CliRunner().invoke(main, ["probe", "--json", "--root", str(root), "--machine", "x86_64"])
    assert result.exit_code == exit_codes.UNSUPPORTED_HOST == 4
    out = json.loads(result.stdout)
    assert out["weight_path"] is None and "lacks avx2" in out["error"]
    assert "spark-edge: error: this x86-64 CPU lacks avx2" in result.stderr


def test_probe_command_refuses_w4a8_on_arm(tmp_path: Path) -> None:
    root = device_tree(tmp_path, "graviton3", files={"proc/self/auxv": auxv(*GRAVITON3_HWCAPS)})
    result = CliRunner().invoke(main, ["probe", "--weight-path", "w4a8", "--root", str(root), "--machine", "aarch64"])
    assert result.exit_code == exit_codes.UNSUPPORTED_HOST
    assert "weight path     none" in result.stdout


def test_probe_command_root_needs_machine(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["probe", "--root", str(device_tree(tmp_path, "zen4"))])
    assert result.exit_code == exit_codes.USAGE


# ----------------------------------------------------------------------------- this machine


def _meminfo_kib(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(key)


def test_probe_on_this_host_agrees_with_the_kernel_and_torch() -> None:
    import torch

    profile = probe_device()
    assert profile.machine == platform.machine()
    assert profile.cpus.affinity == tuple(sorted(os.sched_getaffinity(0)))
    assert 1 <= profile.cpus.usable_cores <= len(profile.cpus.affinity)
    assert profile.memory.host_total == _meminfo_kib("MemTotal") * 1024
    assert abs(profile.memory.host_available - _meminfo_kib("MemAvailable") * 1024) < 512 * MIB
    assert 0 < profile.memory.ceiling <= profile.memory.host_available
    if profile.machine == "x86_64":
        assert profile.has("avx512f", "avx512bw", "avx512dq", "avx512vl") == torch.cpu._is_avx512_supported()
        assert profile.has("avx512_bf16") == torch.cpu._is_avx512_bf16_supported()
        # torch asks the kernel for AMX permission too: both must get the same answer
        assert profile.amx_usable == torch.cpu._is_amx_tile_supported()
        assert select_weight_path(profile).name == "w4a16"  # without a model's measurement, on every x86 host


# -- a real cgroup, made here ------------------------------------------------------------------

_CG = Path("/sys/fs/cgroup")


def _make_real_cgroup(name: str, memory: int, quota_us: int, period_us: int) -> tuple[list[Path], list[str]]:
    """Create a v1 (memory + cpu) or v2 cgroup with these limits; return its folders and the
    shell lines that move a process into it. Skips where cgroupfs is not writable."""
    if (_CG / "memory" / "memory.limit_in_bytes").exists() and (_CG / "cpu" / "cpu.cfs_quota_us").exists():
        mem, cpu = _CG / "memory" / name, _CG / "cpu" / name
        try:
            mem.mkdir(exist_ok=True)
            cpu.mkdir(exist_ok=True)
            (mem / "memory.limit_in_bytes").write_text(str(memory))
            (cpu / "cpu.cfs_period_us").write_text(str(period_us))
            (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))
        except OSError as exc:
            pytest.skip(f"cannot create a v1 cgroup here: {exc}")
        return [mem, cpu], [f"echo $$ > {mem}/cgroup.procs", f"echo $$ > {cpu}/cgroup.procs"]
    if (_CG / "cgroup.controllers").exists():
        group = _CG / name
        try:
            group.mkdir(exist_ok=True)
            (group / "memory.max").write_text(str(memory))
            (group / "cpu.max").write_text(f"{quota_us} {period_us}")
        except OSError as exc:
            pytest.skip(f"cannot create a v2 cgroup here: {exc}")
        return [group], [f"echo $$ > {group}/cgroup.procs"]
    pytest.skip("no cgroup v1 memory+cpu hierarchy or v2 unified hierarchy mounted")


def test_probe_sees_a_real_cgroup_limit_and_quota() -> None:
    import subprocess
    import sys

    folders, enter = _make_real_cgroup("spark-edge-probe-test", 2 << 30, 150000, 100000)
    try:
        script = "; ".join([*enter, f"exec {sys.executable} -m spark_edge.cli probe --json"])
        result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        device = json.loads(result.stdout)["device"]
        assert device["memory"]["cgroup_limit_bytes"] == 2 << 30
        assert device["memory"]["ceiling_bytes"] <= 2 << 30
        assert device["cpus"]["cgroup_quota"] == 1.5
        assert device["cpus"]["usable_cores"] == 1
    finally:
        for folder in folders:
            try:
                folder.rmdir()
            except OSError:
                pass  # still has a process for a moment; the kernel drops an empty cgroup later


# --- x86: the features this process can execute (CPUID), not only the kernel's flags -----------------

QEMU_X86 = shutil.which("qemu-x86_64-static") or shutil.which("qemu-x86_64")
X86_HOST = pytest.mark.skipif(platform.machine() != "x86_64", reason="CPUID is an x86 instruction")


class _FakeCpuid:
    """cpuid-native's interface over fixed registers: (leaf, subleaf) -> (EAX, EBX, ECX, EDX), and XCR0."""

    def __init__(self, registers: dict[tuple[int, int], tuple[int, int, int, int]], xcr0: int) -> None:
        self.registers, self.xcr0 = registers, xcr0

    def get_cpuid_count(self, leaf: int, subleaf: int) -> tuple[int, int, int, int, int]:
        return (0, *self.registers.get((leaf, subleaf), (0, 0, 0, 0)))

    def get_cpuid(self, leaf: int) -> tuple[int, int, int, int, int]:
        return self.get_cpuid_count(leaf, 0)

    def xgetbv(self, register: int) -> int:
        return self.xcr0


# leaf 1 ECX: FMA, AVX, F16C, OSXSAVE; leaf 7 EBX: AVX2, AVX-512 F/DQ/BW/VL; leaf 7.1 EAX: AVX512_BF16
LEAF1 = (0, 0, 1 << 12 | 1 << 27 | 1 << 28 | 1 << 29, 0)
LEAF7 = (1, 1 << 5 | 1 << 16 | 1 << 17 | 1 << 30 | 1 << 31, 0, 0)
ZEN4_LIKE = {(0, 0): (13, 0, 0, 0), (1, 0): LEAF1, (7, 0): LEAF7, (7, 1): (1 << 5, 0, 0, 0)}
AVX512_STATE = 0b1110_0111
AVX512 = {"avx512f", "avx512dq", "avx512bw", "avx512vl"}


@pytest.mark.parametrize(
    ("registers", "xcr0", "expected"),
    [
        (
            ZEN4_LIKE,
            AVX512_STATE,
            {"fma", "f16c", "avx2", *AVX512, "avx512_bf16"},
        ),
        # the OS saves no ZMM state (a kernel booted without AVX-512): the CPU has it, this process cannot use it
        (ZEN4_LIKE, 0b111, {"fma", "f16c", "avx2"}),
        # leaf 7 reports no subleaf 1: its bits are not read
        (
            {**ZEN4_LIKE, (7, 0): (0, *LEAF7[1:])},
            AVX512_STATE,
            {"fma", "f16c", "avx2", *AVX512},
        ),
        # leaf 7 beyond the CPU's largest leaf
        ({**ZEN4_LIKE, (0, 0): (1, 0, 0, 0)}, AVX512_STATE, {"fma", "f16c"}),
    ],
    ids=["zen4-like", "no-zmm-state", "no-subleaf-1", "max-leaf-1"],
)
def test_cpuid_features_read_the_bits_and_the_state_the_os_saves(
    monkeypatch: pytest.MonkeyPatch, registers: dict, xcr0: int, expected: set[str]
) -> None:
    from spark_edge.probe import x86_cpuid

    monkeypatch.setitem(sys.modules, "cpuid_native", _FakeCpuid(registers, xcr0))
    assert x86_cpuid.cpuid_features() == expected


def test_the_live_hosts_flags_are_narrowed_to_what_cpuid_says_this_process_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spark_edge.probe import cpu_features

    flags = {"flags": "avx2 fma f16c avx512f avx512bw", "model name": "m"}
    monkeypatch.setattr(cpu_features, "cpuid_features", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert cpu_features._x86_features(Path("/"), flags) == cpu_features.CpuFeatures(
        frozenset({"avx2", "fma", "f16c"}), "cpuinfo flags and cpuid", "m"
    )
    assert cpu_features._x86_features(Path("/"), {}).source == "cpuid"
    # another root (a recorded /proc) describes another machine: its flags alone
    assert cpu_features._x86_features(Path("/elsewhere"), flags).names == {"avx2", "fma", "f16c", "avx512f", "avx512bw"}
    monkeypatch.setattr(cpu_features, "cpuid_features", lambda: None)  # no cpuid-native
    assert cpu_features._x86_features(Path("/"), flags).source == "cpuinfo flags"


@X86_HOST
def test_cpuid_and_the_kernel_agree_on_this_host() -> None:
    """Two independent readings of one CPU: a wrong bit in the CPUID table shows as a difference here."""
    from spark_edge.probe.cpu_features import X86_FEATURES, first_processor_fields
    from spark_edge.probe.x86_cpuid import cpuid_features

    flags = first_processor_fields(Path("/proc/cpuinfo").read_text())["flags"].split()
    assert cpuid_features() == set(flags) & set(X86_FEATURES)


def _emulated_haswell(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [QEMU_X86, "-cpu", "Haswell", sys.executable, "-m", "spark_edge.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


@X86_HOST
@pytest.mark.skipif(QEMU_X86 is None, reason="no qemu-user for x86-64 (docker/start-dockerd.sh installs it)")
def test_under_an_emulated_avx2_cpu_the_probe_sees_avx2_and_the_avx512_image_refuses(tmp_path: Path) -> None:
    """qemu's Haswell (AVX2, FMA, F16C) on an AVX-512 machine: /proc/cpuinfo still names the host's AVX-512,
    CPUID does not; the probe believes CPUID, so the avx512 image's start refuses (exit 4, naming spark-edge:avx2)
    instead of dying with SIGILL in its kernels."""
    probed = _emulated_haswell("probe", "--json")
    assert probed.returncode == 0, probed.stderr
    device = json.loads(probed.stdout)["device"]
    assert set(device["features"]) == {"avx2", "fma", "f16c"}, device
    served = _emulated_haswell("serve", env={"SPARK_EDGE_IMAGE_ISA": "avx512", "SPARK_EDGE_HOME": str(tmp_path)})
    assert served.returncode == exit_codes.UNSUPPORTED_HOST, served.stderr[-2000:]
    assert "use spark-edge:avx2 instead" in served.stderr

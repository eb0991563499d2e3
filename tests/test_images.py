"""The per-ISA container images, built (or reused when their inputs are unchanged) and run for real.

Marker `images` (in the default run: the x86 images, the one that fits the host serving: avx512, or avx2
on a CPU without AVX-512); the arm64 image, built and run under qemu, is marked `images_arm` too and left
out of the default run (see pyproject.toml).
Skipped, with the reason, where no docker daemon is reachable. Builds go through
docker/build-image.sh, as `make image-<isa>` does. Every container that starts vLLM runs under the
machine-wide engine lock (/tmp/spark_edge_engine.lock, the one `flock` takes), so time-to-ready is
measured without another engine competing for the cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from image_recipe import dockerfile_text

from spark_edge import registry
from spark_edge.probe.device import probe_device
from spark_edge.probe.images import IMAGES, image_fits
from spark_edge.serving.server_process import free_port

from engine_lock import ENGINE_LOCK, engine_lock, held_by_ancestor

pytestmark = pytest.mark.images

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT_S = 3 * 3600  # a first arm64 build bootstraps its Debian base under qemu (10 min here)
READY_TIMEOUT_S = 900
SERVED_NAME = "smollm2-135m-instruct"
UID = 10001  # the images' spark-edge user
# --read-only needs two writable places: the data folder (compile cache, run files) and /tmp.
# exec: vLLM and Inductor load compiled shared objects from both; docker mounts a tmpfs noexec by default.
READ_ONLY_ARGS = [
    "--read-only",
    "--tmpfs",
    "/tmp:rw,exec,mode=1777",
    "--tmpfs",
    f"/var/cache/spark-edge:rw,exec,uid={UID},gid={UID},mode=0700",
]


# --- docker ------------------------------------------------------------------------------------


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        result = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        return "docker info timed out"
    if result.returncode != 0 or not result.stdout.strip():
        return f"no docker daemon is reachable ({result.stderr.strip().splitlines()[-1:] or 'docker info failed'})"
    return None


@pytest.fixture(scope="session")
def docker() -> None:
    problem = _docker_problem()
    if problem is not None:
        pytest.skip(f"image tests need a running docker daemon: {problem} (.ci/run starts one)")


def build_image(isa: str) -> str:
    """docker/build-image.sh: builds, or keeps an image whose inputs hash is unchanged; returns its tag."""
    env = {**os.environ, "PYTHON": sys.executable}
    if not ENGINE_LOCK or held_by_ancestor(ENGINE_LOCK):  # e.g. a container fixture of this session holds it
        env["SPARK_EDGE_ENGINE_LOCK"] = ""
    start = time.monotonic()
    result = subprocess.run(
        [str(REPO / "docker" / "build-image.sh"), isa],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    if result.returncode != 0:
        pytest.fail(f"building spark-edge:{isa} failed:\n{result.stderr[-6000:]}")
    print(
        f"\nspark-edge:{isa}: build step took {time.monotonic() - start:.0f} s "
        f"({result.stderr.strip().splitlines()[-1]})"
    )
    return result.stdout.strip().splitlines()[-1]


def docker_inspect(name: str, template: str) -> str:
    return subprocess.run(
        ["docker", "inspect", "--format", template, name], capture_output=True, text=True, check=True
    ).stdout.strip()


@dataclass
class Container:
    """A detached container on the host network, serving on 127.0.0.1:port only."""

    name: str
    port: int
    started: float  # time.monotonic() just before `docker run`
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        result = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True)
        return result.stdout + result.stderr

    def running(self) -> bool:
        return docker_inspect(self.name, "{{.State.Running}}") == "true"

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds from `docker run` to the first 200 on /health."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if not self.running():
                code = docker_inspect(self.name, "{{.State.ExitCode}}")
                raise AssertionError(f"{self.name} exited with {code}:\n{self.logs()[-6000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.ready_after_s = time.monotonic() - self.started
                    return self.ready_after_s
            except requests.ConnectionError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"{self.name} not ready after {timeout_s} s:\n{self.logs()[-6000:]}")

    def metrics(self) -> str:
        response = requests.get(f"{self.url}/metrics", timeout=10)
        response.raise_for_status()
        return response.text


@contextmanager
def container(image: str, docker_args: list[str] = (), args: list[str] = ()) -> Iterator[Container]:
    """`docker run -d` on the host network (loopback only), under the engine lock; removed on exit.

    If the block fails, the container's log tail is printed (pytest shows it with the failure).
    """
    name = f"spark-edge-test-{uuid.uuid4().hex[:10]}"
    port = free_port()
    # --shm-size: vLLM's engine and worker share a 160 MiB ring in /dev/shm (docker's default is 64 MiB)
    cmd = [
        "docker",
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        "--shm-size",
        "512m",
        "-e",
        f"SPARK_EDGE_PORT={port}",
        "-e",
        "SPARK_EDGE_HOST=127.0.0.1",
        *docker_args,
        image,
        *args,
    ]
    with engine_lock():
        started = time.monotonic()
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        running = Container(name, port, started)
        try:
            yield running
        except BaseException:
            print(f"--- {name} log tail ---\n{running.logs()[-6000:]}")
            raise
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))


def metric_sum(text: str, name: str) -> float:
    """A series summed over its label sets (the compile-cache misses have one per reason)."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert values, f"{name} missing from /metrics"
    return sum(map(float, values))


def complete(url: str, prompt: str = "The capital of France is") -> str:
    response = requests.post(
        f"{url}/v1/completions",
        timeout=120,
        json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0},
    )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def run_once(
    image: str, args: list[str], docker_args: list[str] = (), timeout_s: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", "run", "--rm", *docker_args, image, *args], capture_output=True, text=True, timeout=timeout_s
    )


# --- hadolint ----------------------------------------------------------------------------------


def test_dockerfiles_are_hadolint_clean(tmp_path: Path) -> None:
    """Linted as docker builds them: each image's own Dockerfile followed by its shared recipe."""
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint missing: it comes with the test extra (pip install -e '.[test]')"
    assert sorted(p.name for p in REPO.glob("Dockerfile.*")) == sorted(i.dockerfile for i in registry.IMAGES.values())
    files = []
    for image in registry.IMAGES.values():
        files.append(tmp_path / image.dockerfile)
        files[-1].write_text(dockerfile_text(image))
    files.append(REPO / "deploy" / "compose" / "Dockerfile.prometheus")
    result = subprocess.run([hadolint, *map(str, files)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


# --- the x86 image this host runs: avx512, or avx2 ----------------------------------------------


@pytest.fixture(scope="session")
def x86_isa(docker: None) -> str:
    """The x86 image the serving tests run: avx512 where it fits (AMX hosts included), else avx2."""
    device = probe_device()
    isa = next((isa for isa in ("avx512", "avx2") if image_fits(isa, device)), None)
    if isa is None:
        pytest.skip("this host fits neither spark-edge:avx512 nor spark-edge:avx2")
    return isa


@pytest.fixture(scope="session")
def x86_image(x86_isa: str) -> str:
    return build_image(x86_isa)


# The image's own plan, bisected for the smallest `docker run --memory` it accepts, in a container started as
# `serve` is (read-only, the data folder a tmpfs the baked cache is copied into, which the cgroup charges):
# the plan's ceiling is the limit minus what the cgroup holds plus this process's own share (planning/
# ceiling.py), so the limit is the smallest accepted ceiling plus what the cgroup holds besides this process.
_SMALLEST_LIMIT = """
import json, os
from pathlib import Path
from spark_edge.planning.ceiling import OwnMemory, own_share
from spark_edge.planning.serving_plan import model_config, resolve_weight_path, smallest_ceiling
from spark_edge.probe.device import probe_device
from spark_edge.probe.memory import probe_memory
from spark_edge.serving.process_layout import DEFAULT_LAYOUT

model = Path(os.environ["SPARK_EDGE_MODEL"])
device = probe_device()
choice = resolve_weight_path(device, "speed", os.environ.get("SPARK_EDGE_WEIGHT_PATH", "auto"), model)
smallest = smallest_ceiling(device, choice, model, model_config(model), 2048, 4, DEFAULT_LAYOUT)
own, memory = OwnMemory.now(), probe_memory(Path("/"))
held = (memory.cgroup_used or 0) - own_share(memory, own)
print(json.dumps({
    "ceiling_mib": smallest.ceiling.bytes >> 20, "held_mib": -(-max(0, held) // 2**20), **smallest.plan.as_dict()
}))
"""
EDGE_SLACK_MIB = 16  # as tests/test_server_lifecycle.py: on each side of the plan's edge


@pytest.fixture(scope="session")
def smallest_limit(x86_image: str) -> dict:
    cache = "$SPARK_EDGE_HOME/vllm-cache"
    seed = f'mkdir -p "{cache}" && cp -R "$SPARK_EDGE_BAKED_CACHE/vllm-cache/." "{cache}/"'
    args = ["-c", f'{seed} && exec python3 -c "$0"', _SMALLEST_LIMIT]
    result = run_once(x86_image, args, [*READ_ONLY_ARGS, "--entrypoint", "sh"])
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    found["limit_mib"] = found["ceiling_mib"] + found["held_mib"]
    return found


@pytest.fixture(scope="session")
def cold_ready_s(x86_image: str, smallest_limit: dict) -> float:
    """Time to ready of a start that compiles, and #35's promise for an image: the plan made for the smallest
    memory limit the image's plan accepts cuts the prefill chunk, so the baked cache (compiled for the full
    chunk, part of vLLM's graph key) misses and the start compiles, the C++ compiler beside the engine; under
    a real limit that size it serves, never OOM-killed, its load peak under the plan's. The ceiling is given
    (--memory-limit's variable), the cgroup's limit 16 MiB above it: a plan is not monotonic in its ceiling
    (a few MiB more and the full chunk, already compiled, fits without the compiler)."""
    plan = smallest_limit
    assert plan["reduced_prefill_chunk"] and plan["compile_transient_bytes"] > 0, plan
    limit = f"{plan['limit_mib'] + EDGE_SLACK_MIB}m"
    ceiling = ["-e", f"SPARK_EDGE_MEMORY_LIMIT={plan['ceiling_mib'] << 20}"]
    with container(x86_image, READ_ONLY_ARGS + ["--memory", limit, "--memory-swap", limit, *ceiling]) as c:
        seconds = c.wait_ready()
        text, logs = c.metrics(), c.logs()
        assert metric_sum(text, "spark_edge_compile_cache_misses_total") > 0, "a graph not baked must miss"
        assert "this start compiles" in logs and "prefilling" in logs, logs[-4000:]
        assert metric(text, "spark_edge_load_rss_anon_peak_bytes") <= metric(text, "spark_edge_plan_load_peak_bytes")
        assert complete(c.url).strip()
        assert docker_inspect(c.name, "{{.State.OOMKilled}}") == "false"
        return seconds


def test_x86_image_just_under_the_smallest_limit_the_plan_accepts_refuses_with_exit_5(
    x86_image: str, smallest_limit: dict
) -> None:
    limit = f"{smallest_limit['limit_mib'] - EDGE_SLACK_MIB}m"
    result = run_once(x86_image, [], [*READ_ONLY_ARGS, "--memory", limit, "--memory-swap", limit])
    assert result.returncode == 5 and "does not fit" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def x86_warm(x86_image: str, cold_ready_s: float) -> Iterator[Container]:
    """The image as a user runs it read-only: its first start, with the baked compile cache.

    Started after the cold measurement has finished, so the two never share the cores; stopped with
    this module, so it does not take CPU from the engine tests that follow.
    """
    with container(x86_image, READ_ONLY_ARGS) as c:
        c.wait_ready()
        # a warm start compiles nothing, not even torch's precompiled header (its /tmp is new)
        text = c.metrics()
        assert metric(text, "spark_edge_load_rss_anon_peak_bytes") <= metric(text, "spark_edge_plan_load_peak_bytes")
        yield c


def test_x86_image_answers_a_completion(x86_warm: Container) -> None:
    text = complete(x86_warm.url)
    assert text.strip(), "empty completion"
    models = requests.get(f"{x86_warm.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


def test_x86_image_first_start_loads_the_baked_compile_cache(x86_warm: Container) -> None:
    text = x86_warm.metrics()
    hits = metric(text, "spark_edge_compile_cache_hits_total")
    misses = metric_sum(text, "spark_edge_compile_cache_misses_total")
    assert hits > 0 and misses == 0, f"first start: {hits} hits, {misses} misses\n{x86_warm.logs()[-4000:]}"
    assert 'weight_path="w4a16"' in text and 'isa="' in text
    logs = x86_warm.logs()
    assert "compile cache seeded from the image" in logs
    assert "native int4 kernels unavailable" not in logs, logs[-4000:]  # the image's library serves


def test_x86_image_baked_cache_halves_time_to_ready(x86_isa: str, x86_warm: Container, cold_ready_s: float) -> None:
    warm_s = x86_warm.ready_after_s
    in_process = metric(x86_warm.metrics(), "spark_edge_startup_seconds", '{phase="ready"}')
    print(
        f"\nspark-edge:{x86_isa} time to ready: cold (compiling, at the smallest limit) {cold_ready_s:.1f} s, "
        f"warm (baked cache) {warm_s:.1f} s (in-process {in_process:.1f} s), "
        f"ratio {warm_s / cold_ready_s:.2f}"
    )
    assert warm_s <= cold_ready_s / 2


def test_x86_image_runs_read_only_as_non_root(x86_warm: Container) -> None:
    assert docker_inspect(x86_warm.name, "{{.HostConfig.ReadonlyRootfs}}") == "true"
    write = subprocess.run(
        ["docker", "exec", x86_warm.name, "touch", "/opt/spark-edge/x"], capture_output=True, text=True
    )
    assert write.returncode != 0 and "Read-only file system" in write.stderr
    # Every process of the container, as the host kernel sees it (not what the image claims).
    pids = subprocess.run(
        ["docker", "top", x86_warm.name, "-eo", "pid"], capture_output=True, text=True, check=True
    ).stdout.split()[1:]
    assert pids, pids  # the server (its engine core a thread of it in the default layout)
    for pid in pids:
        status = Path(f"/proc/{pid}/status").read_text()
        uids = re.search(r"^Uid:\s+(.*)$", status, re.MULTILINE).group(1).split()
        assert set(uids) == {str(UID)}, f"pid {pid} runs with uids {uids}"


def test_x86_image_healthcheck_turns_healthy(x86_warm: Container) -> None:
    deadline = time.monotonic() + 60  # the HEALTHCHECK runs every 10 s
    while (state := docker_inspect(x86_warm.name, "{{.State.Health.Status}}")) != "healthy":
        assert time.monotonic() < deadline and state in ("starting", "healthy"), state
        time.sleep(1)


def test_x86_image_carries_no_build_leftovers(x86_isa: str, x86_image: str) -> None:
    script = (
        "test ! -e /wheelhouse && test ! -e /src && test ! -e /models && test ! -e /root/.cache "
        "&& test ! -e /var/cache/spark-edge/.cache "
        # Debian's python3-venv ships pip's and setuptools' wheels in /usr/share/python-wheels
        "&& ! find / -xdev -name '*.whl' -not -path '/usr/share/python-wheels/*' 2>/dev/null | grep . "
        "&& ! env | grep '^PIP_' && test ! -e /etc/pip.conf && test ! -e /etc/xdg/pip"
    )
    result = run_once(x86_image, ["-c", script], ["--entrypoint", "sh"])
    assert result.returncode == 0, result.stdout + result.stderr
    labels = json.loads(docker_inspect(x86_image, "{{json .Config.Labels}}"))
    assert labels["io.spark-edge.isa"] == x86_isa and labels["io.spark-edge.weight-path"] == "w4a16"
    assert docker_inspect(x86_image, "{{.Config.User}}") == f"{UID}:{UID}"


def test_x86_image_without_a_writable_data_folder_says_what_to_mount(x86_image: str) -> None:
    result = run_once(x86_image, [], ["--read-only"], timeout_s=120)
    assert result.returncode == 1
    assert "mount a volume or a tmpfs" in result.stderr and "/var/cache/spark-edge" in result.stderr


STAMP = "spark_edge_cache_stamp.json"  # what each weight-path folder of a compile cache was made for
# Turn the kept cache into an older image's: its stamp names another vLLM (an upgrade changes it), and a file
# the new image does not have marks what must not survive.
_AGE_THE_KEPT_CACHE = f"""
import json, pathlib
for stamp in pathlib.Path("/var/cache/spark-edge/vllm-cache").glob("*/{STAMP}"):
    facts = json.loads(stamp.read_text())
    facts["vllm"] = "0.31.0"
    stamp.write_text(json.dumps(facts))
    (stamp.parent / "from-an-older-image").write_text("x")
    print(stamp.parent.name)
"""


def test_x86_image_a_volume_kept_from_an_older_image_gets_this_images_cache(x86_image: str) -> None:
    """A data volume kept across an image upgrade: the compile cache it holds was made for the older image
    (its stamp differs), so the entrypoint replaces that weight path's folder with this image's baked one,
    and the start loads every graph from it (hits, no miss) instead of compiling anew."""
    volume = f"spark-edge-test-{uuid.uuid4().hex[:10]}"
    subprocess.run(["docker", "volume", "create", volume], check=True, capture_output=True)
    mount = ["--read-only", "--tmpfs", "/tmp:rw,exec,mode=1777", "-v", f"{volume}:/var/cache/spark-edge"]
    try:
        with container(x86_image, mount) as first:  # the volume's first start: seeded from the image
            first.wait_ready()
            assert metric_sum(first.metrics(), "spark_edge_compile_cache_misses_total") == 0
        aged = run_once(x86_image, ["-c", _AGE_THE_KEPT_CACHE], [*mount, "--entrypoint", "python3"])
        assert aged.returncode == 0 and aged.stdout.split() == ["w4a16"], aged.stdout + aged.stderr
        with container(x86_image, mount) as upgraded:
            upgraded.wait_ready()
            text, logs = upgraded.metrics(), upgraded.logs()
            assert "holds a compile cache made for something else; replacing it" in logs, logs[-4000:]
            hits = metric(text, "spark_edge_compile_cache_hits_total")
            misses = metric_sum(text, "spark_edge_compile_cache_misses_total")
            assert hits > 0 and misses == 0, f"{hits} hits, {misses} misses\n{logs[-4000:]}"
        left = run_once(x86_image, ["-c", "ls /var/cache/spark-edge/vllm-cache/w4a16"], [*mount, "--entrypoint", "sh"])
        assert left.returncode == 0 and STAMP in left.stdout and "from-an-older-image" not in left.stdout, left.stdout
    finally:
        subprocess.run(["docker", "volume", "rm", "-f", volume], capture_output=True)


# --- the edge box: compose ---------------------------------------------------------------------

COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"
RULES = REPO / "deploy" / "rules" / "spark-edge.rules.yml"


def _prometheus_api(port: int, path: str) -> dict:
    try:
        reply = requests.get(f"http://127.0.0.1:{port}/api/v1/{path}", timeout=5)
    except requests.ConnectionError:
        return {}
    return reply.json().get("data", {}) if reply.status_code == 200 else {}


def test_compose_box_comes_up_and_prometheus_scrapes_it_with_every_rule(x86_image: str) -> None:
    """deploy/compose/compose.yaml with Debian's docker-compose: spark-edge and Prometheus (built here from
    Debian's package on the images' base), until Prometheus has the target up and the rules loaded."""
    import yaml

    compose = shutil.which("docker-compose")
    assert compose, "docker-compose missing: deploy/install-tools.sh installs Debian's (.ci/run runs it)"
    built = subprocess.run(
        [str(REPO / "deploy" / "compose" / "build-prometheus-image.sh")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    prometheus_image = built.stdout.strip().splitlines()[-1]
    server_port, prometheus_port = free_port(), free_port()
    project = f"spark-edge-test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "SPARK_EDGE_IMAGE": x86_image,
        "PROMETHEUS_IMAGE": prometheus_image,
        "SPARK_EDGE_PORT": str(server_port),
        "PROMETHEUS_PORT": str(prometheus_port),
    }
    base = [compose, "-p", project, "-f", str(COMPOSE)]
    rules = sum(len(group["rules"]) for group in yaml.safe_load(RULES.read_text())["groups"])
    with engine_lock():
        started = time.monotonic()
        up = subprocess.run([*base, "up", "-d"], env=env, capture_output=True, text=True, timeout=600)
        try:
            assert up.returncode == 0, up.stderr[-3000:]
            deadline = started + READY_TIMEOUT_S
            target_up = loaded = None
            while time.monotonic() < deadline and not (target_up and loaded == rules):
                time.sleep(2)
                result = _prometheus_api(prometheus_port, 'query?query=up{job="spark-edge"}').get("result", [])
                target_up = bool(result) and result[0]["value"][1] == "1"
                groups = _prometheus_api(prometheus_port, "rules").get("groups", [])
                loaded = sum(len(g["rules"]) for g in groups)
            took = time.monotonic() - started
            logs = subprocess.run([*base, "logs", "--tail", "40"], env=env, capture_output=True, text=True).stdout
            assert target_up, f"Prometheus never saw spark-edge up in {took:.0f} s:\n{logs[-6000:]}"
            assert loaded == rules, f"Prometheus loaded {loaded} of {rules} rules"
            assert requests.get(f"http://127.0.0.1:{server_port}/health", timeout=5).status_code == 200
            print(f"\ncompose up: spark-edge scraped up by Prometheus with {loaded} rules loaded {took:.0f} s after up")
        finally:
            subprocess.run([*base, "down", "-v", "--timeout", "30"], env=env, capture_output=True, timeout=300)


# --- amx ---------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def amx_image(docker: None) -> str:
    return build_image("amx")


def _amx_denied_profile(tmp_path: Path) -> Path:
    """A seccomp profile refusing only arch_prctl(ARCH_REQ_XCOMP_PERM): the kernel denies AMX tile data.

    That is what a host without usable AMX looks like to the process (the CPU may have the flags,
    but the process may not use the tiles), so an AMX host can show the refusal too.
    """
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            {
                "names": ["arch_prctl"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": 1,
                "args": [{"index": 0, "value": 0x1023, "op": "SCMP_CMP_EQ"}],
            }
        ],
    }
    path = tmp_path / "no-amx-seccomp.json"
    path.write_text(json.dumps(profile))
    return path


def test_amx_image_refuses_a_cpu_without_amx(amx_image: str, tmp_path: Path) -> None:
    host = probe_device()
    docker_args = [] if not image_fits("amx", host) else ["--security-opt", f"seccomp={_amx_denied_profile(tmp_path)}"]
    start = time.monotonic()
    result = run_once(amx_image, ["serve"], ["--network", "none", *docker_args], timeout_s=300)
    elapsed = time.monotonic() - start
    print(
        f"\nspark-edge:amx on a process without AMX: exit {result.returncode} in {elapsed:.1f} s: "
        f"{result.stderr.strip().splitlines()[-1]}"
    )
    assert result.returncode == 4, result.stderr[-4000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("spark-edge: error: spark-edge:amx needs AMX int8 tiles"), message
    # the image to use instead: avx512 where the CPU has AVX-512 (any AMX CPU has), avx2 on an AVX2-only CPU
    instead = next((IMAGES[isa] for isa in ("avx512", "avx2") if image_fits(isa, host)), None)
    if instead:
        assert message.endswith(f"use {instead} instead"), message


def test_amx_image_serves_its_weight_path_where_amx_is_usable(amx_image: str) -> None:
    host = probe_device()
    baked = run_once(amx_image, ["/opt/spark-edge/baked-cache"], ["--entrypoint", "ls"]).stdout.split()
    if not image_fits("amx", host):
        # built here, on a CPU without AMX: not warmed, and it says so at start
        assert baked == ["NOT_WARMED"], baked
        pytest.skip("this host has no usable AMX: spark-edge:amx cannot serve here (its refusal is tested)")
    assert baked == ["mapped-weights", "vllm-cache"], baked  # the weights are mapped from the image too
    listed = {
        folder: run_once(amx_image, [f"/opt/spark-edge/baked-cache/{folder}"], ["--entrypoint", "ls"]).stdout.split()
        for folder in baked
    }
    assert listed["mapped-weights"] == listed["vllm-cache"] != [], listed
    with container(amx_image, READ_ONLY_ARGS) as c:
        c.wait_ready()
        assert complete(c.url).strip()
        text = c.metrics()
        assert f'weight_path="{registry.image("amx").weight_path}"' in text and 'isa="amx"' in text
        assert metric(text, "spark_edge_compile_cache_hits_total") > 0
        assert metric_sum(text, "spark_edge_compile_cache_misses_total") == 0
        print(f"\nspark-edge:amx time to ready (baked cache): {c.ready_after_s:.1f} s")


# --- avx2 --------------------------------------------------------------------------------------

QEMU_X86 = shutil.which("qemu-x86_64-static")
KERNELS_DIR = "/opt/spark-edge/venv/share/spark-edge/kernels"  # where the image build puts the int4 library


@pytest.fixture(scope="session")
def avx2_image(docker: None) -> str:
    return build_image("avx2")


def test_avx2_image_carries_an_x86_64_v3_library_and_no_cache_from_an_avx512_builder(avx2_image: str) -> None:
    """Built here, on a CPU with AVX-512: the int4 library for x86-64-v3 (one build, keyed on the target), and no
    compile cache (Inductor's AVX-512 code would not run on the CPUs the image is for); its start says so."""
    from spark_edge.kernels import native_int4 as ni

    baked = run_once(avx2_image, ["/opt/spark-edge/baked-cache"], ["--entrypoint", "ls"]).stdout.split()
    if ni.host_target() != ni.NATIVE:
        pytest.skip("built on an AVX2 CPU: the image is warmed there")
    assert baked == ["NOT_WARMED"], baked
    why = run_once(avx2_image, ["/opt/spark-edge/baked-cache/NOT_WARMED"], ["--entrypoint", "cat"]).stdout
    assert "AVX2 CPU cannot run" in why, why
    keys = run_once(avx2_image, [KERNELS_DIR], ["--entrypoint", "ls"]).stdout.split()
    assert len(keys) == 1, keys


@pytest.mark.skipif(QEMU_X86 is None, reason="no qemu-x86_64-static (docker/start-dockerd.sh installs it)")
def test_avx2_image_loads_its_own_library_on_an_emulated_avx2_cpu(avx2_image: str) -> None:
    """The image's python under qemu's Haswell (AVX2, FMA, F16C; no AVX-512, no AVX-VNNI): the baked x86-64-v3
    library loads and passes its self-check against float64, nothing compiled at start, no illegal instruction."""
    qemu = ["-v", f"{QEMU_X86}:/usr/local/bin/qemu-x86_64:ro", "--entrypoint", "/usr/local/bin/qemu-x86_64"]
    args = ["-cpu", "Haswell", "/opt/spark-edge/venv/bin/python", "-m", "spark_edge.kernels.native_int4"]
    result = run_once(avx2_image, args, ["--network", "none", *READ_ONLY_ARGS, *qemu])
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    keys = run_once(avx2_image, [KERNELS_DIR], ["--entrypoint", "ls"]).stdout.split()
    assert f"int4 kernels ready: {KERNELS_DIR}/{keys[0]}/spark_edge_int4.so" in result.stdout, result.stdout


# --- arm ---------------------------------------------------------------------------------------

# qemu-user's arm64 CPU has 512-bit SVE by default; Inductor (torch 2.13) generates 256-bit SVE code for any
# length but 128 and computes garbage on it. Emulate the vector length of the SVE edge CPUs (Graviton 3: 256 bits).
ARM = ["--platform", "linux/arm64", "-e", "QEMU_CPU=max,sve-default-vector-length=32"]


@pytest.fixture(scope="session")
def arm_image(docker: None) -> str:
    if not Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists() and os.uname().machine != "aarch64":
        pytest.skip("no arm64 emulation: install qemu-user-static and binfmt-support (.ci/run does)")
    return build_image("arm")


@pytest.mark.images_arm
def test_arm_probe_reports_aarch64_and_w4a16(arm_image: str) -> None:
    result = run_once(arm_image, ["probe", "--json"], ARM)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["device"]["machine"] == "aarch64"
    assert "asimd" in report["device"]["features"]
    assert report["weight_path"]["name"] == "w4a16"


@pytest.mark.images_arm
def test_arm_image_is_not_warmed_and_says_so_at_start(arm_image: str) -> None:
    baked = run_once(arm_image, ["/opt/spark-edge/baked-cache"], ARM + ["--entrypoint", "ls"]).stdout.split()
    assert baked == ["NOT_WARMED"], baked
    # The entrypoint prepares the data folder as for a real start; `--help` then ends it before vLLM.
    result = run_once(arm_image, ["serve", "--help"], ARM)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "no baked compile cache (built under emulation" in result.stderr, result.stderr
    assert "this start compiles the model" in result.stderr, result.stderr


@pytest.mark.images_arm
def test_arm_image_carries_no_build_leftovers(arm_image: str) -> None:
    venv = "/opt/spark-edge/venv"
    # Its site-packages come from the build host (pip --target): no wheels, pip, cache or host scripts.
    script = (
        "test ! -e /wheelhouse && test ! -e /build && test ! -e /root/.cache "
        f"&& ! find / -xdev -name '*.whl' -not -path '/usr/share/python-wheels/*' 2>/dev/null | grep . "
        f"&& test ! -e {venv}/bin/pip && test ! -e {venv}/lib/python3.11/site-packages/bin "
        f"&& ! env | grep '^PIP_' && test ! -e /etc/pip.conf "
        f"&& test \"$(head -1 {venv}/bin/spark-edge)\" = '#!{venv}/bin/python'"
    )
    result = run_once(arm_image, ["-c", script], ARM + ["--entrypoint", "sh"])
    assert result.returncode == 0, result.stdout + result.stderr
    labels = json.loads(docker_inspect(arm_image, "{{json .Config.Labels}}"))
    assert labels["io.spark-edge.isa"] == "arm64" and labels["io.spark-edge.weight-path"] == "w4a16"
    assert docker_inspect(arm_image, "{{.Config.User}}") == f"{UID}:{UID}"
    assert docker_inspect(arm_image, "{{.Architecture}}") == "arm64"


@pytest.fixture(scope="session")
def pytest_for_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pytest and its pure-Python dependencies in a folder to mount: the image itself carries no test tools."""
    target = tmp_path_factory.mktemp("pytest-lib")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            "-c",
            str(REPO / "constraints.txt"),
            "pytest",
            "pluggy",
            "iniconfig",
            "pytest-timeout",
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    target.chmod(0o755)  # pytest makes its temporary folders 0700; the image runs as uid 10001
    return target


def _present_cpus() -> list[int]:
    """The CPU numbers /sys/devices/system/cpu/present lists ("0-1,4"): what the container sees too."""
    cpus = []
    for part in Path("/sys/devices/system/cpu/present").read_text().strip().split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


@pytest.fixture(scope="session")
def arm_cpuinfo(arm_image: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """docker arguments that give an emulated container an aarch64 /proc/cpuinfo, where it needs one.

    qemu-user before 8.1 shows an arm64 guest the host's x86 /proc/cpuinfo, and PyTorch's cpuinfo
    library, which parses it at `import torch` on arm64, dereferences NULL on that text (the guest
    segfaults; qemu 7.2 then hangs). Newer qemu emulates the file itself, much as written here:
    one entry per CPU with the features the emulated CPU reports (AT_HWCAP, read by `spark-edge
    probe`) and qemu's "max" CPU identification. docker allows a bind mount over /proc/cpuinfo
    (as LXCFS uses). Nothing is mounted where the container already sees an aarch64 file.
    """
    seen = run_once(arm_image, ["/proc/cpuinfo"], ARM + ["--entrypoint", "cat"])
    if not re.search(r"^flags\s*:", seen.stdout, re.MULTILINE):
        return []
    probe = json.loads(run_once(arm_image, ["probe", "--json"], ARM).stdout)
    features = " ".join(["fp", *probe["device"]["features"]])
    entry = (
        "processor\t: {n}\nBogoMIPS\t: 100.00\nFeatures\t: {features}\nCPU implementer\t: 0x00\n"
        "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0x051\nCPU revision\t: 0\n\n"
    )
    path = tmp_path_factory.mktemp("arm-proc") / "cpuinfo"
    path.write_text("".join(entry.format(n=n, features=features) for n in _present_cpus()))
    return ["-v", f"{path}:/proc/cpuinfo:ro"]


@pytest.mark.images_arm
def test_arm_w4a16_kernel_tests_pass_under_emulation(
    arm_image: str, pytest_for_image: Path, arm_cpuinfo: list[str]
) -> None:
    mounts = [
        "-v",
        f"{REPO / 'tests'}:/work/tests:ro",
        "-v",
        f"{pytest_for_image}:/work/pylib:ro",
        "-e",
        "PYTHONPATH=/work/pylib",
        "-w",
        "/work",
        "--entrypoint",
        "python",
        *arm_cpuinfo,
    ]
    # The W4A16 kernels: quantizer, tinygemm layout, the custom ops on the CPU, KleidiAI (no vLLM engine).
    selection = "not vllm_tp1 and not registered and not plugin and not writer"
    with engine_lock():
        result = run_once(
            arm_image,
            [
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_cpu_int4.py",
                "tests/test_kleidiai_int4.py",
                "-k",
                selection,
                "-o",
                "addopts=",
            ],
            ARM + mounts,
            timeout_s=3600,
        )
    last = (result.stdout.strip() or result.stderr.strip() or "no output").splitlines()[-1]
    print(f"\nspark-edge:arm W4A16 kernel tests under emulation: {last}")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", result.stdout)

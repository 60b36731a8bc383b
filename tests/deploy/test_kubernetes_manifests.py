"""The Kubernetes manifests in deploy/kubernetes/, checked without a cluster.

Two layers:

- every core object against the Kubernetes JSON schemas (kubernetes-validate bundles them, so
  this runs offline), strict, so a misspelt field fails instead of being silently dropped;
- the things a schema cannot know: probes on /health at a declared port, Services that select
  the pods they mean, the router's --replica-dns naming the headless Service, --port matching
  the container port, the grace period covering the drain, --num-threads following the CPU
  limit, and the autoscalers pointing at the replicas with a metric fornax really exports
  (read from a live `Metrics` object, not a string kept here). The `fornax` arguments go
  through fornax's own argparse parser, so a renamed flag fails here too.

Each check (tests/deploy/manifest_checks.py) returns the problems it finds. `test_each_check_catches_its_fault`
breaks a copy of the manifests once per check and asserts the check notices, so none of them
passes vacuously.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fornax.cli import build_parser
from fornax.metrics.prometheus import Metrics
from tests.deploy.manifest_checks import (
    AUTOSCALER_FILES,
    DOCKERFILE,
    K8S_VERSIONS,
    KDIR,
    METRIC_NAME,
    Manifests,
    by_name,
    cli_problems,
    deployment_running,
    flag,
    grace_problems,
    hpa_problems,
    keda_problems,
    kustomization,
    kustomization_problems,
    load_manifests,
    main_container,
    model_problems,
    objects,
    pod_spec,
    port_flag_problems,
    probe_problems,
    replica_dns_problems,
    resolved_args,
    resource_problems,
    schema_problems,
    scrape_problems,
    secret_problems,
    secret_refs,
    selector_problems,
    set_flag,
)


@pytest.fixture
def manifests() -> Manifests:
    return load_manifests()  # fresh per test: the fault tests edit it


@pytest.fixture(scope="module")
def exported() -> dict[str, str]:
    """Metric family name -> type, from the exposition text of fornax's real registry."""
    text = Metrics("any-model").render().decode()
    return {family.name: family.type for family in text_string_to_metric_families(text)}


# ---- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_core_objects_match_the_kubernetes_schemas(manifests: Manifests, version: str) -> None:
    assert schema_problems(manifests, version) == []


def test_every_yaml_file_parses_to_kinds_we_check(manifests: Manifests) -> None:
    kinds = {d.get("kind") for docs in manifests.values() for d in docs}
    assert {"Deployment", "Service", "ScaledObject", "HorizontalPodAutoscaler", "Kustomization"} <= kinds
    assert all("apiVersion" in d and "kind" in d for docs in manifests.values() for d in docs)


def test_probes_are_on_health_at_a_declared_port(manifests: Manifests) -> None:
    assert probe_problems(manifests) == []


def test_services_select_the_pods_they_mean(manifests: Manifests) -> None:
    assert selector_problems(manifests) == []


def test_router_resolves_the_headless_replica_service(manifests: Manifests) -> None:
    assert replica_dns_problems(manifests) == []


def test_container_ports_match_the_port_flags(manifests: Manifests) -> None:
    assert port_flag_problems(manifests) == []


def test_replicas_are_scraped_and_serve_metrics_without_a_key(manifests: Manifests) -> None:
    assert scrape_problems(manifests) == []


def test_grace_period_covers_the_drain(manifests: Manifests) -> None:
    assert grace_problems(manifests) == []


def test_resources_and_threads(manifests: Manifests) -> None:
    assert resource_problems(manifests) == []


def test_model_is_pulled_into_the_shared_fornax_home(manifests: Manifests) -> None:
    assert model_problems(manifests) == []


def test_keys_come_from_a_secret(manifests: Manifests) -> None:
    assert secret_problems(manifests) == []


def test_fornax_command_lines_parse(manifests: Manifests) -> None:
    assert cli_problems(manifests) == []


def test_router_command_line(manifests: Manifests) -> None:
    """Named on its own (cli_problems passes over a command this fornax lacks), so that a
    fornax without `fornax router` shows it skipped rather than passed."""
    parser = build_parser()
    if "router" not in next(a for a in parser._subparsers._group_actions).choices:
        pytest.skip("this fornax has no `fornax router` yet")
    router = main_container(deployment_running(manifests, "router"))
    parser.parse_args(resolved_args(router))


def test_keda_scales_the_replicas_on_an_exported_gauge(
    manifests: Manifests, exported: dict[str, str]
) -> None:
    assert keda_problems(manifests, exported) == []


def test_hpa_scales_the_replicas_on_an_exported_gauge(manifests: Manifests, exported: dict[str, str]) -> None:
    assert hpa_problems(manifests, exported) == []


def test_kustomization(manifests: Manifests) -> None:
    assert kustomization_problems(manifests) == []


def test_readme_names_the_secret_and_exported_metrics(manifests: Manifests, exported: dict[str, str]) -> None:
    """The README says how to create the Secret the pods read, and every fornax metric it
    tells the inference gateway to read is one fornax exports as a gauge."""
    readme = (KDIR / "README.md").read_text()
    for secret, key in secret_refs(manifests):
        assert secret in readme and key in readme, f"README does not say how to create {secret}/{key}"
    named = set(METRIC_NAME.findall(readme))
    assert {"fornax:num_requests_waiting", "fornax:kv_cache_usage_perc"} <= named
    assert [n for n in named if exported.get(n) is None] == []
    for block in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S):
        doc = yaml.safe_load(block)
        if not isinstance(doc, dict) or doc.get("kind") != "EndpointPickerConfig":
            continue
        engines = [
            e for p in doc.get("plugins", []) for e in p.get("parameters", {}).get("engineConfigs", [])
        ]
        fornax = [e for e in engines if e["name"] == "fornax"]
        assert fornax, "the EndpointPickerConfig in the README has no engineConfigs entry for fornax"
        for field in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
            assert exported.get(fornax[0][field]) == "gauge", f"{field}: {fornax[0][field]}"


def test_dockerfile_matches_the_pods() -> None:
    """The image pins the CPU torch, has the compiler the native kernels need at start, and
    runs as the uid the pods require (runAsNonRoot refuses a root image)."""
    text = DOCKERFILE.read_text()
    assert re.search(r"download\.pytorch\.org/whl/cpu\s+torch==2\.13\.0", text)
    assert re.search(r"apt-get install[^\n]*\bgcc\b", text)
    uid = re.search(r"^USER (\d+)", text, flags=re.M)
    m = load_manifests()
    uids = {pod_spec(d)["securityContext"]["runAsUser"] for d in objects(m, "Deployment")}
    assert uid and uids == {int(uid.group(1))}


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed"
)
@pytest.mark.parametrize("autoscaler", [None, *AUTOSCALER_FILES])
def test_kustomize_builds(tmp_path: Path, autoscaler: str | None) -> None:
    """`kubectl kustomize` renders the base, and the base plus either autoscaler, to valid
    objects all in one namespace."""
    work = tmp_path / "k"
    shutil.copytree(KDIR, work)
    if autoscaler:
        kust = yaml.safe_load((work / "kustomization.yaml").read_text())
        kust["resources"].append(autoscaler)
        (work / "kustomization.yaml").write_text(yaml.safe_dump(kust))
    out = subprocess.run(["kubectl", "kustomize", str(work)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    rendered = {"rendered.yaml": docs}
    assert schema_problems(rendered, K8S_VERSIONS[0]) == []
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"fornax"}
    expected = sum(len(load_manifests()[f]) for f in kustomization(load_manifests())["resources"])
    assert len(docs) == expected + (1 if autoscaler else 0)


# ---- each check can fail ---------------------------------------------------------------------------


def _replicas(m: Manifests) -> dict:
    return by_name(m, "Deployment", "fornax-replicas")


def _router(m: Manifests) -> dict:
    return by_name(m, "Deployment", "fornax-router")


def _serve(m: Manifests) -> dict:
    return main_container(_replicas(m))


def _route(m: Manifests) -> dict:
    return main_container(_router(m))


def _headless(m: Manifests) -> dict:
    return by_name(m, "Service", "fornax-replicas")


def _keda(m: Manifests) -> dict:
    return m["keda-scaledobject.yaml"][0]["spec"]


def _keda_down(m: Manifests) -> dict:
    return _keda(m)["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]


def _hpa(m: Manifests) -> dict:
    return m["hpa.yaml"][0]["spec"]


def put(obj: dict | list, key: str | int, value: object) -> None:
    obj[key] = value


def _query(query: str) -> Callable[[Manifests], None]:
    return lambda m: put(_keda(m)["triggers"][0]["metadata"], "query", query)


Fault = Callable[[Manifests], None]
Check = Callable[[Manifests, dict[str, str]], list[str]]


def _on(check: Callable[[Manifests], list[str]]) -> Check:
    return lambda m, exported: check(m)


DNS = "--replica-dns"
# (what is broken, how, the check that must notice it)
FAULTS: list[tuple[str, Fault, Check]] = [
    (
        "misspelt field",
        lambda m: put(_serve(m), "readinessprobe", {}),
        lambda m, e: schema_problems(m, K8S_VERSIONS[0]),
    ),
    (
        "port as a string",
        lambda m: put(_route(m)["ports"][0], "containerPort", "8080"),
        lambda m, e: schema_problems(m, K8S_VERSIONS[-1]),
    ),
    ("router without readiness", lambda m: _route(m).pop("readinessProbe"), _on(probe_problems)),
    ("replicas without startup", lambda m: _serve(m).pop("startupProbe"), _on(probe_problems)),
    (
        "liveness on another path",
        lambda m: put(_serve(m)["livenessProbe"]["httpGet"], "path", "/healthz"),
        _on(probe_problems),
    ),
    (
        "probe on an undeclared port",
        lambda m: put(_route(m)["livenessProbe"]["httpGet"], "port", "web"),
        _on(probe_problems),
    ),
    (
        "short startup window",
        lambda m: put(_serve(m)["startupProbe"], "failureThreshold", 6),
        _on(probe_problems),
    ),
    (
        "slow readiness",
        lambda m: put(_serve(m)["readinessProbe"], "failureThreshold", 10),
        _on(probe_problems),
    ),
    (
        "service selects nothing",
        lambda m: put(_headless(m)["spec"]["selector"], "app.kubernetes.io/component", "server"),
        _on(selector_problems),
    ),
    (
        "service targets a missing port",
        lambda m: put(by_name(m, "Service", "fornax")["spec"]["ports"][0], "targetPort", 8000),
        _on(selector_problems),
    ),
    (
        "deployment selector off its template",
        lambda m: put(_router(m)["spec"]["selector"]["matchLabels"], "tier", "x"),
        _on(selector_problems),
    ),
    (
        "headless service given a cluster IP",
        lambda m: _headless(m)["spec"].pop("clusterIP"),
        _on(replica_dns_problems),
    ),
    (
        "headless service renamed",
        lambda m: put(_headless(m)["metadata"], "name", "fornax-pool"),
        _on(replica_dns_problems),
    ),
    (
        "router dns in another namespace",
        lambda m: set_flag(_route(m)["args"], DNS, "fornax-replicas.default.svc.cluster.local:8000"),
        _on(replica_dns_problems),
    ),
    (
        "router dns on another port",
        lambda m: set_flag(_route(m)["args"], DNS, "fornax-replicas.fornax.svc.cluster.local:80"),
        _on(replica_dns_problems),
    ),
    (
        "--port off the container port",
        lambda m: set_flag(_serve(m)["args"], "--port", "9000"),
        _on(port_flag_problems),
    ),
    (
        "scrape annotation on another port",
        lambda m: put(
            _router(m)["spec"]["template"]["metadata"]["annotations"], "prometheus.io/port", "9090"
        ),
        _on(port_flag_problems),
    ),
    ("metrics behind a key", lambda m: _serve(m)["args"].remove("--public-metrics"), _on(scrape_problems)),
    (
        "router metrics behind a key",
        lambda m: _route(m)["args"].remove("--public-metrics"),
        _on(scrape_problems),
    ),
    (
        "router liveness on its replica-dependent /health",
        lambda m: put(_route(m)["livenessProbe"]["httpGet"], "path", "/health"),
        _on(probe_problems),
    ),
    (
        "grace shorter than the drain",
        lambda m: put(pod_spec(_replicas(m)), "terminationGracePeriodSeconds", 35),
        _on(grace_problems),
    ),
    (
        "drain longer than the grace",
        lambda m: set_flag(_serve(m)["args"], "--shutdown-timeout", "120"),
        _on(grace_problems),
    ),
    (
        "threads off the CPU limit",
        lambda m: set_flag(_serve(m)["args"], "--num-threads", "8"),
        _on(resource_problems),
    ),
    # A literal thread count left behind when the CPU limit changes. (Changing the limit alone
    # is fine: test_cpu_limit_alone_moves_the_threads.)
    (
        "literal threads, limit changed",
        lambda m: (
            set_flag(_serve(m)["args"], "--num-threads", "4"),
            put(_serve(m)["resources"]["limits"], "cpu", "2"),
        ),
        _on(resource_problems),
    ),
    ("no memory limit", lambda m: _route(m)["resources"]["limits"].pop("memory"), _on(resource_problems)),
    (
        "init pulls another model",
        lambda m: put(pod_spec(_replicas(m))["initContainers"][0]["args"], 1, "other-model"),
        _on(model_problems),
    ),
    (
        "init writes elsewhere",
        lambda m: put(pod_spec(_replicas(m))["initContainers"][0]["env"][0], "value", "/tmp/fornax"),
        _on(model_problems),
    ),
    (
        "api key as a literal",
        lambda m: put(
            _serve(m),
            "env",
            [
                v if v["name"] != "FORNAX_API_KEY" else {"name": v["name"], "value": "sk-1"}
                for v in _serve(m)["env"]
            ],
        ),
        _on(secret_problems),
    ),
    (
        "argument refers to an undefined variable",
        lambda m: set_flag(_route(m)["args"], "--replica-api-key", "$(REPLICA_KEY)"),
        _on(secret_problems),
    ),
    ("unknown serve flag", lambda m: _serve(m)["args"].append("--threads=4"), _on(cli_problems)),
    ("bad flag value", lambda m: set_flag(_serve(m)["args"], "--quantization", "fp8"), _on(cli_problems)),
    (
        "keda scales something else",
        lambda m: put(_keda(m)["scaleTargetRef"], "name", "fornax-router"),
        keda_problems,
    ),
    ("keda queries a metric fornax does not export", _query("sum(vllm:num_requests_waiting)"), keda_problems),
    ("keda sums a counter", _query("sum(fornax:num_preemptions_total)"), keda_problems),
    (
        "keda filters on another model",
        _query('sum(fornax:num_requests_waiting{model_name="llama"})'),
        keda_problems,
    ),
    (
        "keda drops replicas in a hurry",
        lambda m: put(_keda_down(m)["scaleDown"], "stabilizationWindowSeconds", 30),
        keda_problems,
    ),
    ("keda behavior misspelt", lambda m: put(_keda_down(m), "scaledown", {}), keda_problems),
    ("keda spec field misspelt", lambda m: put(_keda(m), "maxReplicas", 4), keda_problems),
    ("hpa scales something else", lambda m: put(_hpa(m)["scaleTargetRef"], "name", "fornax"), hpa_problems),
    (
        "hpa on an unexported metric",
        lambda m: put(_hpa(m)["metrics"][0]["pods"]["metric"], "name", "fornax_queue_length"),
        hpa_problems,
    ),
    (
        "hpa removes three at once",
        lambda m: put(_hpa(m)["behavior"]["scaleDown"]["policies"][0], "value", 3),
        hpa_problems,
    ),
    (
        "kustomization lists a missing file",
        lambda m: kustomization(m)["resources"].append("service-monitor.yaml"),
        _on(kustomization_problems),
    ),
    (
        "both autoscalers on",
        lambda m: kustomization(m)["resources"].extend(AUTOSCALER_FILES),
        _on(kustomization_problems),
    ),
    (
        "object in another namespace",
        lambda m: put(_router(m)["metadata"], "namespace", "default"),
        _on(kustomization_problems),
    ),
]


@pytest.mark.parametrize(("fault", "check"), [(f, c) for _, f, c in FAULTS], ids=[n for n, _, _ in FAULTS])
def test_each_check_catches_its_fault(
    manifests: Manifests, exported: dict[str, str], fault: Fault, check: Check
) -> None:
    assert check(manifests, exported) == [], "the check fails on the manifests as shipped"
    fault(manifests)
    assert check(manifests, exported), "the check did not notice the fault"


def test_cpu_limit_alone_moves_the_threads(manifests: Manifests) -> None:
    """--num-threads is $(FORNAX_CPUS), the CPU limit via the downward API: a new limit is
    picked up without touching the arguments (2.5 CPUs -> 3 threads, rounded up)."""
    server = _serve(manifests)
    server["resources"]["limits"]["cpu"] = server["resources"]["requests"]["cpu"] = "2500m"
    assert resource_problems(manifests) == []
    assert flag(resolved_args(server), "--num-threads") == "3"

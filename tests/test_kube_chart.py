"""The Helm chart on a real Kubernetes control plane (`tests/kube_cluster.py`).

`helm install` into namespaces that enforce the restricted Pod Security Standard, on a real
kube-apiserver, scheduler and controller manager with the real KubeRay operator; KWOK's fake
nodes (CPU, and GPU nodes declaring `nvidia.com/gpu`) stand in for kubelets. Shown here:
every object of every values file accepted as rendered (server-side validation, strict
fields, admission); the RayService reconciled into a RayCluster and head and worker pods that
keep the chart's pod spec; GPU workers bound to GPU nodes only, Pending where none has room;
Redis, NetworkPolicies, Services, Secrets and the model sources; upgrades as documented in
helm/baton/README.md; nothing left after `helm uninstall`. Containers never run (no kubelet):
docs/operations.md says what this cannot show.

Run by `make kube-test` (it builds the control plane once, `deploy/kube_build.py`); skipped
otherwise: set BATON_KUBE_TESTS=1 to run it by hand after `python -m
baton_serve.deploy.kube_build install`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_cluster import (
    GPU_RESOURCE,
    ApiError,
    KubeCluster,
    kube_cluster,
    operator_errors,
    operator_log_size,
    rayservice_reconciles,
    remote_addresses,
)
from kube_objects import (
    RESTRICTED,
    Api,
    Docs,
    contains,
    create_namespace,
    differences,
    helm_runner,
    manifest_docs,
    namespace_objects,
    selector_query,
)
from test_helm import CHART, GOOD_VALUES, values_id

from baton_serve.deploy import kube_build

pytestmark = pytest.mark.skipif(
    os.environ.get("BATON_KUBE_TESTS") != "1",
    reason="the chart's control-plane tests run with `make kube-test` (BATON_KUBE_TESTS=1)",
)
IMAGE = "registry.example.com/baton"
RAY_CLUSTER = ("ray.io/v1", "RayCluster")
POD = ("v1", "Pod")
Helm = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    absent = kube_build.missing(kube_build.default_cache())
    if absent:
        pytest.fail(f"not built: {absent}: run `python -m baton_serve.deploy.kube_build install`")
    with kube_cluster(tmp_path_factory.mktemp("kube")) as running:
        yield running


@pytest.fixture(scope="module")
def api(cluster: KubeCluster) -> Api:
    return Api(cluster)


@pytest.fixture(scope="module")
def helm(cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return helm_runner(cluster, tmp_path_factory.mktemp("helm-home"))


def install(helm: Helm, cluster: KubeCluster, release: str, namespace: str, *flags: str) -> Docs:
    """`helm install` (our image, then `flags`) into a new restricted namespace; returns the
    release's manifest."""
    create_namespace(cluster, namespace, RESTRICTED)
    return helm_install(helm, release, namespace, *flags)


def helm_install(helm: Helm, release: str, namespace: str, *flags: str) -> Docs:
    image = sets(f"image.repository={IMAGE}")
    result = helm("install", release, str(CHART), "-n", namespace, *image, *flags)
    assert result.returncode == 0, result.stderr
    return manifest_docs(helm("get", "manifest", release, "-n", namespace).stdout)


def sets(*values: str) -> list[str]:
    return [f"--set={value}" for value in values]


def ray_clusters(api: Api, namespace: str, rayservice: str) -> Docs:
    selector = f"ray.io/originated-from-cr-name={rayservice}"
    return api.list(*RAY_CLUSTER, namespace, labelSelector=selector)


def only_cluster(api: Api, cluster: KubeCluster, namespace: str, rayservice: str) -> dict[str, Any]:
    (found,) = cluster.wait_for("a RayCluster", lambda: ray_clusters(api, namespace, rayservice))
    return found


def pod_template(rayservice: dict[str, Any], node_type: str) -> dict[str, Any]:
    config = rayservice["spec"]["rayClusterConfig"]
    if node_type == "head":
        return config["headGroupSpec"]["template"]
    return config["workerGroupSpecs"][0]["template"]


# --- the control plane ---------------------------------------------------------------------


def test_the_control_plane_is_the_pinned_release_with_gpu_nodes(cluster: KubeCluster) -> None:
    assert cluster.get("/version")["gitVersion"] == kube_build.KUBERNETES_VERSION
    nodes = {n["metadata"]["name"]: n for n in cluster.items("/api/v1/nodes")}
    gpus = {name: n["status"]["allocatable"].get(GPU_RESOURCE) for name, n in nodes.items()}
    assert gpus == {"cpu-0": None, "cpu-1": None, "gpu-0": "1", "gpu-1": "1"}


def test_a_restricted_namespace_refuses_a_pod_that_breaks_the_standard(
    cluster: KubeCluster,
) -> None:
    """Admission at `restricted` really runs: what the chart's pods pass is enforced."""
    create_namespace(cluster, "psa-check", RESTRICTED)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root"},
        "spec": {"containers": [{"name": "c", "image": IMAGE}]},
    }
    with pytest.raises(ApiError) as refused:
        cluster.create("/api/v1/namespaces/psa-check/pods", pod)
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in refused.value.message


@pytest.mark.parametrize("values", GOOD_VALUES, ids=values_id)
def test_every_object_is_accepted_as_rendered(
    cluster: KubeCluster, api: Api, helm: Helm, values: Path | None
) -> None:
    """Each object of each values file, created with the server's every check and
    `fieldValidation=Strict` (a field the server would drop is an error) in a restricted
    namespace: accepted, with no warning (Pod Security warns on a workload's pod template)."""
    namespace = f"render-{values_id(values)}"
    create_namespace(cluster, namespace, RESTRICTED)
    args = [
        "template",
        "baton",
        str(CHART),
        "-n",
        namespace,
        *(["-f", str(values)] if values else []),
    ]
    template = helm(*args)
    assert template.returncode == 0, template.stderr
    unserved = []
    for doc in manifest_docs(template.stdout):
        if api.resource(doc["apiVersion"], doc["kind"]) is None:
            unserved.append(doc["kind"])
            continue
        warnings = api.dry_run_create(doc, namespace)
        assert warnings == [], f"{doc['kind']}/{doc['metadata']['name']}: {warnings}"
    assert set(unserved) <= {"ServiceMonitor"}  # the Prometheus operator's CRD is not here


# --- one release, reconciled by KubeRay --------------------------------------------------

RELEASE, NAMESPACE = "baton", "llm"  # the RayService is named after the release: baton
WORKERS = 2  # workers.replicas by default: one per GPU node here


@pytest.fixture(scope="module")
def release(cluster: KubeCluster, helm: Helm) -> Docs:
    """The chart installed with its defaults (an image of ours) in a restricted namespace."""
    return install(helm, cluster, RELEASE, NAMESPACE)


def rendered(docs: Docs, kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in docs if doc["kind"] == kind]
    return doc


def started_pods(
    api: Api, cluster: KubeCluster, namespace: str, rayservice: str, workers: int
) -> dict[str, Docs]:
    """The head and worker pods of the RayService's one RayCluster, once settled."""
    name = only_cluster(api, cluster, namespace, rayservice)["metadata"]["name"]
    return pods_by_type(settled_pods(api, cluster, namespace, name, workers))


def settled_pods(
    api: Api, cluster: KubeCluster, namespace: str, raycluster: str, workers: int
) -> Docs:
    """The RayCluster's pods once KubeRay made them all and each is bound and started
    (Running) or refused by the scheduler (Pending, Unschedulable)."""

    def settled(pod: dict[str, Any]) -> bool:
        return pod["status"].get("phase") == "Running" or unschedulable(pod) is not None

    def pods() -> Docs | None:
        found = api.list(*POD, namespace, labelSelector=f"ray.io/cluster={raycluster}")
        ready = len(found) == 1 + workers and all(settled(pod) for pod in found)
        return found if ready else None

    return cluster.wait_for(f"{1 + workers} settled pods of {raycluster}", pods)


def pods_by_type(pods: Docs) -> dict[str, Docs]:
    found: dict[str, Docs] = {"head": [], "worker": []}
    for pod in pods:
        found[pod["metadata"]["labels"]["ray.io/node-type"]].append(pod)
    return found


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message for a pod it could not place, else None."""
    for condition in pod["status"].get("conditions", []):
        if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return condition.get("message", "")
    return None


def test_the_operator_reconciles_the_rayservice_into_a_raycluster_and_pods(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    rayservice = api.get(rendered(release, "RayService"), NAMESPACE)
    raycluster = only_cluster(api, cluster, NAMESPACE, RELEASE)
    (owner,) = raycluster["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("RayService", rayservice["metadata"]["uid"])
    pods = started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    assert [len(pods["head"]), len(pods["worker"])] == [1, WORKERS]
    assert {pod["status"]["phase"] for group in pods.values() for pod in group} == {"Running"}


def assert_pods_keep_the_template(rayservice: dict[str, Any], pods: dict[str, Docs]) -> None:
    for node_type, group in pods.items():
        wanted = pod_template(rayservice, node_type)  # KubeRay only adds to it (`ray start`)
        for pod in group:
            assert contains(pod, wanted), (node_type, differences(pod, wanted))


def test_the_operator_builds_the_pods_without_an_error(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    """KubeRay parses what the chart gives it (rayStartParams among it) with no error."""
    started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    assert operator_errors(cluster) == []


def test_the_pods_keep_the_charts_security_context_images_resources_and_gpus(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    pods = started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    assert_pods_keep_the_template(rendered(release, "RayService"), pods)
    for pod in [*pods["head"], *pods["worker"]]:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        ray = pod["spec"]["containers"][0]
        assert ray["image"] == f"{IMAGE}:0.1.0"  # the chart's appVersion
        assert ray["securityContext"]["capabilities"]["drop"] == ["ALL"]
    (head,) = pods["head"]
    assert GPU_RESOURCE not in head["spec"]["containers"][0]["resources"]["limits"]
    for worker in pods["worker"]:
        assert worker["spec"]["containers"][0]["resources"]["limits"][GPU_RESOURCE] == "1"


def test_gpu_workers_are_bound_to_gpu_nodes_only(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    pods = started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    assert sorted(pod["spec"]["nodeName"] for pod in pods["worker"]) == ["gpu-0", "gpu-1"]
    assert pods["head"][0]["spec"]["nodeName"].startswith("cpu-")


def test_a_gpu_worker_stays_pending_while_no_gpu_node_has_room(
    cluster: KubeCluster, api: Api, helm: Helm, release: Docs
) -> None:
    """Both GPU nodes hold the first release's workers: another release's worker waits."""
    started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    docs = install(helm, cluster, "more", "more")
    pods = started_pods(
        api, cluster, "more", rendered(docs, "RayService")["metadata"]["name"], WORKERS
    )
    for worker in pods["worker"]:
        assert "nodeName" not in worker["spec"]
        assert f"Insufficient {GPU_RESOURCE}" in (unschedulable(worker) or "")
    assert pods["head"][0]["spec"]["nodeName"].startswith("cpu-")


def selected_pods(api: Api, namespace: str, selector: dict[str, Any]) -> list[str]:
    pods = api.list(*POD, namespace, labelSelector=selector_query(selector))
    return sorted(pod["metadata"]["name"] for pod in pods)


def test_redis_runs_and_the_services_select_its_pods(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    """The StatefulSets' pods pass admission at `restricted` and are bound; each Service of
    the chart selects exactly its StatefulSet's pod."""
    statefulsets = [doc for doc in release if doc["kind"] == "StatefulSet"]
    assert {s["metadata"]["name"] for s in statefulsets} == {"baton-redis", "baton-gcs-redis"}
    for statefulset in statefulsets:
        name = statefulset["metadata"]["name"]
        pod = cluster.wait_for(
            f"{name}-0 started",
            lambda name=name: [
                p
                for p in api.list(*POD, NAMESPACE)
                if p["metadata"]["name"] == f"{name}-0" and p["status"].get("phase") == "Running"
            ],
        )[0]
        assert pod["spec"]["nodeName"].startswith("cpu-")
        wanted = statefulset["spec"]["template"]
        assert contains(pod, wanted), differences(pod, wanted)
    for service in (doc for doc in release if doc["kind"] == "Service"):
        stored = api.get(service, NAMESPACE)
        assert contains(stored, service), differences(stored, service)
        selected = selected_pods(api, NAMESPACE, {"matchLabels": service["spec"]["selector"]})
        assert selected == [f"{service['metadata']['name']}-0"]


def test_the_network_policies_select_the_pods_they_mean(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    """On the pods KubeRay and the StatefulSets made: the Ray policy covers every Ray pod and
    lets them reach each other, the index's Redis admits every Ray pod, the GCS's only the
    head."""
    pods = started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    head = [pod["metadata"]["name"] for pod in pods["head"]]
    ray = sorted(head + [pod["metadata"]["name"] for pod in pods["worker"]])
    policies = {doc["metadata"]["name"]: doc for doc in release if doc["kind"] == "NetworkPolicy"}
    expected = {  # policy: (the pods it guards, the pods its first rule admits)
        "baton-ray": (ray, ray),
        "baton-redis": (["baton-redis-0"], ray),
        "baton-gcs-redis": (["baton-gcs-redis-0"], head),
    }
    assert set(policies) == set(expected)
    for name, (guarded, admitted) in expected.items():
        stored = api.get(policies[name], NAMESPACE)
        assert contains(stored, policies[name]), differences(stored, policies[name])
        assert selected_pods(api, NAMESPACE, stored["spec"]["podSelector"]) == guarded
        peers = [rule for rule in stored["spec"]["ingress"] if "from" in rule]
        (peer,) = peers[0]["from"]
        assert selected_pods(api, NAMESPACE, peer["podSelector"]) == admitted


def test_every_secret_a_pod_reads_is_there(cluster: KubeCluster, api: Api, release: Docs) -> None:
    """Each Secret key the pods (and the RayService's GCS settings) refer to exists: the
    generated ones hold values, and KubeRay finds the Ray token under its own key."""
    started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)
    secrets = {
        s["metadata"]["name"]: s.get("data", {}) for s in api.list("v1", "Secret", NAMESPACE)
    }
    references = []
    for pod in api.list(*POD, NAMESPACE):
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            for item in container.get("env", []):
                ref = item.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    references.append((pod["metadata"]["name"], ref["name"], ref["key"]))
    rayservice = rendered(release, "RayService")["spec"]["rayClusterConfig"]
    gcs = rayservice["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]
    references.append(("RayService", gcs["name"], gcs["key"]))
    references.append(("RayService", rayservice["authOptions"]["secretName"], "auth_token"))
    assert len({name for _, name, _ in references}) >= 4
    for reader, name, key in references:
        assert key in secrets.get(name, {}), f"{reader} reads {name}/{key}: absent"
        assert secrets[name][key], f"{name}/{key} is empty"


# --- model sources -------------------------------------------------------------------------


def bound_claim(cluster: KubeCluster, namespace: str, name: str, access_mode: str) -> None:
    """A claim bound to a volume of its own, as a storage provisioner leaves one (the volume
    is never mounted: no kubelet)."""
    volume = f"{namespace}-{name}"
    storage = {"storage": "10Gi"}
    cluster.create(
        "/api/v1/persistentvolumes",
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": storage,
                "accessModes": [access_mode],
                "storageClassName": "",
                "hostPath": {"path": f"/srv/{volume}"},
                "claimRef": {"namespace": namespace, "name": name},
            },
        },
    )
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            "accessModes": [access_mode],
            "storageClassName": "",
            "volumeName": volume,
            "resources": {"requests": storage},
        },
    }
    path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims"
    cluster.create(path, claim)
    bound = lambda: cluster.get(f"{path}/{name}").get("status", {}).get("phase") == "Bound"  # noqa: E731
    cluster.wait_for(f"claim {name} bound", bound)


HF_VALUES = CHART / "ci" / "hf-model-values.yaml"
MODEL_SOURCES = {  # source: (helm flags, claims to bind first, (volume, claim) on every pod)
    "pvc": (
        sets("model.source=pvc", "model.pvc.claimName=gguf-models", "model.file=m.gguf"),
        {"gguf-models": "ReadOnlyMany"},
        ("model", "gguf-models"),
    ),
    "hf": (["-f", str(HF_VALUES)], {"gguf-cache": "ReadWriteMany"}, ("model-cache", "gguf-cache")),
}


@pytest.mark.parametrize("source", MODEL_SOURCES)
def test_the_model_source_reaches_every_ray_pod(
    cluster: KubeCluster, api: Api, helm: Helm, release: Docs, source: str
) -> None:
    """The claim (and, for hf://, the init container that fills it) on the head and the
    workers, as rendered; the head is bound, so its claims are. The GPU workers wait for room
    (the first release holds both GPUs)."""
    flags, claims, (volume, claim) = MODEL_SOURCES[source]
    namespace = f"model-{source}"
    create_namespace(cluster, namespace, RESTRICTED)
    for name, access_mode in claims.items():
        bound_claim(cluster, namespace, name, access_mode)
    if source == "hf":
        token = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token"}}
        cluster.create(
            f"/api/v1/namespaces/{namespace}/secrets", {**token, "stringData": {"token": "hf_x"}}
        )
    docs = helm_install(helm, RELEASE, namespace, *flags)
    pods = started_pods(api, cluster, namespace, RELEASE, WORKERS)
    assert_pods_keep_the_template(rendered(docs, "RayService"), pods)
    assert pods["head"][0]["status"]["phase"] == "Running"
    for pod in [*pods["head"], *pods["worker"]]:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[volume]["persistentVolumeClaim"]["claimName"] == claim
        if source == "hf":  # the fetch runs before Ray starts, in every pod
            assert pod["spec"]["initContainers"][0]["name"] == "model-download"


# --- upgrades and uninstall (on the first release, in this order) -------------------------


def upgrade(helm: Helm, *values: str) -> None:
    chart = str(CHART)
    result = helm("upgrade", RELEASE, chart, "-n", NAMESPACE, "--reuse-values", *sets(*values))
    assert result.returncode == 0, result.stderr


def reconciled_after(cluster: KubeCluster, change: Callable[[], None]) -> None:
    """Make `change`, then wait until the operator has reconciled the RayService twice."""
    since = operator_log_size(cluster)
    change()

    def twice() -> bool:
        return len(rayservice_reconciles(cluster, NAMESPACE, RELEASE, since)) >= 2

    cluster.wait_for("two reconciles of the RayService", twice)


def uids(pods: dict[str, Docs]) -> set[str]:
    return {pod["metadata"]["uid"] for group in pods.values() for pod in group}


def test_an_upgrade_of_the_serve_config_alone_keeps_the_cluster_and_pods(
    cluster: KubeCluster, api: Api, helm: Helm, release: Docs
) -> None:
    """helm/baton/README.md: a Serve config change is applied in place, no new pods; the
    generated Secrets are kept (helm's `lookup`, which only a live API server answers)."""
    raycluster = only_cluster(api, cluster, NAMESPACE, RELEASE)
    before = uids(started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS))
    generated = [doc for doc in release if doc["kind"] == "Secret"]
    secrets = [api.get(secret, NAMESPACE)["data"] for secret in generated]
    reconciled_after(cluster, lambda: upgrade(helm, "engine.n_ctx=8192", "replicas.count=1"))
    assert [api.get(secret, NAMESPACE)["data"] for secret in generated] == secrets
    assert len(generated) == 4  # API keys and HMAC key, two Redis passwords, the Ray token
    rayservice = api.get(rendered(release, "RayService"), NAMESPACE)
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["engine"]["n_ctx"] == 8192
    assert (
        only_cluster(api, cluster, NAMESPACE, RELEASE)["metadata"]["uid"]
        == raycluster["metadata"]["uid"]
    )
    assert uids(started_pods(api, cluster, NAMESPACE, RELEASE, WORKERS)) == before


def test_an_upgrade_of_the_image_starts_a_second_cluster_that_waits_for_gpus(
    cluster: KubeCluster, api: Api, helm: Helm, release: Docs
) -> None:
    """helm/baton/README.md, `NewCluster`: a Ray cluster change (a new image, a changed
    value) starts a second RayCluster from the new spec; without free GPUs its workers stay
    Pending while the first cluster's hold them. (The first cluster never served here, so
    KubeRay then deletes it rather than waiting for the new one's app: see operations.md.)"""
    first = only_cluster(api, cluster, NAMESPACE, RELEASE)["metadata"]["name"]
    upgrade(helm, "image.tag=0.1.1", "engine.n_slots=8")
    second = cluster.wait_for(
        "the second RayCluster",
        lambda: [
            c for c in ray_clusters(api, NAMESPACE, RELEASE) if c["metadata"]["name"] != first
        ],
    )[0]["metadata"]["name"]

    def pending() -> str:
        stored = api.get(rendered(release, "RayService"), NAMESPACE)
        return stored["status"]["pendingServiceStatus"].get("rayClusterName", "")

    cluster.wait_for("the second cluster pending", lambda: pending() == second)
    new = pods_by_type(settled_pods(api, cluster, NAMESPACE, second, WORKERS))
    assert {pod["spec"]["containers"][0]["image"] for g in new.values() for pod in g} == {
        f"{IMAGE}:0.1.1"
    }
    for worker in new["worker"]:
        assert f"Insufficient {GPU_RESOURCE}" in (unschedulable(worker) or "")
    old_images = {
        pod["spec"]["containers"][0]["image"]
        for pod in api.list(*POD, NAMESPACE, labelSelector=f"ray.io/cluster={first}")
    }
    assert old_images == {f"{IMAGE}:0.1.0"}


def test_only_loopback_addresses_are_contacted(
    cluster: KubeCluster, api: Api, release: Docs
) -> None:
    """Every connection the components hold, sampled for 5 s after all the above: to
    127.0.0.1, never to a fake node, pod or service address."""
    seen: set[str] = set()
    for _ in range(10):
        seen |= remote_addresses(cluster.pids)
        time.sleep(0.5)
    assert seen, "no connection seen: the sampling reads nothing"
    assert all(ipaddress.ip_address(address).is_loopback for address in seen), seen


def test_uninstall_leaves_nothing_behind(
    cluster: KubeCluster, api: Api, helm: Helm, release: Docs
) -> None:
    """Within helm's wait: KubeRay's Redis clean-up Job cannot start once helm has deleted
    the release's ServiceAccount and Secrets, so each RayCluster waits out the chart's
    `gcsFaultTolerance.cleanupTimeoutSeconds` (KubeRay's own 300 s outlasted the wait)."""
    result = helm("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=4m")
    assert result.returncode == 0, result.stderr
    left: list[tuple[str, str]] = []

    def empty() -> bool:
        left[:] = namespace_objects(cluster, NAMESPACE)
        return not left

    with contextlib.suppress(TimeoutError):
        cluster.wait_for(f"an empty {NAMESPACE}", empty, timeout_s=180)
    assert left == []

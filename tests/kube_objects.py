"""Objects on the test control plane (`kube_cluster`): where each kind lives in the API,
helm run against it, restricted namespaces, and what a rendered object keeps once stored."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from kube_cluster import ApiError, KubeCluster

HELM = Path(sys.executable).parent / "helm"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
Docs = list[dict[str, Any]]


class Api:
    """Where each kind lives (from the API server's discovery) and typed requests on it."""

    def __init__(self, cluster: KubeCluster) -> None:
        self.cluster = cluster
        self.found: dict[tuple[str, str], tuple[str, bool] | None] = {}

    def resource(self, api_version: str, kind: str) -> tuple[str, bool] | None:
        """(plural name, namespaced) of `kind`, or None where the server does not serve it."""
        if (api_version, kind) not in self.found:
            self.found[api_version, kind] = self.discover(api_version, kind)
        return self.found[api_version, kind]

    def discover(self, api_version: str, kind: str) -> tuple[str, bool] | None:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            resources = self.cluster.get(base)["resources"]
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        for resource in resources:
            if resource["kind"] == kind and "/" not in resource["name"]:
                return resource["name"], resource["namespaced"]
        return None

    def path(self, api_version: str, kind: str, namespace: str, name: str = "") -> str:
        found = self.resource(api_version, kind)
        assert found, f"the API server serves no {kind} in {api_version}"
        plural, namespaced = found
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        scope = f"/namespaces/{namespace}" if namespaced else ""
        return f"{base}{scope}/{plural}" + (f"/{name}" if name else "")

    def get(self, doc: dict[str, Any], namespace: str) -> dict[str, Any]:
        name = doc["metadata"]["name"]
        return self.cluster.get(self.path(doc["apiVersion"], doc["kind"], namespace, name))

    def list(self, api_version: str, kind: str, namespace: str, **params: Any) -> Docs:
        return self.cluster.items(self.path(api_version, kind, namespace), **params)

    def dry_run_create(self, doc: dict[str, Any], namespace: str) -> list[str]:
        """Create `doc` with every server-side check and no effect; returns the warnings.
        Unknown or duplicate fields are errors (`fieldValidation=Strict`)."""
        path = self.path(doc["apiVersion"], doc["kind"], namespace)
        response = self.cluster.http.post(
            path, json=doc, params={"dryRun": "All", "fieldValidation": "Strict"}
        )
        if response.status_code >= 400:
            raise ApiError(response)
        return response.headers.get_list("warning")


def create_namespace(cluster: KubeCluster, name: str, labels: dict[str, str]) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}
    cluster.create("/api/v1/namespaces", body)

    def default_service_account() -> bool:  # made by the controller manager, as on any cluster
        names = [
            sa["metadata"]["name"]
            for sa in cluster.items(f"/api/v1/namespaces/{name}/serviceaccounts")
        ]
        return "default" in names

    cluster.wait_for(f"default ServiceAccount in {name}", default_service_account)


def helm_runner(cluster: KubeCluster, home: Path) -> Callable[..., subprocess.CompletedProcess]:
    """`helm(*args)`: the pinned helm against the test cluster, with folders of its own."""
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig),
        **{f"HELM_{d}_HOME": str(home / d.lower()) for d in ("CACHE", "CONFIG", "DATA")},
    }

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(HELM), *args], capture_output=True, text=True, env=env, timeout=300
        )

    return run


def manifest_docs(text: str) -> Docs:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def contains(actual: Any, expected: Any) -> bool:
    """Whether `actual` holds everything `expected` says: every key of a mapping, every item
    of a list (in some item of the other: the server and KubeRay add their own), the same
    scalars (a number also as the string a quantity is stored as)."""
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(
            key in actual and contains(actual[key], value) for key, value in expected.items()
        )
    if isinstance(expected, list):
        return isinstance(actual, list) and all(
            any(contains(item, wanted) for item in actual) for wanted in expected
        )
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        return actual in (expected, str(expected))  # a quantity comes back as a string
    return actual == expected


def differences(actual: Any, expected: Any, where: str = "") -> list[str]:
    """Where `contains(actual, expected)` fails, as paths: for the assertion message."""
    if contains(actual, expected):
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        found = [
            d for k, v in expected.items() for d in differences(actual.get(k), v, f"{where}.{k}")
        ]
        return found or [where]
    if isinstance(expected, list) and isinstance(actual, list):  # items matched by name
        named = {item.get("name"): item for item in actual if isinstance(item, dict)}
        missing = [item for item in expected if not any(contains(a, item) for a in actual)]
        return [
            d
            for item in missing
            for d in (
                differences(named.get(item.get("name")), item, f"{where}[{item.get('name')}]")
                if isinstance(item, dict)
                else [f"{where}: no {item!r}"]
            )
        ] or [where]
    return [f"{where}: wanted {expected!r}, found {actual!r}"]


def served_namespaced_kinds(cluster: KubeCluster) -> list[tuple[str, str]]:
    """(path under a namespace's API, kind) of every namespaced resource the server lists."""
    groups = [("/api/v1", "v1")]
    for group in cluster.get("/apis")["groups"]:
        version = group["preferredVersion"]["groupVersion"]
        groups.append((f"/apis/{version}", version))
    kinds = []
    for base, _ in groups:
        for resource in cluster.get(base)["resources"]:
            if (
                resource["namespaced"]
                and "/" not in resource["name"]
                and "list" in resource["verbs"]
            ):
                kinds.append((f"{base}/namespaces/{{ns}}/{resource['name']}", resource["kind"]))
    return kinds


# What every namespace holds from its creation on, whatever is installed in it.
NAMESPACE_DEFAULTS = {("ServiceAccount", "default"), ("ConfigMap", "kube-root-ca.crt")}
EVENT_KINDS = {"Event"}  # a record of what happened, left to expire


def namespace_objects(cluster: KubeCluster, namespace: str) -> list[tuple[str, str]]:
    """(kind, name) of everything in `namespace` but its defaults and events."""
    found = []
    for path, kind in served_namespaced_kinds(cluster):
        if kind in EVENT_KINDS:
            continue
        for item in cluster.items(path.format(ns=namespace)):
            found.append((kind, item["metadata"]["name"]))
    return sorted(set(found) - NAMESPACE_DEFAULTS)


def selector_query(selector: dict[str, Any]) -> str:
    """A LabelSelector as the `labelSelector` query the API server evaluates itself."""
    terms = [f"{key}={value}" for key, value in selector.get("matchLabels", {}).items()]
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        values = ",".join(expression.get("values", []))
        terms.append(
            {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})"}.get(operator)
            or {"Exists": key, "DoesNotExist": f"!{key}"}[operator]
        )
    return ",".join(terms)

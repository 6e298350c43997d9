"""A real Kubernetes control plane on loopback, for the chart's cluster tests.

etcd, kube-apiserver (self-signed certificates, bound to 127.0.0.1), kube-scheduler,
kube-controller-manager, the KubeRay operator (no leader election) and KWOK, all built by
`deploy/kube_build.py`. KWOK plays the kubelet of fake nodes: CPU nodes, and GPU nodes that
declare `nvidia.com/gpu` and carry the usual GPU taint. A pod bound to one is Running with
its containers started but never Ready (`tests/kube_stages/pod-started.yaml`): no process
runs behind it, and KubeRay waits for a Ready head before it calls the dashboard. Every
component listens on 127.0.0.1; the nodes' address is 127.0.0.1 and the pods' are in
127.244.0.0/16, so what dials a pod anyway (the API server's pod proxy, which KubeRay asks
for the head's Serve port) is refused on this machine. Nothing leaves loopback:
`remote_addresses` reads the connections the components hold.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from kube_certs import Certificates, make_certificates, write_kubeconfig

from baton_serve.deploy import kube_build
from baton_serve.deploy.ports import free_port

LOOPBACK = "127.0.0.1"
SERVICE_RANGE = "10.96.0.0/16"  # allocated to Services; nothing here dials a Service's IP
# Pod addresses KWOK hands out are loopback ones: whatever dials a pod (the API server's pod
# proxy, which KubeRay asks for the head's Serve port even while the head is not Ready) gets
# a refused connection on this machine, never a packet on the network.
POD_RANGE = "127.244.0.0/16"
NODE_ADDRESS = LOOPBACK  # the fake nodes' (and their "kubelets'") address
FAKE_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
STAGES = Path(__file__).resolve().parent / "kube_stages"
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FakeNode:
    name: str
    cpu: str
    memory: str
    gpus: int = 0

    def manifest(self) -> dict[str, Any]:
        capacity = {"cpu": self.cpu, "memory": self.memory, "pods": "110"}
        if self.gpus:
            capacity[GPU_RESOURCE] = str(self.gpus)
        key, value = FAKE_NODE_ANNOTATION
        labels = {"kubernetes.io/hostname": self.name, "type": "kwok"}
        labels |= {"nvidia.com/gpu.present": "true"} if self.gpus else {}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "annotations": {key: value}, "labels": labels},
            "spec": {"taints": [GPU_TAINT]} if self.gpus else {},
            "status": {"capacity": capacity, "allocatable": capacity},
        }


DEFAULT_NODES = (
    FakeNode("cpu-0", "8", "32Gi"),
    FakeNode("cpu-1", "8", "32Gi"),
    FakeNode("gpu-0", "16", "64Gi", gpus=1),
    FakeNode("gpu-1", "16", "64Gi", gpus=1),
)


class ApiError(RuntimeError):
    def __init__(self, response: httpx.Response) -> None:
        self.status = response.status_code
        self.body = response.text
        try:
            self.message = str(response.json().get("message", ""))
        except ValueError:
            self.message = self.body
        super().__init__(
            f"{response.request.method} {response.request.url}: {self.status} {self.body}"
        )


@dataclass
class KubeCluster:
    """The running control plane: its address, kubeconfig and a REST client as admin."""

    server: str
    kubeconfig: Path
    certs: Certificates
    logs: Path
    http: httpx.Client = field(repr=False)
    pids: list[int] = field(default_factory=list)  # the components' processes

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> Any:
        response = self.http.request(method, path, json=body, params=params or None)
        if response.status_code >= 400:
            raise ApiError(response)
        return response.json() if response.content else None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, **params)

    def create(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, body)

    def items(self, path: str, **params: Any) -> list[dict[str, Any]]:
        return self.get(path, **params)["items"]

    def wait_for(
        self, what: str, found: Callable[[], Any], timeout_s: float = 60.0, every_s: float = 0.5
    ) -> Any:
        """`found()` once it is truthy; fails after `timeout_s` naming `what`."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = found()
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} after {timeout_s:.0f} s (logs: {self.logs})")
            time.sleep(every_s)


class Processes:
    """The components' processes, stopped together (newest first) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[tuple[str, subprocess.Popen[bytes]]] = []

        self.pids: list[int] = []

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.running.append((name, process))
        self.pids.append(process.pid)

    def check_alive(self) -> None:
        for name, process in self.running:
            if process.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")

    def stop(self) -> None:
        """Newest first, each gone before the next: the API server before etcd."""
        for _, process in reversed(self.running):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_healthy(processes: Processes, url: str, client: httpx.Client, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        processes.check_alive()
        with contextlib.suppress(httpx.HTTPError):
            if client.get(url).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not healthy at {url} after {START_TIMEOUT_S:.0f} s")
        time.sleep(0.3)


def client_tls(certs: Certificates) -> ssl.SSLContext:
    """TLS as the admin client: the test CA trusted, the client certificate presented."""
    context = ssl.create_default_context(cafile=str(certs.ca))
    context.load_cert_chain(str(certs.client_cert), str(certs.client_key))
    return context


def serving_flags(cache: Path, kubeconfig: Path) -> list[str]:
    """A controller's own HTTPS endpoint: loopback, a free port, the admin kubeconfig."""
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--bind-address={LOOPBACK}",
        f"--secure-port={free_port()}",
        f"--cert-dir={cache}",
        "--leader-elect=false",
    ]


def start_etcd(processes: Processes, work: Path) -> str:
    etcd = kube_build.part_dir("etcd") / "etcd"
    client_url = f"http://{LOOPBACK}:{free_port()}"
    peer_url = f"http://{LOOPBACK}:{free_port()}"
    processes.start(
        "etcd",
        [
            str(etcd),
            "--name=test",
            f"--data-dir={work / 'etcd'}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}",
            "--unsafe-no-fsync",  # a throw-away store: no fsync on the shared disk
            "--log-level=warn",
        ],
    )
    with httpx.Client(timeout=2) as client:
        wait_healthy(processes, f"{client_url}/health", client, "etcd")
    return client_url


def start_apiserver(processes: Processes, work: Path, certs: Certificates, etcd: str) -> str:
    port = free_port()
    apiserver = kube_build.part_dir("kubernetes") / "kube-apiserver"
    processes.start(
        "kube-apiserver",
        [
            str(apiserver),
            f"--etcd-servers={etcd}",
            f"--bind-address={LOOPBACK}",
            f"--advertise-address={LOOPBACK}",
            f"--secure-port={port}",
            f"--tls-cert-file={certs.server_cert}",
            f"--tls-private-key-file={certs.server_key}",
            f"--client-ca-file={certs.ca}",
            f"--service-account-key-file={certs.service_account_public}",
            f"--service-account-signing-key-file={certs.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--authorization-mode=Node,RBAC",
            "--profiling=false",
            f"--cert-dir={work / 'apiserver-certs'}",
        ],
    )
    return f"https://{LOOPBACK}:{port}"


def start_kwok(processes: Processes, kubeconfig: Path) -> None:
    kwok = kube_build.part_dir("kwok")
    stages = [*sorted((kwok / "stages").glob("*.yaml")), *sorted(STAGES.glob("*.yaml"))]
    key, value = FAKE_NODE_ANNOTATION
    processes.start(
        "kwok",
        [
            str(kwok / "kwok"),
            f"--kubeconfig={kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={key}={value}",
            f"--cidr={POD_RANGE}",
            f"--node-ip={NODE_ADDRESS}",
            f"--server-address={LOOPBACK}:{free_port()}",
            "--node-lease-duration-seconds=40",
            *(f"--config={stage}" for stage in stages),
        ],
    )


def start_kuberay(processes: Processes, kubeconfig: Path) -> None:
    kuberay = kube_build.part_dir("kuberay") / "kuberay-operator"
    processes.start(
        "kuberay-operator",
        [
            str(kuberay),
            "--enable-leader-election=false",
            f"--metrics-addr={LOOPBACK}:{free_port()}",
            f"--health-probe-bind-address={LOOPBACK}:{free_port()}",
            # Were a head pod ever Ready, its dashboard would be reached through the API server.
            "--use-kubernetes-proxy",
            "--log-stdout-encoder=console",
        ],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
    )


def install_crds(cluster: KubeCluster) -> None:
    """KubeRay's CRDs from the operator's module, established before the operator starts."""
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for path in sorted((kube_build.part_dir("kuberay") / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        cluster.create(crds, crd)
        name = crd["metadata"]["name"]

        def established(name: str = name) -> bool:
            conditions = cluster.get(f"{crds}/{name}").get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        cluster.wait_for(f"established CRD {name}", established)


def add_nodes(cluster: KubeCluster, nodes: tuple[FakeNode, ...]) -> None:
    for node in nodes:
        cluster.create("/api/v1/nodes", node.manifest())

    def all_ready() -> bool:
        ready = 0
        for node in cluster.items("/api/v1/nodes"):
            conditions = node.get("status", {}).get("conditions", [])
            ready += any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
        return ready == len(nodes)

    cluster.wait_for("Ready fake nodes", all_ready)


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in the host's byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def remote_addresses(pids: list[int]) -> set[str]:
    """The remote addresses of the TCP connections these processes hold now (listening
    sockets aside), read from /proc."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    remotes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            listening = fields[3] == "0A"
            if fields[9] in inodes and not listening:
                address = _address(fields[2].split(":")[0])
                mapped = getattr(address, "ipv4_mapped", None)
                remotes.add(str(mapped or address))
    return remotes


# controller-runtime's line for a reconcile that returned an error and is retried (a head pod
# not in the operator's cache yet, an update that lost a race): KubeRay's ordinary course.
RETRIED_RECONCILE = "Reconciler error"


def operator_errors(cluster: KubeCluster) -> list[str]:
    """The KubeRay operator's error lines so far ("logger: message"), retried reconciles
    aside."""
    errors = []
    for line in (cluster.logs / "kuberay-operator.log").read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) >= 4 and fields[1] == "error" and fields[3] != RETRIED_RECONCILE:
            errors.append(f"{fields[2]}: {fields[3]}")
    return errors


def operator_log_size(cluster: KubeCluster) -> int:
    return (cluster.logs / "kuberay-operator.log").stat().st_size


def rayservice_reconciles(cluster: KubeCluster, namespace: str, name: str, since: int) -> set[str]:
    """The ids of the operator's reconciles of one RayService logged after byte `since` of
    its log (KubeRay requeues a RayService every 2 s while its head is not ready)."""
    with (cluster.logs / "kuberay-operator.log").open("rb") as log:
        log.seek(since)
        text = log.read().decode(errors="replace")
    subject = f'"RayService": {{"name":"{name}","namespace":"{namespace}"}}'
    return {
        line.split('"reconcileID": "')[1].split('"')[0]
        for line in text.splitlines()
        if subject in line and '"reconcileID": "' in line
    }


@contextlib.contextmanager
def kube_cluster(work: Path, nodes: tuple[FakeNode, ...] = DEFAULT_NODES) -> Iterator[KubeCluster]:
    """The whole control plane in `work` (certificates, etcd's data, every component's log)."""
    missing = kube_build.missing(kube_build.default_cache())
    if missing:
        raise RuntimeError(
            f"not built: {missing}: `python -m baton_serve.deploy.kube_build install`"
        )
    logs = work / "logs"
    logs.mkdir(parents=True)
    processes = Processes(logs)
    try:
        certs = make_certificates(work / "pki")
        server = start_apiserver(processes, work, certs, start_etcd(processes, work))
        http = httpx.Client(base_url=server, verify=client_tls(certs), timeout=30)
        wait_healthy(processes, "/readyz", http, "kube-apiserver")
        kubeconfig = write_kubeconfig(work / "kubeconfig", server, certs)
        cluster = KubeCluster(server, kubeconfig, certs, logs, http, processes.pids)
        kubernetes = kube_build.part_dir("kubernetes")
        processes.start(
            "kube-controller-manager",
            [
                str(kubernetes / "kube-controller-manager"),
                *serving_flags(work / "kcm-certs", kubeconfig),
                f"--service-account-private-key-file={certs.service_account_key}",
                f"--root-ca-file={certs.ca}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
            ],
        )
        processes.start(
            "kube-scheduler",
            [
                str(kubernetes / "kube-scheduler"),
                *serving_flags(work / "scheduler-certs", kubeconfig),
            ],
        )
        install_crds(cluster)
        start_kuberay(processes, kubeconfig)
        start_kwok(processes, kubeconfig)
        add_nodes(cluster, nodes)
        processes.check_alive()
        yield cluster
        processes.check_alive()
    finally:
        processes.stop()

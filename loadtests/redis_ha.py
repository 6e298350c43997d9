"""Throw-away Redis without a single point of failure, for tests: a Redis Cluster of primaries
and a Sentinel-watched master with one replica, all real `redis-server` processes."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

import redis

from baton_serve.deploy.ports import free_port
from baton_serve.loadtests.redis_server import RedisServer, redis_server_path

MASTER_NAME = "baton"


def _wait(what: str, condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose Cluster bus port (10,000 higher) is free too."""
    while True:
        port = random.randint(20_000, 50_000)
        if _bindable(port) and _bindable(port + 10_000):
            return port


def _synced(replication: dict) -> bool:
    return replication["role"] == "master" or replication["master_link_status"] == "up"


def redis_cli_path() -> str | None:
    """Return the `redis-cli` executable on PATH, or None."""
    return shutil.which("redis-cli")


class _Servers:
    """Started on entering (stopped again if starting fails), stopped on leaving."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalRedisCluster(_Servers):
    """`shards` primaries, each with `replicas` replicas, on 127.0.0.1, joined by
    `redis-cli --cluster create`; ready once every node reports ``cluster_state:ok`` and
    every replica has synced (so it may be promoted)."""

    def __init__(self, shards: int = 3, replicas: int = 0) -> None:
        cluster_args = ("--cluster-enabled", "yes", "--cluster-node-timeout", "2000")
        count = shards * (1 + replicas)
        self.replicas = replicas
        self.nodes = [RedisServer(cluster_port(), extra_args=cluster_args) for _ in range(count)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        cli = redis_cli_path()
        if cli is None:
            raise FileNotFoundError("redis-cli is not on PATH")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        replicas = ["--cluster-replicas", str(self.replicas)]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, *replicas, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        for node in self.nodes:
            with redis.Redis(port=node.port, socket_timeout=1) as client:
                _wait("the cluster", lambda c=client: c.cluster("info")["cluster_state"] == "ok")
                _wait("a replica's sync", lambda c=client: _synced(c.info("replication")))

    def owner(self, key: str) -> int:
        """The port of the primary that holds `key`, as a live node sees the Cluster now."""
        live = next(node for node in self.nodes if node.running)
        with redis.RedisCluster(host="127.0.0.1", port=live.port) as client:
            return int(client.get_node_from_key(key).port)

    def kill(self, port: int) -> None:
        """Kill the node on `port` (its replica, if any, takes over its slots)."""
        next(node for node in self.nodes if node.port == port).stop()

    def stop(self) -> None:
        for node in self.nodes:
            node.__exit__(None, None, None)


class LocalSentinel(_Servers):
    """A master, its replica and one Sentinel (quorum 1) watching them as `MASTER_NAME`."""

    def __init__(self) -> None:
        self.master = RedisServer()
        self.replica: RedisServer | None = None
        self.port = free_port()
        self._sentinel: RedisServer | None = None

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{MASTER_NAME}/0"

    def start(self) -> None:
        self.master.start()
        self.replica = RedisServer(extra_args=("--replicaof", "127.0.0.1", str(self.master.port)))
        self.replica.start()
        replica = redis.Redis(port=self.replica.port, socket_timeout=1)
        try:  # synced before the Sentinel's first look, so it may promote the replica
            _wait("the replica", lambda: replica.info("replication")["master_link_status"] == "up")
        finally:
            replica.close()
        sentinel = RedisServer(self.port)
        config = sentinel.dir / "sentinel.conf"
        config.write_text(
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 1000\n"
            f"sentinel failover-timeout {MASTER_NAME} 5000\n"
        )
        # `redis-server <file> --sentinel` is the Sentinel (Debian ships no redis-sentinel);
        # RedisServer's own flags follow the file, as redis-server wants.
        sentinel.leading_args = (str(config), "--sentinel")
        self._sentinel = sentinel
        sentinel.start()
        _wait("the sentinel to see the replica", lambda: len(self._promotable()) == 1)

    def _promotable(self) -> list[dict]:
        with redis.Redis(port=self.port, socket_timeout=1, decode_responses=True) as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
        found = [dict(zip(r[::2], r[1::2])) if isinstance(r, list) else r for r in replicas]
        return [r for r in found if r["flags"] == "slave" and r["master-link-status"] == "ok"]

    def master_port(self) -> int:
        """The master's port as the Sentinel names it now."""
        with redis.Redis(port=self.port, socket_timeout=1) as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)
        return int(port)

    def failover(self, kill_master: bool = False) -> int:
        """Promote the replica: SENTINEL FAILOVER (the old master lives on until the Sentinel
        makes it a replica), or `kill_master` and let the Sentinel notice. Return the new
        master's port once the Sentinel names it and it answers as a master."""
        old = self.master_port()
        if kill_master:
            self.master.stop()
        else:
            with redis.Redis(port=self.port, socket_timeout=1) as client:
                client.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        _wait("the failover", lambda: self.master_port() != old)
        new = self.master_port()
        with redis.Redis(port=new, socket_timeout=1) as client:
            _wait("the new master", lambda: client.info("replication")["role"] == "master")
        return new

    def stop(self) -> None:
        for server in (self._sentinel, self.replica, self.master):
            if server is not None:
                server.__exit__(None, None, None)


def redis_ha_available() -> bool:
    """Whether `redis-server` and `redis-cli` are both on PATH."""
    return redis_server_path() is not None and redis_cli_path() is not None

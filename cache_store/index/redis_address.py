"""Where the Redis index lives: one server, a Sentinel-watched master, or a Redis Cluster.

Three address forms (``rediss`` in place of ``redis``: TLS to every node):

- ``redis://[[user]:password@]host[:port][/db]``: one server (redis-py's own URL, as is).
- ``redis+sentinel://[[user]:password@]host1[:26379],host2[:26379]/<master name>[/db]
  [?sentinel_password=…]``: the master that the Sentinels name; the user information
  authenticates with the master (and its replicas), ``sentinel_password`` with the
  Sentinels themselves (none by default).
- ``redis+cluster://[[user]:password@]host1[:6379],host2[:6379]``: a Redis Cluster, found
  from any of these seed nodes (a Cluster has one database, so no ``/db``).

Parsing only (no redis-py), so configuration checks share it; `redis_clients` opens them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import parse_qs, unquote

REDIS_SCHEMES = ("redis", "rediss")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
ALL_SCHEMES = REDIS_SCHEMES + SENTINEL_SCHEMES + CLUSTER_SCHEMES
SENTINEL_PORT = 26379
REDIS_PORT = 6379
SENTINEL_QUERY = ("sentinel_password",)
REDIS_FORMS = (
    "a redis:// or rediss:// URL, a redis+sentinel://host:26379[,…]/<master name>[/db] "
    "or a redis+cluster://host:port[,…] address"
)

Kind = Literal["server", "sentinel", "cluster"]


@dataclass(frozen=True)
class RedisAddress:
    """A parsed index address; `url` is the text it came from (it may hold a password)."""

    kind: Kind
    url: str = field(repr=False, compare=False)
    hosts: tuple[tuple[str, int], ...] = ()
    master: str = ""
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)
    tls: bool = False

    def describe(self) -> str:
        """Where a Sentinel or Cluster address leads, for messages: hosts and names, never
        a password (`redis_clients` names one server itself)."""
        nodes = ",".join(f"{host}:{port}" for host, port in self.hosts)
        if self.kind == "sentinel":
            return f"redis master {self.master!r} of sentinels {nodes} (db {self.db})"
        return f"redis cluster of {nodes}"


def is_redis_address(spec: str) -> bool:
    """Whether `spec` names a scheme of this module (it may still be malformed)."""
    return spec.partition("://")[0] in ALL_SCHEMES and "://" in spec


def parse_redis_address(spec: str) -> RedisAddress:
    """Parse `spec` (see the module's docstring); ValueError names what is wrong."""
    scheme, sep, rest = spec.partition("://")
    if not sep or scheme not in ALL_SCHEMES:
        named = f"{scheme}://" if sep else "(none)"
        raise ValueError(
            f"unknown Redis address scheme {named!r}: expected one of "
            + ", ".join(f"{s}://" for s in ALL_SCHEMES)
        )
    tls = scheme.startswith("rediss")
    if scheme in REDIS_SCHEMES:
        return RedisAddress("server", spec, tls=tls)
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise ValueError(f"{scheme}:// address: a '#' fragment is not understood")
    rest, _, query = rest.partition("?")
    userinfo, at, rest = rest.rpartition("@")
    nodes, _, path = rest.partition("/")
    username, password = _credentials(userinfo) if at else (None, None)
    sentinel = scheme in SENTINEL_SCHEMES
    options = _query(scheme, query, SENTINEL_QUERY if sentinel else ())
    hosts = _hosts(scheme, nodes, SENTINEL_PORT if sentinel else REDIS_PORT)
    if not sentinel:
        if path:
            raise ValueError(
                f"{scheme}:// address: a Redis Cluster has no databases or names, "
                f"so nothing may follow the hosts (got /{path})"
            )
        return RedisAddress("cluster", spec, hosts, username=username, password=password, tls=tls)
    master, _, db_text = path.partition("/")
    if not master:
        raise ValueError(
            f"{scheme}:// address has no master name: expected "
            f"{scheme}://host:26379[,host:26379…]/<master name>[/db]"
        )
    if db_text and not db_text.isdigit():
        raise ValueError(f"{scheme}:// address: the database must be a number, got {db_text!r}")
    return RedisAddress(
        "sentinel",
        spec,
        hosts,
        master=unquote(master),
        db=int(db_text or 0),
        username=username,
        password=password,
        sentinel_password=options.get("sentinel_password"),
        tls=tls,
    )


def redact(url: str) -> str:
    """`url` with its user information and ``sentinel_password`` replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    rest, question, query = rest.partition("?")
    _, at, rest = rest.rpartition("@")
    query = re.sub(r"(sentinel_password=)[^&#]*", r"\1***", query)
    return f"{scheme}{sep}{'***@' if at else ''}{rest}{question}{query}"


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis-py reads "redis://secret@host" as a password too
        return None, unquote(user) or None
    return unquote(user) or None, unquote(password) or None


def _query(scheme: str, query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    options = parse_qs(query, keep_blank_values=True, strict_parsing=False) if query else {}
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        what = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"{scheme}:// address: unknown option(s) {unknown} (understood: {what})")
    return {name: values[-1] for name, values in options.items()}


def _hosts(scheme: str, nodes: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts = []
    for node in nodes.split(","):
        node = node.strip()
        if not node:
            continue
        if node.startswith("["):  # [IPv6]:port
            host, _, port_text = node[1:].partition("]")
            port_text = port_text.removeprefix(":")
        else:
            host, _, port_text = node.partition(":")
        if not host:
            raise ValueError(f"{scheme}:// address: a host is empty in {node!r}")
        if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ValueError(f"{scheme}:// address: bad port {port_text!r} in {node!r}")
        hosts.append((host, int(port_text) if port_text else default_port))
    if not hosts:
        raise ValueError(f"{scheme}:// address has no hosts: expected {scheme}://host:port[,…]")
    return tuple(hosts)

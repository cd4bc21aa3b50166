"""The Redis URLs every process accepts: what redis-py reads (``redis://``, ``rediss://``,
``unix://``), and a Sentinel-managed master.

``redis+sentinel://[:password@]host:port[,host:port...]/service[/db]`` names the sentinels and
the master's service name; the client asks the sentinels for the current master and asks again
after a failover (a connection error, or ``READONLY`` from a demoted master), retrying the command
with backoff meanwhile. The password, if any, is the master's; sentinels that need one read it
from ``?sentinel_password=``. A retried write whose first attempt reached the old master before
it died runs twice: the worker's writes are fenced and idempotent; an enqueue may then create a
second job (the idempotency key, when the caller sets one, prevents that).

``redis+cluster://[:password@]host:port[,host:port...]`` names some nodes of a Redis Cluster;
the client learns the slot map from them (``redis.cluster.RedisCluster``) and follows MOVED /
ASK redirections. The job store then uses its cluster key layout (:mod:`pagedserve.keys`), in
which every script touches one hash slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlparse

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
#: Seconds a sentinel may take to answer "who is the master?".
SENTINEL_TIMEOUT_S = 2.0
#: A command that meets a dead or demoted master is retried this many times with backoff
#: (capped at 1 s, so ~15 s in all: a failover with ``down-after-milliseconds`` of a few seconds).
FAILOVER_RETRIES = 20


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str | None = None
    sentinel_password: str | None = None


def parse_sentinel(url: str) -> SentinelTarget | None:
    """The sentinel target a ``redis+sentinel://`` URL names; None for any other URL."""
    if not url.startswith(f"{SENTINEL_SCHEME}://"):
        return None
    rest = url[len(SENTINEL_SCHEME) + 3 :]
    auth, _, rest = rest.rpartition("@")
    hosts, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    parts = [p for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError(
            f"expected {SENTINEL_SCHEME}://host:port[,host:port]/service[/db], not {url!r}"
        )
    sentinels = []
    for h in hosts.split(","):
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"sentinel address {h!r} in {url!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    password = unquote(auth.partition(":")[2]) if auth else None
    extra = parse_qs(query).get("sentinel_password", [None])[0]
    return SentinelTarget(
        tuple(sentinels), unquote(parts[0]), int(parts[1]) if len(parts) == 2 else 0,
        password or None, extra,
    )  # fmt: skip


@dataclass(frozen=True)
class ClusterTarget:
    nodes: tuple[tuple[str, int], ...]
    password: str | None = None


def parse_cluster(url: str) -> ClusterTarget | None:
    """The startup nodes a ``redis+cluster://`` URL names; None for any other URL."""
    if not url.startswith(f"{CLUSTER_SCHEME}://"):
        return None
    rest = url[len(CLUSTER_SCHEME) + 3 :]
    auth, _, rest = rest.rpartition("@")
    hosts = rest.partition("?")[0].rstrip("/")
    nodes = []
    for h in hosts.split(",") if hosts else []:
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"cluster node {h!r} in {url!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError(f"expected {CLUSTER_SCHEME}://host:port[,host:port...], not {url!r}")
    password = unquote(auth.partition(":")[2]) if auth else None
    return ClusterTarget(tuple(nodes), password or None)


def is_cluster(client: object) -> bool:
    """Whether ``client`` talks to a Redis Cluster (the store then uses the cluster layout)."""
    return isinstance(client, RedisCluster)


def connect_url(url: str, **options: object) -> redis.Redis:
    """A client for ``url`` (see the module doc); ``options`` go to redis-py."""
    cluster = parse_cluster(url)
    if cluster is not None:
        nodes = [ClusterNode(h, p) for h, p in cluster.nodes]
        return RedisCluster(  # type: ignore[return-value]
            startup_nodes=nodes,
            password=cluster.password,
            **options,  # type: ignore[arg-type]
        )
    target = parse_sentinel(url)
    if target is None:
        return redis.Redis.from_url(url, **options)  # type: ignore[arg-type]
    sentinel_kwargs = {"socket_timeout": SENTINEL_TIMEOUT_S}
    if target.sentinel_password:
        sentinel_kwargs["password"] = target.sentinel_password  # type: ignore[assignment]
    sentinel = Sentinel(
        list(target.sentinels), sentinel_kwargs=sentinel_kwargs, socket_timeout=None
    )
    # Each retry opens a new connection, and a sentinel-managed connection asks the sentinels
    # for the master first: that is how a client follows a failover.
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.05), FAILOVER_RETRIES)
    return sentinel.master_for(  # type: ignore[no-any-return]
        target.service,
        db=target.db,
        password=target.password,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError],
        **options,
    )


def kombu_options(url: str) -> tuple[str, dict[str, object]]:
    """(broker/backend URL, transport options) as kombu and Celery's Redis backend spell ``url``."""
    if parse_cluster(url) is not None:
        raise ValueError(
            "Celery (kombu) cannot use a Redis Cluster as its broker: set PAGEDSERVE_BROKER_URL "
            "to a single Redis or Sentinel URL"
        )
    target = parse_sentinel(url)
    if target is not None:
        auth = f":{target.password}@" if target.password else ""
        hosts = ";".join(f"sentinel://{auth}{h}:{p}/{target.db}" for h, p in target.sentinels)
        opts: dict[str, object] = {"master_name": target.service}
        if target.sentinel_password:
            opts["sentinel_kwargs"] = {"password": target.sentinel_password}
        return hosts, opts
    u = urlparse(url)
    if u.scheme != "unix":
        return url, {}
    db = parse_qs(u.query).get("db", ["0"])[0]
    return f"redis+socket://{u.path}?virtual_host={db}", {}

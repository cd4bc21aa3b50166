"""Cost of authorisation: ``GET /v1/jobs/<id>`` (and ``POST /v1/jobs``) with and without tenants.

Two apps on one private redis-server, driven through Flask's test client (no sockets, so the
figures are the app's own cost): ``open`` (no keys) and ``keyed`` (``--tenants`` tenants' keys, one
admin key, a per-tenant open-jobs limit). Each request of the keyed app hashes the bearer key and
compares it with every digest, reads the job's tenant with the record and checks it; a keyed POST
also runs the tenant's admission and tag scripts. Rounds alternate between the two apps (the
machine is shared: alternating evens out drift); latencies are per request, in microseconds.

Prints one JSON line: p50/p99 of each and the ratios keyed / open.

Usage: ``python -m bench.auth_cost [--requests 3000] [--rounds 5] [--tenants 50]``
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from flask.testing import FlaskClient

from api import create_app
from bench.common import emit
from pagedserve.redis_util import LocalRedisServer


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def make_client(url: str, keys: str, **cfg: Any) -> FlaskClient:
    app = create_app({"redis_url": url, "api_keys": keys, **cfg})
    return app.test_client()


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("api.auth").setLevel(logging.ERROR)  # the open app's warning
    keys = ",".join(f"team-{i}:key-{i:04d}-secret" for i in range(args.tenants))
    keys += ",ops:key-admin:admin"
    server = LocalRedisServer().start()
    try:
        clients = {
            "open": (make_client(server.url, ""), {}),
            "keyed": (
                make_client(server.url, keys, tenant_max_queued=10**9),
                {"Authorization": f"Bearer key-{args.tenants - 1:04d}-secret"},  # the last key
            ),
        }
        job = {"prompt": "hello", "params": {"max_tokens": 4}}
        ids = {}
        for name, (c, h) in clients.items():
            resp = c.post("/v1/jobs", json=job, headers=h)
            assert resp.status_code == 202, resp.get_json()
            ids[name] = resp.get_json()["id"]
        get: dict[str, list[float]] = {"open": [], "keyed": []}
        post: dict[str, list[float]] = {"open": [], "keyed": []}
        for _ in range(args.rounds):
            for name, (c, h) in clients.items():
                path = f"/v1/jobs/{ids[name]}"
                assert c.get(path, headers=h).status_code == 200
                get[name] += timed(
                    lambda c=c, h=h, path=path: c.get(path, headers=h), args.requests
                )
                post[name] += timed(
                    lambda c=c, h=h: c.post("/v1/jobs", json=job, headers=h), args.requests // 4
                )
    finally:
        server.stop()
    out: dict[str, Any] = {"requests": args.requests * args.rounds, "tenants": args.tenants}
    for kind, xs in (("get", get), ("post", post)):
        for name in ("open", "keyed"):
            out[f"{kind}_{name}_p50_us"] = round(percentile(xs[name], 0.5), 1)
            out[f"{kind}_{name}_p99_us"] = round(percentile(xs[name], 0.99), 1)
        for q in ("p50", "p99"):
            ratio = out[f"{kind}_keyed_{q}_us"] / out[f"{kind}_open_{q}_us"]
            out[f"{kind}_ratio_{q}"] = round(ratio, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=3000, help="GETs per app per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tenants", type=int, default=50, help="tenants' keys configured")
    emit("auth_cost", run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()

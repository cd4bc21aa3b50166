"""``pagedserve api``: serve the app with gunicorn (or Flask's development server with ``--dev``).

Gunicorn runs threaded workers (``gthread``): server-sent event streams and online requests hold
a thread each while they are open, so ``--threads`` bounds them per process. Online requests get
``--threads`` minus :data:`STATUS_THREADS` seats per process (``ApiConfig.online_seats``), so the
status endpoints (``/v1/pool``, ``/healthz``, ``/metrics``) always find a free thread.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from flask import Flask

from api.app import create_app
from api.config import API_KEYS_ENV, ApiConfig
from pagedserve.keys import DEFAULT_PREFIX, PREFIX_ENV
from pagedserve.redis_util import URL_ENV, default_url


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve api", description=__doc__)
    ap.add_argument("--redis", default=None, help=f"Redis URL (default: ${URL_ENV})")
    prefix_help = f"key prefix (default: ${PREFIX_ENV} or {DEFAULT_PREFIX})"
    ap.add_argument("--prefix", default=None, help=prefix_help)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    ap.add_argument("--threads", type=int, default=64, help="threads per gunicorn worker")
    ap.add_argument("--timeout", type=int, default=120, help="gunicorn worker timeout (s)")
    ap.add_argument(
        "--api-keys", default=None, help=f"comma-separated bearer keys (default: ${API_KEYS_ENV})"
    )
    ap.add_argument("--dev", action="store_true", help="Flask's development server instead")
    return ap.parse_args(argv)


#: Threads of each gunicorn worker that online requests never take (kept for status endpoints).
STATUS_THREADS = 4


def config_from(args: argparse.Namespace) -> ApiConfig:
    overrides: dict[str, Any] = {"redis_url": args.redis or default_url()}
    if not args.dev:
        overrides["online_seats"] = max(1, args.threads - STATUS_THREADS)
    if args.prefix is not None:
        overrides["prefix"] = args.prefix
    if args.api_keys is not None:
        overrides["api_keys"] = args.api_keys
    return ApiConfig.from_env(**overrides)


def gunicorn_app(app: Flask, options: dict[str, Any]) -> Any:
    from gunicorn.app.base import BaseApplication

    class Standalone(BaseApplication):  # type: ignore[misc]
        def __init__(self) -> None:
            self.options = options
            self.application = app
            super().__init__()

        def load_config(self) -> None:
            for key, value in self.options.items():
                if key in self.cfg.settings and value is not None:
                    self.cfg.set(key, value)

        def load(self) -> Flask:
            return self.application

    return Standalone()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prefix is None and os.environ.get(PREFIX_ENV):
        args.prefix = os.environ[PREFIX_ENV]
    app = create_app(config_from(args))
    if args.dev:
        app.run(host=args.host, port=args.port, threaded=True)
        return 0
    options = {
        "bind": f"{args.host}:{args.port}",
        "workers": args.workers,
        "threads": args.threads,
        "worker_class": "gthread",
        "timeout": args.timeout,
        "accesslog": "-",
    }
    gunicorn_app(app, options).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``pagedserve api``: serve the app with gunicorn (or Flask's development server with ``--dev``).

Gunicorn runs threaded workers (``gthread``): server-sent event streams hold a thread each while
they are open, so ``--threads`` bounds concurrent streams per process.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flask import Flask

from api.app import create_app
from api.config import ApiConfig
from pagedserve.settings import add_options, build, opt


@dataclass(frozen=True)
class ServeConfig:
    """How ``pagedserve api`` serves the app (the app's own options are :class:`ApiConfig`)."""

    host: str = field(default="127.0.0.1", metadata=opt("address to bind"))
    port: int = field(default=8000, metadata=opt("port to bind"))
    workers: int = field(default=2, metadata=opt("gunicorn worker processes"))
    threads: int = field(default=16, metadata=opt("threads per gunicorn worker"))
    timeout: int = field(default=120, metadata=opt("gunicorn worker timeout (s)"))
    dev: bool = field(default=False, metadata=opt("Flask's development server instead"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pagedserve api", description=__doc__)
    add_options(ap, ServeConfig)
    add_options(ap.add_argument_group("app"), ApiConfig)
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> ApiConfig:
    return build(ApiConfig, args)


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
    serve = build(ServeConfig, args)
    app = create_app(config_from(args))
    if serve.dev:
        app.run(host=serve.host, port=serve.port, threaded=True)
        return 0
    options = {
        "bind": f"{serve.host}:{serve.port}",
        "workers": serve.workers,
        "threads": serve.threads,
        "worker_class": "gthread",
        "timeout": serve.timeout,
        "accesslog": "-",
    }
    gunicorn_app(app, options).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

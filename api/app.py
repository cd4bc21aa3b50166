"""The Flask app factory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flask import Flask, request

from api import auth, errors
from api.config import ApiConfig, as_config
from api.state import init_state

STATIC = Path(__file__).with_name("static")

#: Endpoints that take file uploads: only they may use the full ``max_content_length``.
UPLOAD_ENDPOINTS = frozenset({"openai.upload_file"})


def create_app(config: ApiConfig | Mapping[str, Any] | None = None) -> Flask:
    """Build the app. ``config``: an :class:`ApiConfig`, a mapping of its fields (over the
    environment: ``PAGEDSERVE_REDIS_URL``, ``PAGEDSERVE_PREFIX``, ``PAGEDSERVE_API_KEYS``), or
    ``None`` for the environment alone."""
    cfg = as_config(config)
    app = Flask(__name__, static_folder=str(STATIC), static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_content_length
    app.json.sort_keys = False  # type: ignore[attr-defined]
    init_state(app, cfg)
    errors.register(app)
    auth.register(app, cfg)

    @app.before_request
    def _limit_body() -> None:
        if request.endpoint not in UPLOAD_ENDPOINTS:
            request.max_content_length = cfg.max_json_bytes

    _register_blueprints(app)
    return app


def _register_blueprints(app: Flask) -> None:
    from api import (
        dashboard,
        jobs,
        metrics,
        models_route,
        openai_batches,
        openai_online,
        openapi,
        status,
    )

    for bp in (
        status.health,
        status.bp,
        jobs.bp,
        metrics.bp,
        openapi.bp,
        dashboard.bp,
        openai_batches.bp,
        openai_online.bp,
        models_route.bp,
    ):
        app.register_blueprint(bp)

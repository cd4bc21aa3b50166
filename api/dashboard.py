"""The dashboard page (static HTML + JS + CSS from ``api/static``; no build step)."""

from __future__ import annotations

from flask import Blueprint, Response, current_app

bp = Blueprint("dashboard", __name__)


@bp.get("/")
@bp.get("/dashboard")
def page() -> Response:
    resp = current_app.send_static_file("dashboard.html")
    resp.headers["Cache-Control"] = "no-cache"
    return resp

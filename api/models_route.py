"""``GET /v1/models`` and ``GET /v1/models/{id}``: the models live workers serve (from their
heartbeats), in OpenAI's list shape, plus vLLM's ``max_model_len``."""

from __future__ import annotations

from typing import Any

from flask import Blueprint

from api.errors import ApiError
from api.state import AppState, get_state
from pagedserve.telemetry import WorkerHeartbeat

bp = Blueprint("models", __name__)

OWNER = "pagedserve"


def model_object(name: str, hbs: list[WorkerHeartbeat]) -> dict[str, Any]:
    """One model: ``created`` is when its longest-running live worker started."""
    lens = [hb.max_model_len for hb in hbs if hb.max_model_len is not None]
    started = [hb.started_at for hb in hbs if hb.started_at]
    return {
        "id": name,
        "object": "model",
        "created": int(min(started)) if started else 0,
        "owned_by": OWNER,
        "root": name,
        "max_model_len": min(lens) if lens else None,
        "workers": len(hbs),
    }


def require_model(state: AppState, name: str) -> list[WorkerHeartbeat]:
    """The live workers serving ``name``; 404 at once when none does (the cached view first,
    then a fresh read of the heartbeats, so a worker that just started is found)."""
    hbs = state.served_models().get(name) or state.served_models(fresh=True).get(name)
    if hbs:
        return hbs
    served = sorted(state.served_models())
    raise ApiError(
        404,
        f"the model {name!r} does not exist or no live worker serves it; served: {served}",
        "model_not_found",
        "model",
    )


@bp.get("/v1/models")
def list_models() -> dict[str, Any]:
    models = get_state().served_models(fresh=True)
    return {"object": "list", "data": [model_object(m, hbs) for m, hbs in sorted(models.items())]}


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str) -> dict[str, Any]:
    """A model id may hold slashes (``org/name``), as the openai client sends it unescaped."""
    return model_object(model_id, require_model(get_state(), model_id))

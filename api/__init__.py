"""The HTTP API: jobs, OpenAI-compatible files and batches, pool occupancy, health, Prometheus
metrics and the dashboard page. Never imports torch (a status-only host needs no GPU stack)."""

from api.app import create_app
from api.config import ApiConfig

__all__ = ["ApiConfig", "create_app"]

"""The application layer: the ``pagedserve`` CLI, the one-machine supervisor (``up``), the demo
and the Celery control plane. It sits above ``worker/`` and ``api/`` and may import every package;
nothing imports it (see docs/architecture.md)."""

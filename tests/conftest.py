"""Shared fixtures live in tests/fixtures/; each module registers itself here."""

pytest_plugins = [
    "tests.fixtures.redis_server",
    "tests.fixtures.models",
    "tests.fixtures.workers",
]

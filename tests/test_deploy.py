"""Deployment files: compose.yaml valid against the Compose specification, and its promises."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHECK = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")


def validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHECK, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_follows_the_compose_specification() -> None:
    res = validate(ROOT / "compose.yaml")
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_validator_rejects_a_broken_compose_file(tmp_path: Path) -> None:
    broken = yaml.safe_load((ROOT / "compose.yaml").read_text())
    broken["services"]["worker"]["stop_grace_period"] = {"minutes": 2}  # must be a duration string
    broken["services"]["api"]["ports"] = "8000:8000"  # must be a list
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    res = validate(path)
    assert res.returncode != 0


def test_compose_promises() -> None:
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    assert set(services) >= {"redis", "worker", "api", "control-plane"}
    redis_cmd = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    assert "healthcheck" in services["redis"] and spec["volumes"]["redis-data"] is None
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert worker["stop_grace_period"] and any("/models" in v for v in worker["volumes"])
    assert services["api"]["command"][0] == "api"
    assert services["control-plane"]["command"] == ["control-plane"]


@pytest.mark.parametrize("target", ["service", "worker"])
def test_dockerfile_has_each_target(target: str) -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert f"AS {target}" in text

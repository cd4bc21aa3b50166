"""Configuration in one place (pagedserve/settings.py): each variable named once, flags built from
the config dataclasses, one precedence (flag, then variable, then default) everywhere."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from api.config import ApiConfig
from api.server import ServeConfig
from api.server import parse_args as api_args
from pagedserve import settings
from pagedserve.store import DEFAULT_LEASE_MS
from stack.supervisor import RestartPolicy, UpConfig, config_from
from stack.supervisor import parser as up_parser
from worker.outputs import EngineConfig
from worker.service_config import ServiceConfig, engine_config, parse_args, service_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedserve", "scheduler", "kernels", "worker", "api", "stack")
#: kernels/ may not import pagedserve (it is the layer below): it reads its own two switches,
#: and Triton's TRITON_INTERPRET; XDG_CACHE_HOME is the freedesktop variable.
OWN_READERS = {"kernels/native.py", "kernels/triton_kernels.py"}


def _sources() -> list[tuple[str, ast.AST]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            out.append((rel, ast.parse(path.read_text(), filename=rel)))
    return out


def _is_env_name(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value.startswith("PAGEDSERVE_") or node.value == "THP_MEM_ALLOC_ENABLE")
        and node.value.isupper()
    )


def test_each_variable_is_named_once_in_the_code() -> None:
    where: dict[str, list[str]] = {}
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if _is_env_name(node):
                where.setdefault(node.value, []).append(rel)  # type: ignore[attr-defined]
    declared = {s.name for s in settings.SETTINGS}
    assert set(where) <= declared, f"variables not declared in settings: {set(where) - declared}"
    for name, files in where.items():
        others = [f for f in files if f != "pagedserve/settings.py"]
        assert set(others) <= OWN_READERS and len(others) <= 1, (name, files)


def _reads_environment(node: ast.AST) -> bool:
    """``os.environ.get(...)``, ``os.getenv(...)`` or ``os.environ[...]`` read (not written)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        f = node.func
        if f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
            return True
        return f.attr == "get" and "os.environ" in ast.unparse(f.value)
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.ctx, ast.Load)
        and ast.unparse(node.value) == "os.environ"
    )


def test_only_settings_reads_the_environment() -> None:
    readers = {
        rel for rel, tree in _sources() if any(_reads_environment(n) for n in ast.walk(tree))
    }
    assert readers - OWN_READERS == {"pagedserve/settings.py"}


def test_kernel_switches_agree_with_the_kernels_own_names() -> None:
    from kernels import native

    assert settings.NATIVE_KERNELS.name == native.DISABLE_ENV
    assert settings.KERNEL_CACHE.name == native.CACHE_ENV
    assert settings.FUSED_OPS.name == native.FUSED_ENV
    assert settings.NATIVE_GEMM.name == native.GEMM_ENV
    assert settings.BF16_GEMM.name == native.BF16_GEMM_ENV
    assert settings.TILED_PREFILL.name == native.TILED_PREFILL_ENV


def test_readme_lists_every_variable() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Configuration reference", 1)[1].split("\n## ", 1)[0]
    missing = [s.name for s in settings.SETTINGS if f"`{s.name}`" not in section]
    assert not missing


def test_flags_without_values_give_the_dataclass_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for s in settings.SETTINGS:
        monkeypatch.delenv(s.name, raising=False)
    args = parse_args(["--model", "m"])
    assert engine_config(args) == EngineConfig()
    svc = service_config(args)
    fresh = ServiceConfig(worker_id=svc.worker_id)
    assert svc == fresh
    assert svc.lease_ms == DEFAULT_LEASE_MS and svc.redis_url == settings.REDIS_URL.default
    assert settings.build(ApiConfig, api_args([])) == ApiConfig()
    assert settings.build(ServeConfig, api_args([])) == ServeConfig()
    up = config_from(up_parser("up").parse_args([]))
    assert up == UpConfig() and up.restart == RestartPolicy()


def test_every_option_field_has_a_working_flag() -> None:
    """Each flag parses into its field (a value other than the default comes back)."""
    argv = [
        "--model=m", "--block-size=32", "--num-kv-blocks=7", "--kv-cache-memory=1.5MB",
        "--max-num-seqs=3", "--max-model-len=99", "--no-prefix-caching", "--seed=4",
        "--worker-id=w1", "--redis=redis://h:1/2", "--prefix=x", "--lease-ms=900",
        "--progress-interval-ms=10", "--kv-cache-dtype=bfloat16",
    ]  # fmt: skip
    args = parse_args(argv)
    e, s = engine_config(args), service_config(args)
    assert e.kv_cache_dtype == "bfloat16"
    assert (e.block_size, e.num_kv_blocks, e.kv_cache_memory) == (32, 7, int(1.5 * (1 << 20)))
    assert (e.max_num_seqs, e.max_model_len, e.enable_prefix_caching, e.seed) == (3, 99, False, 4)
    assert (s.worker_id, s.redis_url, s.prefix, s.lease_ms) == ("w1", "redis://h:1/2", "x", 900)
    assert s.progress_interval_s == pytest.approx(0.01)
    up = config_from(up_parser("up").parse_args(["--no-api", "--max-restarts=9", "--port=1"]))
    assert (up.api, up.restart.max_restarts, up.port) == (False, 9, 1)
    flagged = {o.dest for cls in (EngineConfig, ServiceConfig) for o in settings.options(cls)}
    assert {"block_size", "enable_prefix_caching", "lease_ms", "redis_url"} <= flagged


def test_switches_take_both_spellings() -> None:
    """``--engine-process`` and ``--no-engine-process`` both parse (a script that names what it
    wants keeps working when a default changes); the last one given wins."""

    def placed(*argv: str) -> bool:
        return service_config(parse_args(["--model=m", *argv])).engine_process

    assert placed() is ServiceConfig().engine_process is True
    assert placed("--no-engine-process") is False and placed("--engine-process") is True
    assert placed("--engine-process", "--no-engine-process") is False
    assert engine_config(parse_args(["--model=m", "--no-greedy-screen"])).greedy_screen is False
    assert engine_config(parse_args(["--model=m", "--greedy-screen"])).greedy_screen is True
    assert EngineConfig().kv_windows is True
    assert engine_config(parse_args(["--model=m", "--no-kv-windows"])).kv_windows is False


def test_help_prints_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` of each process (argparse formats help text with %: a literal "14%" in one
    flag's help once made the worker's --help crash)."""
    for parse in (lambda: parse_args(["--help"]), lambda: api_args(["--help"])):
        with pytest.raises(SystemExit) as done:
            parse()
        assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--kv-cache-dtype" in text and "--engine-process" in text and "14%" in text


def test_flag_beats_variable_beats_default() -> None:
    env = {"PAGEDSERVE_PREFIX": "from-env", "PAGEDSERVE_TENANT_MAX_QUEUED": "7"}
    assert settings.build(ApiConfig, env=env).prefix == "from-env"
    assert settings.build(ApiConfig, env=env).tenant_max_queued == 7
    assert settings.build(ApiConfig, api_args(["--prefix", "flag"]), env=env).prefix == "flag"
    assert settings.build(ApiConfig, env={}).prefix == settings.PREFIX.default
    keys = settings.build(ApiConfig, env={"PAGEDSERVE_API_KEYS": "a:k1, b:k2,"}).api_keys
    assert keys == ("a:k1", "b:k2")


def test_a_bad_variable_names_itself() -> None:
    with pytest.raises(ValueError, match="PAGEDSERVE_TENANT_MAX_QUEUED='many'"):
        settings.build(ApiConfig, env={"PAGEDSERVE_TENANT_MAX_QUEUED": "many"})


def test_blank_variables_count_as_unset() -> None:
    assert settings.build(ApiConfig, env={"PAGEDSERVE_API_KEYS_FILE": "  "}).api_keys_file is None
    assert not settings.PREPACK_WEIGHTS.enabled({"PAGEDSERVE_PREPACK_WEIGHTS": "off"})
    assert settings.PREPACK_WEIGHTS.enabled({})


def test_describe_lists_every_variable_once() -> None:
    rows = settings.describe({"PAGEDSERVE_PREFIX": "p"})
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names)) == len(settings.SETTINGS)
    assert next(r for r in rows if r["name"] == "PAGEDSERVE_PREFIX")["value"] == "p"


def test_option_fields_have_defaults_or_are_required_consistently() -> None:
    for cls in (EngineConfig, ServiceConfig, ApiConfig, ServeConfig, UpConfig, RestartPolicy):
        for o in settings.options(cls):
            assert o.help, (cls.__name__, o.dest)
            missing = o.field.default is dataclasses.MISSING
            assert not (missing and o.field.default_factory is dataclasses.MISSING), o.dest

"""Every Lua script declares every key it touches (issue #19): checked statically over every
script as it is loaded (``_common.lua`` prepended) and over the scripts in ``tenants.py``. See
``tests/lua_keys.py`` for what the check accepts and why it is static."""

from __future__ import annotations

from pathlib import Path

import pytest

import pagedserve
from pagedserve import tenants
from pagedserve.jobstore.base import _SCRIPTS, _load_lua
from tests.lua_keys import undeclared_keys

PKG = Path(pagedserve.__file__).parent
INLINE = {n: getattr(tenants, n) for n in ("TAG_JOB", "COUNT_OPEN", "ADMIT_JOB", "ADMIT_FILE")}


def test_every_lua_file_is_a_loaded_script() -> None:
    """So that the check below covers every file (a file the store never loads is no script)."""
    files = {p.stem for p in (PKG / "lua").glob("*.lua")} - {"_common"}
    assert files == set(_SCRIPTS)


def test_every_script_with_redis_calls_in_python_is_checked() -> None:
    """Inline scripts live in tenants.py only (of the service's code), each of them in INLINE."""
    root = PKG.parent
    dirs = ("pagedserve", "api", "worker", "scheduler")
    files = [p for d in dirs for p in (root / d).rglob("*.py")]
    holders = {p.relative_to(root).as_posix() for p in files if "redis.call" in p.read_text()}
    assert holders == {"pagedserve/tenants.py"}
    found = {
        name
        for name, value in vars(tenants).items()
        if isinstance(value, str) and "redis.call" in value and not name.startswith("_")
    }
    assert found == set(INLINE)


@pytest.mark.parametrize("name", _SCRIPTS)
def test_lua_script_declares_every_key(name: str) -> None:
    assert undeclared_keys(_load_lua(name)) == []


@pytest.mark.parametrize("name", sorted(INLINE))
def test_tenant_script_declares_every_key(name: str) -> None:
    assert undeclared_keys(INLINE[name]) == []


# The shapes issue #19 removed, and others the check must refuse: each is reported.
BAD = {
    "a key read from a record": """
local function finish(job)
  local ik = redis.call('HGET', job, 'idem_key')
  if ik then
    redis.pcall('EXPIRE', ik, 10)
  end
end
finish(KEYS[1])
""",
    "a key built from a prefix": """
local function drop(open, jobpfx, id)
  local job = jobpfx .. id
  redis.call('HGET', job, 'status')
end
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  drop(KEYS[1], ARGV[1], id)
end
""",
    "a key built inline": "return redis.call('EXISTS', ARGV[1] .. 'x')",
    "a declared key concatenated": "return redis.call('GET', KEYS[1] .. ':x')",
    "a parameter one call passes ARGV": """
local function get(k) return redis.call('GET', k) end
get(KEYS[1])
get(ARGV[1])
""",
    "a name rebound to ARGV": """
local k = KEYS[1]
k = ARGV[1]
return redis.call('GET', k)
""",
    "a loop variable": "for _, k in ipairs(KEYS) do redis.call('GET', k) end",
    "a second key of DEL": "redis.call('DEL', KEYS[1], ARGV[1])",
    "a stream of XREADGROUP": "redis.call('XREADGROUP', 'GROUP', 'g', 'c', 'STREAMS', ARGV[1])",
    "a command the check does not know": "redis.call('RENAME', KEYS[1], KEYS[2])",
    "a command given as a variable": "local c = ARGV[1]\nredis.call(c, KEYS[1])",
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_the_check_reports_an_undeclared_key(what: str) -> None:
    assert undeclared_keys(BAD[what]) != []


def test_the_check_accepts_keys_passed_down() -> None:
    ok = """
local function chunked(cmd, key, list)
  return redis.call(cmd, key, unpack(list))
end
local a, b = KEYS[1], KEYS[2]
local function f(x, y) redis.call('SET', x, y) end
f(a, ARGV[1])
chunked('HDEL', b, {'f'})
redis.call('XREADGROUP', 'GROUP', 'g', 'c', 'COUNT', 1, 'STREAMS', KEYS[3], '>')
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
return redis.call('TIME')
"""
    assert undeclared_keys(ok) == []

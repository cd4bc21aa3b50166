"""A small static check of Redis Lua scripts: every key a ``redis.call`` / ``redis.pcall`` touches
is declared, i.e. is ``KEYS[...]`` or a name bound only to such keys (issue #19).

Why static: Redis does not refuse an undeclared key of the script's own slot, so no run shows one;
and a static check covers every path of a script, not only those a test drives. The check is an
allow-list, so anything it cannot follow fails:

* a key argument is safe when it is exactly ``KEYS[<any index>]``, or one name whose every binding
  in its scope is safe: ``local a, b = KEYS[1], KEYS[2]`` or a later ``a = KEYS[3]``; a loop
  variable, a local without a value, or anything else (``pfx .. id``, ``ARGV[1]``, a reply of
  ``redis.call``) is not;
* a function parameter is safe when every call of the function passes a safe argument there;
* the key argument is the first one after the command (the commands the scripts use are single-
  key commands, listed below), every one for ``EXISTS``/``DEL``, the one after ``STREAMS`` for
  ``XREADGROUP``, none for ``TIME``; an unlisted command fails, and so does a command given as a
  name unless it is a parameter every call passes a listed single-key command.

The lexer and block matching cover the Lua the scripts are written in (no goto, no long strings
in key positions); what it does not understand it reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Commands whose one key is their first argument.
FIRST_KEY = frozenset(
    {
        *("EXPIRE", "GET", "HDEL", "HEXISTS", "HGET", "HGETALL", "HINCRBY", "HKEYS", "HLEN"),
        *("HMGET", "HSET", "HSETNX", "RPUSH", "SADD", "SCARD", "SET", "SISMEMBER", "SMEMBERS"),
        *("SRANDMEMBER", "SREM", "TYPE", "XACK", "XADD", "XCLAIM", "XPENDING", "XRANGE", "XTRIM"),
        *("ZADD", "ZRANGEBYSCORE", "ZREM"),
    }
)
#: Commands each of whose arguments is a key.
ALL_KEYS = frozenset({"DEL", "EXISTS"})
NO_KEYS = frozenset({"TIME"})

_TOKEN = re.compile(
    r"""(?P<comment>--\[\[.*?\]\]|--[^\n]*)
      |(?P<string>'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"|\[\[.*?\]\])
      |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
      |(?P<number>\d+(?:\.\d+)?)
      |(?P<op>\.\.\.|\.\.|==|~=|<=|>=|[-+*/%^#<>=(){}\[\];:,.])
      |(?P<space>\s+)""",
    re.VERBOSE | re.DOTALL,
)
_OPENERS = {"function", "if", "do", "repeat"}
_CLOSERS = {"end", "until"}


@dataclass(frozen=True)
class Tok:
    kind: str
    text: str
    line: int


@dataclass
class Scope:
    """A function (name, parameters, body tokens) or the main chunk (name '')."""

    name: str
    params: list[str]
    body: list[Tok]
    bindings: dict[str, list[list[Tok] | None]] = field(default_factory=dict)


def tokenize(src: str) -> list[Tok]:
    out: list[Tok] = []
    pos, line = 0, 1
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise ValueError(f"line {line}: cannot read {src[pos : pos + 20]!r}")
        kind = m.lastgroup or ""
        if kind not in ("comment", "space"):
            out.append(Tok(kind, m.group(), line))
        line += m.group().count("\n")
        pos = m.end()
    return out


def _close(toks: list[Tok], i: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at ``i``."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j].text == open_:
            depth += 1
        elif toks[j].text == close:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"line {toks[i].line}: unclosed {open_}")


def _block_end(toks: list[Tok], i: int) -> int:
    """Index of the ``end`` closing the ``function`` keyword at ``i``."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t.kind == "name" and t.text in _OPENERS:
            depth += 1
        elif t.kind == "name" and t.text in _CLOSERS:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"line {toks[i].line}: unclosed function")


def split_args(toks: list[Tok], open_i: int) -> tuple[list[list[Tok]], int]:
    """The top-level comma-separated arguments of the bracket at ``open_i``, and its close."""
    args: list[list[Tok]] = [[]]
    depth = 0
    for j in range(open_i + 1, len(toks)):
        t = toks[j]
        if t.text in "([{" and t.kind == "op":
            depth += 1
        elif t.text in ")]}" and t.kind == "op":
            if depth == 0:
                return ([] if args == [[]] else args), j
            depth -= 1
        elif t.text == "," and depth == 0:
            args.append([])
            continue
        args[-1].append(t)
    raise ValueError(f"line {toks[open_i].line}: unclosed (")


def scopes_of(toks: list[Tok]) -> list[Scope]:
    """The script's ``local function`` definitions and its main chunk."""
    scopes: list[Scope] = []
    main: list[Tok] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.text == "function" and t.kind == "name":
            if i + 2 >= len(toks) or toks[i + 1].kind != "name" or toks[i + 2].text != "(":
                raise ValueError(f"line {t.line}: only 'local function name(...)' is followed")
            args, close = split_args(toks, i + 2)
            end = _block_end(toks, i)
            params = [a[0].text for a in args]
            scopes.append(Scope(toks[i + 1].text, params, toks[close + 1 : end]))
            if main and main[-1].text == "local":
                main.pop()
            i = end + 1
            continue
        main.append(t)
        i += 1
    scopes.append(Scope("", [], main))
    for s in scopes:
        _collect_bindings(s)
    return scopes


def _statement_start(body: list[Tok], i: int) -> bool:
    """Whether the name at ``i`` starts a statement (an assignment's target)."""
    if i == 0:
        return True
    prev = body[i - 1]
    if prev.line < body[i].line:
        return prev.text not in ("..", "=", ",", "(", "{", "and", "or", "not", "[")
    return prev.kind == "name" and prev.text in ("then", "do", "else", "end", "local")


def _expr_list(body: list[Tok], i: int) -> list[list[Tok]]:
    """The expressions after an ``=`` at ``i - 1``, to the end of the statement (a depth-0 token
    on a later line that cannot continue an expression)."""
    exprs: list[list[Tok]] = [[]]
    depth = 0
    for j in range(i, len(body)):
        t = body[j]
        if depth == 0 and exprs[-1] and t.line > exprs[-1][-1].line:
            last = exprs[-1][-1].text
            if last not in ("..", ",", "=", "and", "or", "+", "-", "*", "/", "(", "{"):
                break
        if t.kind == "op" and t.text in "([{":
            depth += 1
        elif t.kind == "op" and t.text in ")]}":
            depth -= 1
        elif t.text == "," and depth == 0:
            exprs.append([])
            continue
        if depth == 0 and t.kind == "name" and t.text in ("then", "do", "end", "local"):
            break
        exprs[-1].append(t)
    return exprs


def _collect_bindings(s: Scope) -> None:
    """Every binding of every name in the scope (None: bound to nothing readable as a key)."""
    body, braces = s.body, 0
    for i, t in enumerate(body):
        if t.text == "{":
            braces += 1
        elif t.text == "}":
            braces -= 1
        if t.kind != "name" or braces > 0:
            continue
        if t.text == "for":
            j = i + 1
            while body[j].text not in ("in", "="):
                if body[j].kind == "name":
                    s.bindings.setdefault(body[j].text, []).append(None)
                j += 1
            continue
        if not _statement_start(body, i) or t.text in ("local", "return", "if", "else", "end"):
            continue
        names, j = [t.text], i + 1
        while j + 1 < len(body) and body[j].text == "," and body[j + 1].kind == "name":
            names.append(body[j + 1].text)
            j += 2
        is_local = i > 0 and body[i - 1].text == "local"
        if j < len(body) and body[j].text == "=":
            exprs = _expr_list(body, j + 1)
            for k, n in enumerate(names):
                s.bindings.setdefault(n, []).append(exprs[k] if k < len(exprs) else None)
        elif is_local:
            for n in names:
                s.bindings.setdefault(n, []).append(None)


def _text(expr: list[Tok]) -> str:
    return " ".join(t.text for t in expr)


class Checker:
    """Runs the check over one script's source; :attr:`violations` lists what is not declared."""

    def __init__(self, src: str) -> None:
        self.scopes = scopes_of(tokenize(src))
        self.funcs = {s.name: s for s in self.scopes if s.name}
        self.main = self.scopes[-1]
        self.calls = self._call_sites()
        self.safe_params = self._param_fixpoint()
        self.violations: list[str] = []
        used = {t.text for s in self.scopes for t in s.body if t.kind == "name"}
        for s in self.scopes:
            if not s.name or s.name in used:  # a helper this script never names never runs
                self._check_redis_calls(s)

    def _call_sites(self) -> dict[str, list[tuple[Scope, list[list[Tok]]]]]:
        out: dict[str, list[tuple[Scope, list[list[Tok]]]]] = {n: [] for n in self.funcs}
        for s in self.scopes:
            for i, t in enumerate(s.body[:-1]):
                if t.text in self.funcs and s.body[i + 1].text == "(":
                    if i > 0 and s.body[i - 1].text in (".", ":"):
                        continue
                    out[t.text].append((s, split_args(s.body, i + 1)[0]))
        return out

    def _param_fixpoint(self) -> set[tuple[str, str]]:
        """(function, parameter) pairs every call passes a safe key (greatest fixpoint)."""
        safe = {(f, p) for f, s in self.funcs.items() for p in s.params}
        changed = True
        while changed:
            changed = False
            for f, s in self.funcs.items():
                for k, p in enumerate(s.params):
                    if (f, p) not in safe:
                        continue
                    for caller, args in self.calls[f]:
                        if k >= len(args) or not self._safe(caller, args[k], safe):
                            safe.discard((f, p))
                            changed = True
                            break
        return safe

    def _safe(self, s: Scope, expr: list[Tok], safe: set[tuple[str, str]], seen=()) -> bool:
        if len(expr) >= 4 and expr[0].text == "KEYS" and expr[1].text == "[":
            return _close(expr, 1, "[", "]") == len(expr) - 1
        if len(expr) != 1 or expr[0].kind != "name":
            return False
        name = expr[0].text
        if name in seen:
            return False
        for scope in (s, self.main):
            if name in scope.params:
                return (scope.name, name) in safe and name not in scope.bindings
            if name in scope.bindings:
                return all(
                    b is not None and self._safe(scope, b, safe, (*seen, name))
                    for b in scope.bindings[name]
                )
        return False

    def _command_of(self, s: Scope, expr: list[Tok]) -> set[str] | None:
        """The command(s) an argument names: a literal, or a parameter's literals at every call."""
        if len(expr) == 1 and expr[0].kind == "string":
            return {expr[0].text[1:-1].upper()}
        if len(expr) == 1 and expr[0].text in s.params and s.name:
            k = s.params.index(expr[0].text)
            got: set[str] = set()
            for caller, args in self.calls[s.name]:
                one = self._command_of(caller, args[k]) if k < len(args) else None
                if one is None:
                    return None
                got |= one
            return got
        return None

    def _check_redis_calls(self, s: Scope) -> None:
        body = s.body
        for i in range(len(body) - 3):
            if not (body[i].text == "redis" and body[i + 1].text == "."):
                continue
            if body[i + 2].text not in ("call", "pcall") or body[i + 3].text != "(":
                continue
            args, _ = split_args(body, i + 3)
            where = f"{s.name or 'main'}:{body[i].line}"
            cmds = self._command_of(s, args[0]) if args else None
            if not cmds:
                self.violations.append(f"{where}: command {_text(args[0])!r} not followed")
                continue
            for cmd in sorted(cmds):
                for key in self._keys_of(cmd, args[1:], where):
                    if not self._safe(s, key, self.safe_params):
                        self.violations.append(f"{where}: {cmd} key {_text(key)!r} not declared")

    def _keys_of(self, cmd: str, rest: list[list[Tok]], where: str) -> list[list[Tok]]:
        if cmd in NO_KEYS:
            return []
        if cmd in ALL_KEYS:
            return rest
        if cmd == "XREADGROUP":
            at = [k for k, a in enumerate(rest) if _text(a).upper() == "'STREAMS'"]
            return rest[at[0] + 1 : at[0] + 2] if at else [[]]
        if cmd in FIRST_KEY and rest:
            return rest[:1]
        self.violations.append(f"{where}: command {cmd} not known to the check")
        return []


def undeclared_keys(src: str) -> list[str]:
    """What ``src`` touches without declaring it (empty when every key is declared)."""
    return Checker(src).violations

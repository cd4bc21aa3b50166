"""Configuration in one place: every environment variable the project reads (its name, default
and meaning, once), and command-line flags built from the configuration dataclasses.

Each layer keeps its options in one dataclass (``EngineConfig``, ``ServiceConfig``, ``ApiConfig``,
``UpConfig``, ...). A field that a flag or a variable may set says so in its metadata
(:func:`opt`); :func:`add_options` turns the fields into argparse flags and :func:`build` reads
them back, so a default is written once, in the dataclass, and precedence is the same everywhere:
**flag, then environment variable, then the dataclass default**.

Standard library only: clients, workers, the API and the application layer all import it. The
two switches of the C kernels are read by ``kernels/native.py``, below this package (see
:data:`NATIVE_KERNELS`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

T = typing.TypeVar("T")

_FALSE = ("0", "false", "no", "off")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default as text ("" = unset) and what it does."""

    name: str
    default: str
    help: str

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The variable's value when set and not blank, else None."""
        value = (os.environ if env is None else env).get(self.name)
        return value if value is not None and value.strip() else None

    def text(self, env: Mapping[str, str] | None = None) -> str:
        return self.raw(env) or self.default

    def integer(self, env: Mapping[str, str] | None = None) -> int:
        return int(self.text(env) or 0)

    def number(self, env: Mapping[str, str] | None = None) -> float:
        return float(self.text(env) or 0)

    def enabled(self, env: Mapping[str, str] | None = None) -> bool:
        """A switch: off only for 0/false/no/off (any case)."""
        return self.text(env).strip().lower() not in _FALSE


REDIS_URL = Setting(
    "PAGEDSERVE_REDIS_URL",
    "redis://localhost:6379/0",
    "Redis URL of every process (client, worker, API, control plane); unix://, "
    "redis+sentinel:// and redis+cluster:// work",
)
PREFIX = Setting("PAGEDSERVE_PREFIX", "ps", "prefix of every Redis key; one per deployment")
SHARDS = Setting(
    "PAGEDSERVE_SHARDS",
    "1",
    "Redis Cluster only: job shards (hash tags), each with its own priority streams; the same "
    "in every process",
)
BROKER_URL = Setting(
    "PAGEDSERVE_BROKER_URL",
    "",
    "Celery broker and result backend of the API, CLI and control plane (default: the Redis "
    "URL); needed when that is a Redis Cluster, which kombu cannot use",
)
API_KEYS = Setting(
    "PAGEDSERVE_API_KEYS",
    "",
    "API keys, comma-separated: tenant:key, tenant:sha256:<hex> (optionally :admin) or key",
)
API_KEYS_FILE = Setting(
    "PAGEDSERVE_API_KEYS_FILE", "", "a file of API key entries, one per line (# comments)"
)
TENANT_MAX_QUEUED = Setting(
    "PAGEDSERVE_TENANT_MAX_QUEUED", "0", "most open jobs per tenant (0: no limit)"
)
TENANT_MAX_FILE_BYTES = Setting(
    "PAGEDSERVE_TENANT_MAX_FILE_BYTES", "0", "most bytes of stored files per tenant (0: no limit)"
)
MODELS = Setting(
    "PAGEDSERVE_MODELS",
    "",
    "comma-separated model names a batch may name when no worker heartbeat says otherwise",
)
MODEL_CACHE = Setting(
    "PAGEDSERVE_MODEL_CACHE",
    "",
    "directory of checkpoints converted from GGUF (default: ~/.cache/pagedserve/models)",
)
MALLOC_TUNING = Setting(
    "PAGEDSERVE_MALLOC_TUNING", "1", "0: leave glibc's malloc thresholds alone (CPU worker)"
)
PREPACK_WEIGHTS = Setting(
    "PAGEDSERVE_PREPACK_WEIGHTS", "1", "0: keep projection weights unpacked (CPU worker)"
)
HUGE_PAGES = Setting(
    "THP_MEM_ALLOC_ENABLE",
    "1",
    "torch's switch for transparent huge pages on large CPU allocations; the worker sets 1",
)
FINALIZE_EVERY_S = Setting(
    "PAGEDSERVE_FINALIZE_EVERY_S", "2", "control plane: seconds between batch finalize rounds"
)
EXPIRE_EVERY_S = Setting(
    "PAGEDSERVE_EXPIRE_EVERY_S", "30", "control plane: seconds between batch expiry rounds"
)

#: Read by ``kernels/native.py`` itself: ``kernels/`` sits below this package and may not import
#: it. Listed here so that ``pagedserve env`` shows every variable; ``tests/test_settings.py``
#: checks that the names and defaults agree with the kernels' own.
NATIVE_KERNELS = Setting(
    "PAGEDSERVE_NATIVE_KERNELS", "1", "0: no C decode kernel; attention stays in plain torch"
)
FUSED_OPS = Setting(
    "PAGEDSERVE_FUSED_OPS", "1", "0: no fused C layer ops (SwiGLU, add+RMSNorm, rope+KV write)"
)
NATIVE_GEMM = Setting(
    "PAGEDSERVE_NATIVE_GEMM",
    "auto",
    "projection GEMM in C: auto or 1 (wherever it builds) or 0 (oneDNN)",
)
BF16_GEMM = Setting(
    "PAGEDSERVE_BF16_GEMM",
    "auto",
    "--weight-dtype bfloat16 products: auto (the C GEMM: AMX tiles or AVX512-BF16; else "
    "oneDNN), native or onednn",
)
GREEDY_SCREEN = Setting(
    "PAGEDSERVE_GREEDY_SCREEN",
    "auto",
    "greedy rows' output-head screen (exact tokens either way): auto (bfloat16 where the CPU "
    "multiplies it, else int16), bfloat16 or int16",
)
TILED_PREFILL = Setting(
    "PAGEDSERVE_TILED_PREFILL",
    "1",
    "0: prompt tokens as decode rows of the C decode kernel, not the tiled prefill kernel",
)
KERNEL_FLAGS = Setting(
    "PAGEDSERVE_KERNEL_FLAGS",
    "",
    "compiler flags appended to every C kernel build (-mno-avx512f: an AVX2 CPU's code)",
)
KERNEL_CACHE = Setting(
    "PAGEDSERVE_KERNEL_CACHE",
    "",
    "directory of the compiled C kernel (default: ~/.cache/pagedserve/kernels)",
)

#: Every variable the project reads, in the order ``pagedserve env`` lists them.
SETTINGS: tuple[Setting, ...] = (
    REDIS_URL,
    PREFIX,
    SHARDS,
    BROKER_URL,
    API_KEYS,
    API_KEYS_FILE,
    TENANT_MAX_QUEUED,
    TENANT_MAX_FILE_BYTES,
    MODELS,
    MODEL_CACHE,
    MALLOC_TUNING,
    PREPACK_WEIGHTS,
    HUGE_PAGES,
    FINALIZE_EVERY_S,
    EXPIRE_EVERY_S,
    NATIVE_KERNELS,
    FUSED_OPS,
    NATIVE_GEMM,
    BF16_GEMM,
    GREEDY_SCREEN,
    TILED_PREFILL,
    KERNEL_FLAGS,
    KERNEL_CACHE,
)


# --------------------------------------------------------------------------- dataclass options
def parse_size(text: str) -> int:
    """Bytes from ``512MB``, ``1.5g``, ``64KiB`` or a plain number."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def opt(
    help: str,
    *,
    env: Setting | None = None,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Field metadata: ``field(default=16, metadata=opt("tokens per KV block"))``.

    ``flag`` overrides the flag name (default ``--field-name``; a boolean that defaults to True
    gets ``--no-field-name``); ``parse`` turns flag and variable text into the value (default: the
    field's type); ``env`` is the variable that sets the field when no flag does."""
    return {"option": {"help": help, "env": env, "flag": flag, "parse": parse, "choices": choices}}


#: The schemes ``--redis`` takes, in every process's help.
REDIS_URL_HELP = "Redis URL: redis://, rediss://, unix://, redis+sentinel://, redis+cluster://"


def redis_url_field() -> Any:
    """The ``--redis`` field (``PAGEDSERVE_REDIS_URL``) of every process's options."""
    return dataclasses.field(
        default=REDIS_URL.default, metadata=opt(REDIS_URL_HELP, env=REDIS_URL, flag="--redis")
    )


def prefix_field() -> Any:
    """The key prefix field (``PAGEDSERVE_PREFIX``) of every process's options."""
    return dataclasses.field(default=PREFIX.default, metadata=opt("Redis key prefix", env=PREFIX))


@dataclass(frozen=True)
class _Option:
    field: dataclasses.Field[Any]
    kind: Any
    help: str
    env: Setting | None
    flag: str | None
    parse: Callable[[str], Any] | None
    choices: tuple[str, ...] | None

    @property
    def dest(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not dataclasses.MISSING:
            return f.default
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return None

    @property
    def switch(self) -> bool:
        return self.kind is bool

    def flag_name(self) -> str:
        if self.flag:
            return self.flag
        stem = self.dest.replace("_", "-")
        return f"--no-{stem}" if self.switch and self.default is True else f"--{stem}"

    def from_text(self, text: str) -> Any:
        if self.parse is not None:
            return self.parse(text)
        if self.switch:
            low = text.strip().lower()
            if low not in _TRUE + _FALSE:
                raise ValueError(f"{text!r} is not a switch (use 1/0, true/false, yes/no, on/off)")
            return low in _TRUE
        return self.kind(text)


def _base_type(hint: Any) -> Any:
    """``int | None`` -> ``int``; other hints unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return hint


def options(cls: type) -> Iterator[_Option]:
    """The fields of dataclass ``cls`` that carry :func:`opt` metadata."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("option")
        if meta is not None:
            yield _Option(field=f, kind=_base_type(hints[f.name]), **meta)


def _shown_default(o: _Option) -> str:
    if "(default:" in o.help:
        return ""
    value = "none" if o.default in (None, (), "") else str(o.default)
    return f" (default: ${o.env.name}, else {value})" if o.env else f" (default: {value})"


class _Switch(argparse.Action):
    """A switch flag under both spellings: ``--no-x`` sets False, ``--x`` True."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
) -> None:
    """Add a flag per option field of ``cls`` (its default shown in the help, never stored: an
    absent flag leaves the variable and then the dataclass default to decide)."""
    for o in options(cls):
        if o.dest in skip:
            continue
        kwargs: dict[str, Any] = {"dest": o.dest, "default": argparse.SUPPRESS}
        names = [o.flag_name()]
        if o.switch:
            # both spellings (--x / --no-x): a script that says what it wants keeps working
            # when a default changes; the documented one (the default's opposite) first
            first = names[0]
            names.append(f"--{first[5:]}" if first.startswith("--no-") else f"--no-{first[2:]}")
            kwargs.update(action=_Switch)
            shown = f" (${o.env.name})" if o.env else ""
        else:
            shown = _shown_default(o)
            kwargs.update(type=o.from_text, metavar=o.dest.upper(), choices=o.choices)
        # argparse formats help with %: a literal one ("2-14% faster") broke --help
        parser.add_argument(*names, help=(o.help + shown).replace("%", "%%"), **kwargs)


def values(
    cls: type, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """What flags (``args``) and environment variables set among ``cls``'s option fields."""
    given = vars(args) if args is not None else {}
    out: dict[str, Any] = {}
    for o in options(cls):
        if o.dest in given:
            out[o.dest] = given[o.dest]
        elif o.env is not None and (text := o.env.raw(env)) is not None:
            try:
                out[o.dest] = o.from_text(text)
            except ValueError as e:
                raise ValueError(f"${o.env.name}={text!r}: {e}") from None
    return out


def build(
    cls: type[T],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    **fixed: Any,
) -> T:
    """An instance of dataclass ``cls``: ``fixed`` values, then flags, then variables, then
    defaults."""
    return cls(**{**values(cls, args, env), **fixed})


def describe(env: Mapping[str, str] | None = None) -> list[dict[str, str | None]]:
    """Every variable with its default, its current value (None: unset) and its meaning."""
    return [
        {"name": s.name, "default": s.default, "value": s.raw(env), "help": s.help}
        for s in SETTINGS
    ]

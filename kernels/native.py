"""The CPU decode-attention kernel in C (``kernels/csrc/paged_decode.c``): build, load, call.

Plain torch can only attend over a paged cache after gathering each sequence's blocks into a
buffer (read, write, read again); the C kernel reads every cached key and value once. It is
compiled at first use with the machine's C compiler (``$CC``, else ``cc``/``gcc``) for this CPU
(``-march=native``) and cached under ``$PAGEDSERVE_KERNEL_CACHE`` (default
``~/.cache/pagedserve/kernels``), keyed by the source, the compiler and the flags.

It links OpenMP by the soname ``libgomp.so.1``: loaded after torch, the dynamic loader hands it
the copy torch already uses, so the kernel's threads are torch's threads (no second pool
spinning against the first).

The cache may be float32 or bfloat16 (``--kv-cache-dtype bfloat16``): one library per cache
dtype, from the same source (``-DPS_KV_BF16=1``, ``kernels/csrc/ps_kv.h``; keys and values are
widened to float32 as they are loaded), each built when a cache of its dtype first needs it.

Nothing here is required: without a compiler, with ``PAGEDSERVE_NATIVE_KERNELS=0``, or for a
dtype/shape the kernel does not cover, :class:`kernels.torch_backend.TorchBackend` keeps its
pure-torch path, which stays the reference the kernel is tested against.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
DISABLE_ENV = "PAGEDSERVE_NATIVE_KERNELS"
#: Only the fused layer ops of ``kernels/fused.py`` (also off with ``DISABLE_ENV``).
FUSED_ENV = "PAGEDSERVE_FUSED_OPS"
#: The projection GEMM of ``kernels/gemm.py``: auto / 1 / 0 (also off with ``DISABLE_ENV``).
GEMM_ENV = "PAGEDSERVE_NATIVE_GEMM"
#: ``--weight-dtype bfloat16``'s products: auto / native (the C GEMM's bfloat16 path: AMX
#: tiles where the CPU has them, else AVX512-BF16) / onednn (read by
#: :func:`worker.models.layers.bf16_native` through :func:`choice`).
BF16_GEMM_ENV = "PAGEDSERVE_BF16_GEMM"
#: The greedy rows' head screen: auto (bfloat16 where the CPU multiplies it, else int16) /
#: bfloat16 / int16 (read by :func:`kernels.greedy_head.screen_kind` through :func:`choice`).
GREEDY_SCREEN_ENV = "PAGEDSERVE_GREEDY_SCREEN"
CACHE_ENV = "PAGEDSERVE_KERNEL_CACHE"
#: Compiler flags appended to every C kernel build's own (its cache key includes them):
#: ``-mno-avx512f -mno-avxvnni`` builds the code an AVX2-only CPU runs, on any x86 host (how
#: the benches measure a Zen 3's code path on a newer CPU).
FLAGS_ENV = "PAGEDSERVE_KERNEL_FLAGS"
#: The cache dtypes the kernels read, the flags that build each library and its functions'
#: suffix (kernels/csrc/ps_kv.h).
KV_BUILDS: dict[torch.dtype, tuple[list[str], str]] = {
    torch.float32: ([], "f32"),
    torch.bfloat16: (["-DPS_KV_BF16=1"], "bf16"),
}
#: Prefill chunks through the tiled prefill kernel (``paged_prefill.h``); 0 runs their tokens as
#: decode rows of the decode kernel, as before it (for A/Bs).
TILED_PREFILL_ENV = "PAGEDSERVE_TILED_PREFILL"


#: The fields both C argument structs begin with, in their order (ps_decode_args and
#: ps_prefill_args in kernels/csrc).
_INPUT_FIELDS = [
    ("query", ctypes.c_void_p),
    ("query_row_stride", ctypes.c_int64),
    ("k_cache", ctypes.c_void_p),
    ("v_cache", ctypes.c_void_p),
    ("block_tables", ctypes.c_void_p),
    ("block_table_stride", ctypes.c_int64),
]


class _DecodeArgs(ctypes.Structure):
    _fields_ = [
        *_INPUT_FIELDS,
        ("token_rows", ctypes.c_void_p),
        ("seq_index", ctypes.c_void_p),
        ("first_block", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("num_rows", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("out", ctypes.c_void_p),
        ("out_row_stride", ctypes.c_int64),
        ("lse", ctypes.c_void_p),
        ("start_out", ctypes.c_void_p),
        ("start_lse", ctypes.c_void_p),
        ("start_slot", ctypes.c_void_p),
        ("start_rows", ctypes.c_int64),
    ]


class _PrefillArgs(ctypes.Structure):
    _fields_ = [
        *_INPUT_FIELDS,
        ("starts", ctypes.c_void_p),
        ("query_lens", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("seq_index", ctypes.c_void_p),
        ("num_chunks", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("num_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("out", ctypes.c_void_p),
        ("out_row_stride", ctypes.c_int64),
        ("all_keys", ctypes.c_int32),
        ("lse", ctypes.c_void_p),
        ("query_rows", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class PrefillChunks:
    """Prefill chunks of one step for :meth:`NativeDecode.prefill`, as int64 CPU tensors of
    equal length ``n`` (built once per step, reused by every layer)."""

    starts: torch.Tensor  # first row of the chunk in query / out
    query_lens: torch.Tensor  # its tokens
    seq_lens: torch.Tensor  # context length after the chunk
    seq_index: torch.Tensor  # row of the block table

    @property
    def num_chunks(self) -> int:
        return int(self.starts.shape[0])


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of one step, as int64 CPU tensors of equal length ``n`` (built once per
    step, reused by every layer)."""

    token_rows: torch.Tensor  # row of query/out
    seq_index: torch.Tensor  # row of the block table
    first_block: torch.Tensor  # first block read
    seq_lens: torch.Tensor  # context length including the new token

    @property
    def num_rows(self) -> int:
        return int(self.token_rows.shape[0])

    @classmethod
    def whole(cls, seq_lens: torch.Tensor) -> DecodeRows:
        """Row i: query row i, table row i, read from its first block (benchmarks' batches)."""
        every = torch.arange(seq_lens.shape[0])
        return cls(every, every, torch.zeros_like(every), seq_lens)

    def then(self, other: DecodeRows) -> DecodeRows:
        """These rows followed by ``other``'s."""
        return DecodeRows(
            *(torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in fields(self))
        )


@dataclass(frozen=True)
class PrefixStart:
    """Shared-prefix results that decode rows continue (:meth:`NativeDecode.decode`): the
    output and log-sum-exp of every grouped query over its prefix, and per decode row its
    row of them (-1: the row starts empty)."""

    out: torch.Tensor  # float32 [S, num_heads, head_dim], contiguous
    lse: torch.Tensor  # float32 [S, num_heads], contiguous
    slots: torch.Tensor  # int64 [n]: per decode row

    def check(self, num_rows: int, out_shape: torch.Size) -> None:
        """The C kernel reads these by pointer: dtypes, layouts and lengths must hold."""
        ok = (
            self.out.dtype == torch.float32
            and self.lse.dtype == torch.float32
            and self.slots.dtype == torch.int64
            and self.out.is_contiguous()
            and self.lse.is_contiguous()
            and self.slots.is_contiguous()
            and self.out.shape[1:] == out_shape[1:]
            and self.lse.shape == self.out.shape[:2]
            and self.slots.shape == (num_rows,)
        )
        if not ok:  # (the kernel checks each slot against S itself)
            raise ValueError("prefix start: float32 [S, H, D] out, [S, H] lse, int64 slots")


class NativeDecode:
    """The loaded kernel library for caches of ``kv_dtype`` (built with its
    :data:`KV_BUILDS` flags)."""

    def __init__(self, path: Path, kv_dtype: torch.dtype = torch.float32) -> None:
        self.path = path
        self.kv_dtype = kv_dtype
        suffix = KV_BUILDS[kv_dtype][1]
        self._lib = ctypes.CDLL(str(path))
        self._decode = getattr(self._lib, f"ps_decode_attention_{suffix}")
        self._read_blocks = getattr(self._lib, f"ps_read_blocks_{suffix}")
        self._prefill = getattr(self._lib, f"ps_prefill_attention_{suffix}")
        self._decode.argtypes = [ctypes.POINTER(_DecodeArgs)]
        self._decode.restype = ctypes.c_int
        self._read_blocks.argtypes = [ctypes.POINTER(_DecodeArgs)]
        self._read_blocks.restype = ctypes.c_double
        self._prefill.argtypes = [ctypes.POINTER(_PrefillArgs)]
        self._prefill.restype = ctypes.c_int
        self._lib.ps_prefill_lanes.restype = ctypes.c_int
        #: :meth:`prefill` takes head sizes that are multiples of this (its vector width)
        self.prefill_lanes = int(self._lib.ps_prefill_lanes())
        limits = [ctypes.c_int64() for _ in range(4)]
        self._lib.ps_decode_limits(*(ctypes.byref(x) for x in limits))
        self.max_head_dim, self.max_heads, self.max_block_size, self.lanes = (
            x.value for x in limits
        )

    def supports(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """float32 queries on the CPU, a contiguous cache of this build's dtype, shapes within
        the kernel's stack buffers."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        num_heads = query.shape[1]
        return (
            query.device.type == "cpu"
            and query.dtype == torch.float32
            and k_cache.dtype == self.kv_dtype
            and k_cache.is_contiguous()
            and query.stride(2) == 1
            and query.stride(1) == head_dim
            and num_heads % num_kv_heads == 0
            and head_dim <= self.max_head_dim
            and num_heads <= self.max_heads
            and block_size <= self.max_block_size
            and head_dim % self.lanes == 0
            and block_size % self.lanes == 0
        )

    def decode(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        rows: DecodeRows,
        scale: float,
        window: int | None,
        out: torch.Tensor,
        lse: torch.Tensor,
        start: PrefixStart | None = None,
    ) -> None:
        """Attention of every decode row; writes ``out[token_rows]`` and ``lse[:n]``.

        With ``start``, a row whose slot is not -1 continues that shared-prefix result: its
        output is over the prefix and its own blocks (from ``first_block``) together, exactly,
        with no merge after. The caller guarantees :meth:`supports`, an int32 contiguous
        ``block_tables`` and ``v_cache`` shaped like ``k_cache``; the tensors must stay alive
        during the call.
        """
        self._check(k_cache, v_cache, block_tables, out)
        args = self._args(query, (k_cache, v_cache), block_tables, rows, scale, window, (out, lse))
        if start is not None:
            start.check(rows.num_rows, out.shape)
            args.start_out = start.out.data_ptr()
            args.start_lse = start.lse.data_ptr()
            args.start_slot = start.slots.data_ptr()
            args.start_rows = start.out.shape[0]
        if self._decode(ctypes.byref(args)) != 0:
            raise ValueError("shapes outside the native decode kernel's limits")

    def supports_prefill(self, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """:meth:`supports`, and a head size :meth:`prefill` takes."""
        return self.supports(query, k_cache) and k_cache.shape[3] % self.prefill_lanes == 0

    def prefill(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        chunks: PrefillChunks,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
        query_rows: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of every prefill chunk's tokens over its context in the cache (its
        own keys written there first; no window, no shared prefix): writes their ``out`` rows.
        Same preconditions as :meth:`decode`.

        With ``lse`` (float32, contiguous ``[T, num_heads]``), a cascade's shared prefixes
        instead: every query row of chunk ``c`` sees all ``seq_lens[c]`` keys through table row
        ``seq_index[c]`` (no causal mask), and ``lse`` gets each row's log-sum-exp. With
        ``query_rows`` (int64, one per output row), output row ``i`` is the attention of query
        row ``query_rows[i]``."""
        self._check(k_cache, v_cache, block_tables, out)
        rows = out.shape[0]
        if lse is not None and (
            lse.dtype != torch.float32 or not lse.is_contiguous() or lse.shape != out.shape[:2]
        ):
            raise ValueError("lse must be a contiguous float32 [rows, num_heads] tensor")
        if query_rows is not None and (
            query_rows.dtype != torch.int64
            or not query_rows.is_contiguous()
            or query_rows.shape != (rows,)
        ):
            raise ValueError("query_rows must be a contiguous int64 tensor, one per output row")
        args = _PrefillArgs(
            **self._common(query, k_cache, v_cache, block_tables, out),
            starts=chunks.starts.data_ptr(),
            query_lens=chunks.query_lens.data_ptr(),
            seq_lens=chunks.seq_lens.data_ptr(),
            seq_index=chunks.seq_index.data_ptr(),
            num_chunks=chunks.num_chunks,
            scale=scale,
            all_keys=int(lse is not None),
            lse=0 if lse is None else lse.data_ptr(),
            query_rows=0 if query_rows is None else query_rows.data_ptr(),
        )
        code = self._prefill(ctypes.byref(args))
        if code == -2:
            raise MemoryError("the prefill kernel could not allocate its key buffer")
        if code != 0:
            raise ValueError("shapes outside the native prefill kernel's limits")

    def read_blocks(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        rows: DecodeRows,
        window: int | None = None,
    ) -> float:
        """A benchmark's baseline: sums every key and value :meth:`decode` would read for
        ``rows``, in its order and threads, with no attention (the layout's bandwidth ceiling).
        Same preconditions as :meth:`decode`."""
        _, _, num_kv_heads, head_dim = k_cache.shape
        q = torch.empty(1, num_kv_heads, head_dim)  # read by no one: rows carry no heads here
        args = self._args(q, (k_cache, v_cache), block_tables, rows, 1.0, window, (q, q))
        return float(self._read_blocks(ctypes.byref(args)))

    @staticmethod
    def _args(
        query: torch.Tensor,
        caches: tuple[torch.Tensor, torch.Tensor],
        block_tables: torch.Tensor,
        rows: DecodeRows,
        scale: float,
        window: int | None,
        outputs: tuple[torch.Tensor, torch.Tensor],
    ) -> _DecodeArgs:
        """The C call's argument struct (``caches``: keys, values; ``outputs``: out, lse)."""
        (k_cache, v_cache), (out, lse) = caches, outputs
        return _DecodeArgs(
            **NativeDecode._common(query, k_cache, v_cache, block_tables, out),
            token_rows=rows.token_rows.data_ptr(),
            seq_index=rows.seq_index.data_ptr(),
            first_block=rows.first_block.data_ptr(),
            seq_lens=rows.seq_lens.data_ptr(),
            num_rows=rows.num_rows,
            window=window or 0,
            scale=scale,
            lse=lse.data_ptr(),
        )

    @staticmethod
    def _check(
        k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor
    ) -> None:
        """What :meth:`decode` and :meth:`prefill` need beyond :meth:`supports`."""
        if (
            v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype
            or not v_cache.is_contiguous()
        ):
            raise ValueError("v_cache must be a contiguous tensor shaped like k_cache")
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            raise ValueError("block_tables must be a contiguous int32 tensor")
        if out.dtype != torch.float32 or out.stride(2) != 1 or out.stride(1) != k_cache.shape[3]:
            raise ValueError("out must be float32 with contiguous heads")

    @staticmethod
    def _common(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        out: torch.Tensor,
    ) -> dict[str, int]:
        """The fields both C argument structs share (pointers, strides, shapes, threads)."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        return {
            "query": query.data_ptr(),
            "query_row_stride": query.stride(0),
            "k_cache": k_cache.data_ptr(),
            "v_cache": v_cache.data_ptr(),
            "block_tables": block_tables.data_ptr(),
            "block_table_stride": block_tables.stride(0),
            "num_heads": query.shape[1],
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "block_size": block_size,
            "num_threads": torch.get_num_threads(),
            "out": out.data_ptr(),
            "out_row_stride": out.stride(0),
        }


def _private(path: Path) -> bool:
    """Ours and writable by nobody else: we load code from here, so nobody else may plant it."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cache_dir() -> Path:
    """First usable of: $PAGEDSERVE_KERNEL_CACHE, ~/.cache/pagedserve/kernels, the temp dir.

    Usable: creatable, writable, owned by this user and not group/world-writable (a shared
    temp dir must not let another user put a library where we would load it)."""
    candidates = []
    if os.environ.get(CACHE_ENV):
        candidates.append(Path(os.environ[CACHE_ENV]))
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    candidates.append(Path(xdg) / "pagedserve" / "kernels")
    candidates.append(Path(tempfile.gettempdir()) / f"pagedserve-kernels-{os.getuid()}")
    for path in candidates:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if os.access(path, os.W_OK) and _private(path):
                return path
        except OSError:
            continue
        log.warning("not using %s for compiled kernels: not private to this user", path)
    raise OSError("no private writable directory for compiled kernels")


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build_key(compiler: str, flags: list[str], source: Path = SOURCE) -> str:
    """Source and the headers beside it, compiler version and flags; ``-march=native`` also
    depends on this CPU."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    cpu = ""
    with contextlib.suppress(OSError):
        flags_lines = [
            line for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("flags", "Features"))
        ]  # fmt: skip
        cpu = flags_lines[0] if flags_lines else ""
    digest = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what it includes
    for part in (source.read_bytes(), *headers, version.encode(), " ".join(flags).encode(),
                 cpu.encode()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def extra_flags() -> list[str]:
    """``PAGEDSERVE_KERNEL_FLAGS``, split as a shell would."""
    return shlex.split(os.environ.get(FLAGS_ENV, ""))


def build(force: bool = False, source: Path = SOURCE, flags: list[str] | None = None) -> Path:
    """Compile the kernel (or find it in the cache); returns the shared library's path.

    ``source``/``flags``: another C file of ``kernels/csrc`` (``kernels/fused.py`` builds its
    own through this), cached under its own stem and key; ``PAGEDSERVE_KERNEL_FLAGS`` is
    appended to the flags.

    Written to a temporary name and renamed into place, so concurrent builders (pytest-xdist
    workers, two engines) never load a half-written file; and compiled by one of them at a time
    (:func:`_build_lock`), the others then loading its file.
    """
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    flags = [*(FLAGS if flags is None else flags), *extra_flags()]
    target = _cache_dir() / f"{source.stem}-{_build_key(compiler, flags, source)}.so"
    if target.exists() and not force:
        return target
    with _build_lock(target):
        if target.exists() and not force:  # built by another thread or process meanwhile
            return target
        _compile(compiler, flags, source, target)
    return target


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Held while ``target`` is compiled: a second builder of the same library (another thread,
    a pytest-xdist worker, a second worker process on the host) waits for the first and then
    finds its file, instead of compiling it again beside it (the decode library alone takes
    ~25 s of a core). An advisory ``flock`` on a file beside the target, released on close."""
    with open(target.with_name(target.name + ".lock"), "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _compile(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, str(source), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def choice(name: str, allowed: tuple[str, ...]) -> str:
    """The variable ``name``'s value among ``allowed`` (the first when unset or empty)."""
    value = os.environ.get(name, "").strip().lower() or allowed[0]
    if value not in allowed:
        raise ValueError(
            f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not {value!r}"
        )
    return value


def switched_off(name: str) -> bool:
    """Whether the variable ``name`` is set to 0/false/no/off (the kernels' on/off switches)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def decode_flags(kv_dtype: torch.dtype) -> list[str]:
    """The compiler flags of the decode library for caches of ``kv_dtype`` (:data:`KV_BUILDS`)."""
    return [*FLAGS, *KV_BUILDS[kv_dtype][0]]


_LOADED: dict[torch.dtype, NativeDecode | None] = {}


def load(kv_dtype: torch.dtype = torch.float32) -> NativeDecode | None:
    """The kernel for caches of ``kv_dtype``, built on first call; None (logged once) when
    disabled, not buildable, or for a dtype no build reads."""
    if kv_dtype in _LOADED:
        return _LOADED[kv_dtype]
    _LOADED[kv_dtype] = None
    if switched_off(DISABLE_ENV):
        log.info("native CPU decode kernel disabled by %s", DISABLE_ENV)
        return None
    if kv_dtype not in KV_BUILDS:
        return None
    try:
        _LOADED[kv_dtype] = NativeDecode(build(flags=decode_flags(kv_dtype)), kv_dtype)
    except (OSError, RuntimeError) as exc:
        log.warning("native CPU decode kernel unavailable, using the torch path: %s", exc)
    return _LOADED[kv_dtype]


__all__ = [
    "DecodeRows",
    "NativeDecode",
    "PrefillChunks",
    "build",
    "decode_flags",
    "load",
    "switched_off",
]

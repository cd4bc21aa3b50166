"""Fused elementwise layer ops in C (``kernels/csrc/fused_ops.c``): SwiGLU, residual+RMSNorm,
rope+KV write, for float32 tensors on the CPU (the KV write also into bfloat16 caches), and the
greedy sampler's row-wise argmax.

Built and cached like the decode kernel (:func:`kernels.native.build`, same compiler, cache
and ``PAGEDSERVE_NATIVE_KERNELS=0`` switch; ``PAGEDSERVE_FUSED_OPS=0`` turns off only these)
but with ``-ffp-contract=off``: rope must round exactly as torch does. The model uses these
only where :meth:`FusedOps.supports` holds; every other dtype or device keeps the torch ops,
which stay the reference the tests compare with.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "fused_ops.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedOps:
    """The loaded library; each method checks the layout it relies on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.ps_silu_mul_f32.argtypes = [_P, _I64, _I64, _I64, _P, _I64, _I32]
        lib.ps_add_rms_norm_f32.argtypes = [_P, _P, _I64, _P, _P, _I64, _I64, _F32, _I32]
        rope_kv = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I32]
        lib.ps_rope_kv_f32.argtypes = lib.ps_rope_kv_bf16.argtypes = rope_kv
        for fn in (lib.ps_silu_mul_f32, lib.ps_add_rms_norm_f32, lib.ps_rope_kv_f32,
                   lib.ps_rope_kv_bf16):  # fmt: skip
            fn.restype = None
        lib.ps_argmax_f32.argtypes = [_P, _I64, _I64, _I64, _P, _I32]
        lib.ps_argmax_f32.restype = ctypes.c_int
        self._lib = lib
        #: the caches' dtypes :meth:`rope_kv` writes into
        self._rope_kv = {torch.float32: lib.ps_rope_kv_f32, torch.bfloat16: lib.ps_rope_kv_bf16}

    @staticmethod
    def supports(*tensors: torch.Tensor) -> bool:
        """float32 CPU tensors (what every method here takes)."""
        return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """``torch.argmax(logits, dim=-1).tolist()`` for float32 ``[rows, vocab]`` logits with
        contiguous rows (the first position of each row's maximum; torch answers for rows with
        NaN, which it counts as the largest)."""
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] == 0:
            raise ValueError("logits must be [rows, vocab > 0] with contiguous rows")
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        nan = self._lib.ps_argmax_f32(
            logits.data_ptr(), rows, vocab, logits.stride(0), out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if nan:
            return torch.argmax(logits, dim=-1).tolist()
        return out.tolist()

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """``silu(gate_up[:, :inter]) * gate_up[:, inter:]`` as a new ``[rows, inter]`` tensor."""
        if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] != 2 * inter:
            raise ValueError("gate_up must be [rows, 2 * inter] with contiguous rows")
        rows = gate_up.shape[0]
        out = gate_up.new_empty(rows, inter)
        self._lib.ps_silu_mul_f32(
            gate_up.data_ptr(), rows, inter, gate_up.stride(0), out.data_ptr(), inter,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """``residual += delta`` (in place, when given), then ``RMSNorm(residual)`` (new)."""
        rows, dim = residual.shape
        if not residual.is_contiguous() or not weight.is_contiguous() or weight.numel() != dim:
            raise ValueError("residual [rows, dim] and weight [dim] must be contiguous")
        if delta is not None and (delta.shape != residual.shape or delta.stride(1) != 1):
            raise ValueError("delta must be shaped like residual, with contiguous rows")
        out = torch.empty_like(residual)
        self._lib.ps_add_rms_norm_f32(
            residual.data_ptr(), _ptr(delta), 0 if delta is None else delta.stride(0),
            weight.data_ptr(), out.data_ptr(), rows, dim, eps, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_kv(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        table: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotate q and k inside ``qkv`` [T, (H + 2 Hkv) D] in place, then store k and v at
        their ``slots`` of the ``[blocks, block_size, Hkv, D]`` caches (float32, or bfloat16:
        rounded to nearest even, the bits of torch's ``.to(torch.bfloat16)``)."""
        tokens = qkv.shape[0]
        width = (num_heads + 2 * num_kv_heads) * head_dim
        if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != width:
            raise ValueError("qkv must be [tokens, (H + 2 Hkv) * D] with contiguous rows")
        if not (table.is_contiguous() and table.shape[-1] * 2 == head_dim):
            raise ValueError("rope table must be contiguous [positions, 2, head_dim / 2]")
        for cache in (k_cache, v_cache):
            if not cache.is_contiguous() or cache.shape[2:] != (num_kv_heads, head_dim):
                raise ValueError("caches must be contiguous [blocks, block_size, Hkv, D]")
        write = self._rope_kv.get(k_cache.dtype)
        if write is None or v_cache.dtype != k_cache.dtype:
            raise ValueError("caches must both be float32 or both bfloat16")
        if positions.dtype != torch.int64 or slots.dtype != torch.int64:
            raise ValueError("positions and slots must be int64")
        if positions.shape[0] != tokens or slots.shape[0] != tokens:
            raise ValueError("one position and one slot per token")
        write(
            qkv.data_ptr(), tokens, qkv.stride(0), num_heads, num_kv_heads, head_dim,
            table.data_ptr(), positions.contiguous().data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), slots.contiguous().data_ptr(), torch.get_num_threads(),
        )  # fmt: skip


_LOADED: FusedOps | None = None
_TRIED = False


def load() -> FusedOps | None:
    """The library, built on first call; None (logged once) when disabled or not buildable."""
    global _LOADED, _TRIED
    if _TRIED:
        return _LOADED
    _TRIED = True
    for name in (native.DISABLE_ENV, native.FUSED_ENV):
        if native.switched_off(name):
            log.info("fused CPU layer ops disabled by %s", name)
            return None
    try:
        _LOADED = FusedOps(native.build(source=SOURCE, flags=FLAGS))
    except (OSError, RuntimeError) as exc:
        log.warning("fused CPU layer ops unavailable, using torch ops: %s", exc)
    return _LOADED


__all__ = ["FusedOps", "load"]

"""Building blocks of Llama-style decoders, with fused projections and paged attention.

Parameters are created uninitialised (``torch.empty``): every one of them is overwritten by the
loader, so drawing random values first would only cost time. Projections are plain parameters fed
to ``linear`` (``F.linear``, or oneDNN for float32 on a CPU) — the fused ``qkv`` and ``gate_up``
weights are the checkpoint's separate matrices stacked along the output dimension at load time
(one matmul instead of three / two).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import AttentionBackend, AttentionMetadata, native
from kernels import gemm as native_gemm
from kernels.fused import FusedOps
from kernels.gemm import PanelWeight
from worker.models.config import ModelConfig
from worker.models.rope import apply_rope

log = logging.getLogger(__name__)

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_ONEDNN_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear (what packed and bfloat16 weights run through)."""
    return _ONEDNN_LINEAR is not None and _ONEDNN_REORDER is not None


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bfloat16 weights on this CPU (tried once on a small product).

    Why a trial: torch's oneDNN takes bfloat16 only where the CPU has AVX512BW/VL/DQ or
    AVX-NE-CONVERT; on an AVX2-only one (a Zen 3 EPYC) packing a weight raised "bf16 path needs
    the cpu support ..." while the engine loaded, which killed the worker."""
    if not onednn_available():
        return False
    try:
        weight = _ONEDNN_REORDER(torch.ones(16, 16, dtype=torch.bfloat16))
        x = torch.ones(8, 16, dtype=torch.bfloat16)
        _ONEDNN_LINEAR(x, weight, None, "none", [], "")
    except RuntimeError:
        return False
    return True


def bf16_products_available() -> bool:
    """Whether ``--weight-dtype bfloat16`` can run here: the C GEMM's bfloat16 path
    (AVX512-BF16) or oneDNN's (:func:`onednn_bf16_available`)."""
    lib = native_gemm.for_packing()
    return (lib is not None and lib.bf16) or onednn_bf16_available()


def _bucket_rows(m: int) -> int:
    """Round a row count up to one of ~150 sizes (8-row steps to 1024, 64 to 4096, 256 beyond).

    Why 8-row steps that far: oneDNN ran at the same rate (425-445 GFLOP/s, 512 -> 3072, Zen 5
    EPYC, 2 threads) at every row count from 128 to 512, so each padded row is pure waste; with
    64-row steps above 128 rows a step of 152 rows computed 192 (356 instead of 438 useful
    GFLOP/s). The bench's ``mixed`` runs did not change (A/B 1.00 and 0.99: their steps are
    mostly decode rows under 128 or a full 2048-token budget); steps of a few hundred rows do.
    The sizes stay bounded: at 5 weight shapes a model, ~750 oneDNN primitives, under its
    default cache of 1024."""
    step = 8 if m <= 1024 else 64 if m <= 4096 else 256
    return -(-m // step) * step


def bf16_native() -> bool:
    """Whether bfloat16 weights go to our C GEMM rather than oneDNN: where its bfloat16 path
    builds (AVX512-BF16), on its AMX tiles where the CPU has AMX; on a CPU with AMX whose build
    of the C GEMM lacks the tile path, oneDNN's AMX kernels stay. ``PAGEDSERVE_BF16_GEMM``
    forces one (``native`` falls back to oneDNN, logged once, where the C path is missing).

    Intel Xeon with AMX, SmolLM2's 30 layers of cold bfloat16 weights (``python -m
    bench.gemm_libs --bf16``): 16 / 48 / 64 rows in 10.8 / 15.3 / 15.9 ms against oneDNN's 17.9
    / 23.5 / 25.6; 2048-row products at 0.93-0.98x oneDNN's rate; the whole bfloat16 mode
    1.10-1.19x end to end (bench/README.md, a thirtieth session)."""
    choice = native.choice(native.BF16_GEMM_ENV, ("auto", "native", "onednn"))
    lib = native_gemm.for_packing() if choice != "onednn" else None
    has_native = lib is not None and lib.bf16
    if choice == "native" and not has_native and not _WARNED:
        _WARNED.append(True)  # once, not for every weight packed
        log.warning("%s=native: no bfloat16 C GEMM here; oneDNN instead", native.BF16_GEMM_ENV)
    if choice == "auto" and has_native and _has_amx():
        return lib is not None and lib.amx
    return has_native


_WARNED: list[bool] = []


def _has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


@dataclass(frozen=True, slots=True)
class Bf16Weight:
    """``--weight-dtype bfloat16``: a projection weight rounded to bfloat16, packed for our C
    GEMM (``panels``, :meth:`kernels.gemm.NativeGemm.pack_bf16`) or for oneDNN (``packed``), as
    :func:`bf16_native` says; each product rounds its float32 input to bfloat16 and returns
    float32 (the bias, if any, added in float32). Everything else (norms, rope, attention,
    sampling; the KV cache unless ``--kv-cache-dtype bfloat16``) stays float32.

    Why: on CPUs with AMX, bfloat16 tile products (oneDNN's ``brg_matmul``, since the thirtieth
    session our C GEMM's own, ``ps_gemm_bf16_amx``) ran SmolLM2's projections 4-6x faster than
    any float32 path at prefill sizes and 2-3x at decode sizes; on CPUs with AVX512-BF16 and no
    AMX (Zen 4) the C GEMM's ``vdpbf16ps`` path streams the decode steps' weights at half
    float32's bytes (bench/README.md). An explicit option only: outputs are no longer
    token-for-token those of float32 ``transformers``."""

    packed: torch.Tensor | None = None
    panels: PanelWeight | None = None

    @classmethod
    def pack(cls, weight: torch.Tensor, use_native: bool | None = None) -> Bf16Weight | None:
        """Through the C GEMM where ``use_native`` (default: :func:`bf16_native`) and the input
        width is even, else oneDNN; None where neither can (no oneDNN bfloat16 linear in this
        torch or on this CPU: :func:`onednn_bf16_available`). On a CPU whose C GEMM has the AMX
        path, a width off its 32-wide steps goes to oneDNN (its AMX kernels), not to
        ``vdpbf16ps`` (~200 GFLOP/s there, against 400-1800)."""
        use_native = bf16_native() if use_native is None else use_native
        lib = native_gemm.load() if use_native else None
        width = weight.shape[1]
        off_tiles = lib is not None and lib.amx and not lib.tiles_take(width)
        if lib is not None and lib.bf16 and width % 2 == 0 and not off_tiles:
            return cls(panels=lib.pack_bf16(weight))
        if not onednn_bf16_available():
            return None
        packed = pack_for_onednn(weight.detach().to(torch.bfloat16))
        return None if packed is None else cls(packed=packed)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)``, as the plain weight's (what ``bench.profile_engine`` counts FLOPs by)."""
        if self.panels is not None:
            return self.panels.shape
        assert self.packed is not None
        return self.packed.shape[0], self.packed.shape[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.panels is not None:
            return self.panels.matmul(x, bias)
        assert self.packed is not None
        out = _onednn_linear(x.to(torch.bfloat16), self.packed, None).float()
        return out if bias is None else out.add_(bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PanelWeight | Bf16Weight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``: through the C GEMM for a weight packed for it, else through oneDNN for 2-D
    float32 inputs on a CPU and for oneDNN-packed (or :class:`Bf16Weight`) weights.

    torch's default CPU GEMM (MKL) ran 15-60% slower than oneDNN's at the decode-sized shapes of
    the bench model on this project's AMD EPYC machines (e.g. 96 x 512 -> 3072: 119 vs 193
    GFLOP/s); the results differ only by summation order (float32 rounding). oneDNN compiles and
    caches a kernel per input shape, and a step's row count changes every step, so rows are
    padded to a bounded set of sizes: without that a worker's memory grew by ~100 MB over a
    5,000-job run.
    """
    if isinstance(weight, (PanelWeight, Bf16Weight)):  # packed by ``pack_weight``
        return weight.matmul(x, bias)
    if weight.is_mkldnn or (  # packed weights (``pack_weight``) exist only where oneDNN does
        _ONEDNN_LINEAR is not None
        and x.dim() == 2
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    ):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """oneDNN's matmul with a plain or packed weight, rows bucketed; any leading dimensions."""
    assert _ONEDNN_LINEAR is not None
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    m = x.shape[0]
    if m == 0:
        return x.new_empty(*lead, weight.shape[0])
    rows = _bucket_rows(m)
    if rows != m:
        x = F.pad(x, (0, 0, 0, rows - m))
    out = _ONEDNN_LINEAR(x.contiguous(), weight, bias, "none", [], "")
    return (out[:m] if rows != m else out).reshape(*lead, weight.shape[0])


def pack_weight(
    weight: torch.Tensor, fmt: str | None = None, glu: bool = False
) -> torch.Tensor | PanelWeight | Bf16Weight | None:
    """A float32 CPU projection weight packed for the C GEMM (:mod:`kernels.gemm`, where
    ``PAGEDSERVE_NATIVE_GEMM`` selects it) or else in oneDNN's blocked layout; with ``fmt``
    ``"bfloat16"`` rounded to bfloat16 (:class:`Bf16Weight`), with ``"int8"`` rounded to int8
    steps of a scale per 32 inputs of each row for the C GEMM
    (:meth:`~kernels.gemm.NativeGemm.pack_int8`; an input width off its 4-wide steps stays
    float32); None where none of these applies.
    ``glu``: a fused gate/up weight, packed for the C GEMM's SwiGLU product where it is the
    float32 path (:meth:`~kernels.gemm.NativeGemm.pack_glu`: ``linear`` then returns
    ``silu(gate) * up``), else as any other.

    Why the C GEMM: oneDNN ran the engine's decode-sized products (8-64 rows) at 9-54 GFLOP/s
    on a Zen 3 EPYC, streaming cold weights at 3-6 GB/s; on a Zen 5 one it ran them at 0.55-0.95x
    the C GEMM's rate; see kernels/gemm.py.

    Given a plain ``[out, in]`` weight, oneDNN re-blocks it inside every matmul call. Over a
    model whose weights do not fit the last-level cache that is one more pass over memory per
    projection per step: with the weights packed once, decode-sized products (16 / 48 / 96
    rows, 16 weights of 6 MB in turn) ran 281 / 394 / 454 GFLOP/s against 173 / 320 / 393,
    and 2048-row ones 503 against 479 (2 EPYC cores).
    """
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if fmt == "bfloat16":
        return Bf16Weight.pack(weight)
    gemm = native_gemm.for_packing()
    if fmt == "int8" and gemm is not None and weight.shape[1] % native_gemm.INT8_K == 0:
        return gemm.pack_int8(weight)  # (gate/up too: the plain product, then the SwiGLU pass)
    if gemm is not None:
        return gemm.pack_glu(weight) if glu else gemm.pack(weight)
    return pack_for_onednn(weight)


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout (what ``linear`` runs through oneDNN), or None
    where this torch has no oneDNN linear."""
    if _ONEDNN_REORDER is None or _ONEDNN_LINEAR is None:
        return None
    return _ONEDNN_REORDER(weight.detach())


def swap_for_packed(
    module: nn.Module, name: str, fmt: str | None = None, glu: bool = False
) -> bool:
    """Replace the weight parameter ``module.<name>`` by its packed form (the plain copy is freed
    unless something else holds it, e.g. tied embeddings). False where packing is unavailable.
    ``fmt``, ``glu``: see :func:`pack_weight`."""
    packed = pack_weight(getattr(module, name), fmt, glu)
    if packed is None:
        return False
    delattr(module, name)
    setattr(module, name, packed)
    return True


@dataclass(frozen=True, slots=True)
class LayerInputs:
    """What every layer of one forward pass shares, built once per step.

    ``fused``: the C layer ops (:mod:`kernels.fused`) when this pass may use them (float32 on
    the CPU), else None and every layer runs torch ops. ``rope_table``/``positions`` feed the
    fused rope, ``cos``/``sin`` (``[T, 1, D / 2]``) the torch one.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    rope_table: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    backend: AttentionBackend
    fused: FusedOps | None = None


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, weight applied in the model dtype (as HF does)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused op, bit-identical to the composite below for float32 (tested)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, fused: FusedOps | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual + delta, norm(residual + delta))``; with ``fused`` one C pass that adds
        in place (``residual`` must be a tensor this pass owns: the embedding's output)."""
        if fused is not None and residual.is_contiguous() and residual.dim() == 2:
            return residual, fused.add_rms_norm(residual, delta, self.weight, self.eps)
        if delta is not None:
            residual = residual + delta
        return residual, self(residual)


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str):
        super().__init__()
        inter, hidden, dt = cfg.intermediate_size, cfg.hidden_size, cfg.dtype
        self.gate_up_weight = _param(2 * inter, hidden, dtype=dt, device=device)
        self.down_weight = _param(hidden, inter, dtype=dt, device=device)
        self.gate_up_bias = _param(2 * inter, dtype=dt, device=device) if cfg.mlp_bias else None
        self.down_bias = _param(hidden, dtype=dt, device=device) if cfg.mlp_bias else None
        self.intermediate_size = inter

    def forward(self, x: torch.Tensor, fused: FusedOps | None = None) -> torch.Tensor:
        if isinstance(self.gate_up_weight, PanelWeight) and self.gate_up_weight.glu:
            # silu(gate) * up in the product itself (kernels/gemm.py ``pack_glu``)
            act = linear(x, self.gate_up_weight, self.gate_up_bias)
            return linear(act, self.down_weight, self.down_bias)
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        if fused is not None and gate_up.dim() == 2:  # silu(gate) * up in one pass
            act = fused.silu_mul(gate_up, self.intermediate_size)
            return linear(act, self.down_weight, self.down_bias)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        # In place: one activation-sized buffer fewer per layer (same values).
        return linear(F.silu(gate).mul_(up), self.down_weight, self.down_bias)


#: Cache dtypes the fused rope + KV write stores into (kernels/fused.py: float32 queries).
_FUSED_CACHES = (torch.float32, torch.bfloat16)


class PagedAttention(nn.Module):
    """Grouped-query self-attention whose keys and values live in a paged cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: torch.device | str):
        super().__init__()
        dt = cfg.dtype
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.q_size
        self.kv_size = cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        windows = cfg.layer_sliding_windows
        self.sliding_window = windows[layer_idx] if windows else cfg.sliding_window
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_weight = _param(qkv_out, cfg.hidden_size, dtype=dt, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dt, device=device) if cfg.qkv_bias else None
        self.o_weight = _param(cfg.hidden_size, self.q_size, dtype=dt, device=device)
        self.o_bias = _param(cfg.hidden_size, dtype=dt, device=device) if cfg.o_bias else None

    def forward(
        self,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        inputs: LayerInputs,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        qk_size = self.q_size + self.kv_size
        k_cache, v_cache = kv_cache
        meta, backend, fused = inputs.meta, inputs.backend, inputs.fused
        if fused is not None and k_cache.dtype in _FUSED_CACHES and k_cache.is_contiguous():
            # rope in place and the KV write in one C pass; q, k, v are views of qkv
            fused.rope_kv(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, inputs.rope_table,
                inputs.positions, k_cache, v_cache, meta.slot_mapping,
            )  # fmt: skip
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, self.head_dim)
            v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        else:
            # queries and keys rotated together: [T, H + Hkv, D] in one call, then split
            qk = apply_rope(qkv[:, :qk_size].view(t, -1, self.head_dim), inputs.cos, inputs.sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, qk_size:].reshape(t, self.num_kv_heads, self.head_dim)  # contiguous
            backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.paged_attention(
            q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window
        )
        return linear(out.reshape(t, self.q_size), self.o_weight, self.o_bias)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``forward`` takes the residual stream and the previous layer's MLP output (None for the
    first layer) and returns the residual and this layer's MLP output: each residual add is
    done together with the norm that follows it (:meth:`RMSNorm.add_norm`), the last one by
    the model's final norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, device: torch.device | str):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.attn = PagedAttention(cfg, layer_idx, device)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.mlp = GatedMLP(cfg, device)

    def forward(
        self,
        residual: torch.Tensor,
        delta: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        inputs: LayerInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = inputs.fused
        residual, h = self.input_norm.add_norm(residual, delta, fused)
        residual, h = self.post_attn_norm.add_norm(residual, self.attn(h, kv_cache, inputs), fused)
        return residual, self.mlp(h, fused)
